"""ZeRO stages 1, 2 and 3 as Optax gradient transformations."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from zerojax._src import layout as layout_lib
from zerojax._src import mesh as mesh_lib


class ZeroState(NamedTuple):
  """The state of a ZeRO-wrapped optimizer.

  Attributes:
    inner_state: the wrapped optimizer's state, every float leaf big enough to
      matter sharded over the data axis (and zero-padded along the sharded
      dimension where that dimension does not divide by the number of devices).
  """

  inner_state: optax.OptState


class ZeroTransformation(optax.GradientTransformationExtraArgs):
  """An Optax transformation whose state (and gradients, and parameters) are sharded.

  Build one with ``zerojax.zero1``, ``zero2`` or ``zero3``. It is an
  ``optax.GradientTransformationExtraArgs``: ``init``, ``update`` and
  ``optax.apply_updates`` work as usual, inside or outside ``jax.jit``. The
  extra methods place arrays as the stage stores them.

  ``update`` accepts gradients either in the stage's layout (as
  ``zerojax.value_and_grad`` returns them) or as plain full arrays (as
  ``jax.grad`` returns them in a drop-in step), and returns updates in the
  parameters' layout.

  Attributes:
    stage: 1, 2 or 3.
    mesh: the ``jax.sharding.Mesh``.
    axis_name: the data-parallel mesh axis that everything is sharded over.
    inner: the wrapped transformation.
  """

  stage: int
  mesh: Mesh
  axis_name: str
  inner: optax.GradientTransformationExtraArgs

  def __new__(cls, inner, *, stage, mesh, axis_name, layout, min_shard_size):
    planner = _Planner(inner, stage, mesh, axis_name, layout, min_shard_size)
    self = super().__new__(cls, planner.init, planner.update)
    self.stage, self.mesh, self.axis_name, self.inner = stage, mesh, axis_name, planner.inner
    self._planner = planner
    return self

  @property
  def num_shards(self) -> int:
    """The size of the data axis."""
    return self.mesh.shape[self.axis_name]

  def shard(self, params: optax.Params) -> optax.Params:
    """Places full parameters as this stage stores them.

    Stages 1 and 2 replicate them over the data axis; stage 3 keeps 1/N of
    each (zero-padding leaves whose sharded dimension does not divide by N).
    Inside ``jax.jit`` this is a sharding constraint.
    """
    plans = self._planner.plans(params)
    params = plans.to_logical(params)
    if mesh_lib.is_traced(params):
      return mesh_lib.global_view(self.mesh, plans.params.pad, plans.params.specs())(params)
    return plans.params.map(
      lambda leaf, x: jax.device_put(leaf.pad(x), NamedSharding(self.mesh, leaf.partition_spec)),
      params,
    )

  def gather(self, params: optax.Params) -> optax.Params:
    """Full, unpadded parameters, replicated over the data axis (for evaluation and export)."""
    return self._planner.gather(params)

  def unpad(self, params: optax.Params) -> optax.Params:
    """Stored parameters with their padding sliced off, still sharded (inside ``jax.jit``).

    Only a drop-in stage-3 step whose parameters have padded leaves needs this:
    call the model on ``tx.unpad(params)``. It is the identity for leaves that
    needed no padding, and for stages 1 and 2.
    """
    return self._planner.plans(params).to_logical(params)

  def param_shardings(self, params: optax.Params) -> Any:
    """The ``NamedSharding`` of every stored parameter (for ``jax.jit`` and checkpoint restore).

    Args:
      params: the parameters, full or stored, as arrays or ``jax.ShapeDtypeStruct``.
    """
    return self._planner.plans(params).params.shardings(self.mesh)

  def state_shardings(self, params: optax.Params) -> ZeroState:
    """The ``NamedSharding`` of every optimizer-state leaf that ``init(params)`` returns."""
    return ZeroState(self._planner.plans(params).state.shardings(self.mesh))

  def layout(self, params: optax.Params) -> layout_lib.Layout:
    """The plan: how each leaf of ``params`` is split (see ``zerojax.Layout``)."""
    return self._planner.plans(params).sharded


class _Plans(NamedTuple):
  """Every layout that one parameter tree implies."""

  sharded: layout_lib.Layout  # gradients, and what optimizer state mirrors
  params: layout_lib.Layout  # stored parameters: ``sharded`` in stage 3, else replicated
  state: layout_lib.Layout  # inner optimizer state

  def to_logical(self, tree: Any) -> Any:
    """Unpads leaves given in stored shape; leaves already in logical shape pass."""
    return self.sharded.map(_to_logical, tree)


def _to_logical(leaf: layout_lib.LeafLayout, x: Any) -> Any:
  shape = tuple(np.shape(x))
  if shape == leaf.shape:
    return x
  if shape == leaf.stored_shape:
    return leaf.unpad(x)
  raise ValueError(
    f"a leaf has shape {shape}, but this layout expects {leaf.shape} (or "
    f"{leaf.stored_shape} padded): these arrays are from another model or layout."
  )


class _Planner:
  """Holds the configuration and the layouts of the parameter trees it has seen."""

  def __init__(self, inner, stage, mesh, axis_name, layout, min_shard_size):
    self.inner = optax.with_extra_args_support(inner)
    self.stage = stage
    self.mesh = mesh
    self.axis_name = axis_name
    self.rule = layout
    self.min_shard_size = min_shard_size
    # Keyed by the logical and the stored signature of each tree seen, so that
    # stored (padded) parameters find the plan made from their full shapes.
    self._known: dict[Any, _Plans] = {}
    self._update = jax.jit(self._update_impl, static_argnames="plans")
    self._init = jax.jit(self._init_impl, static_argnames="plans")
    self._gather = jax.jit(self._gather_impl, static_argnames="plans")

  def plans(self, tree: Any) -> _Plans:
    key = layout_lib.signature(tree)
    if key not in self._known:
      plans = self._plan(tree)
      for stored in (False, True):
        self._known.setdefault(plans.sharded.key(stored), plans)
        self._known.setdefault(plans.params.key(stored), plans)
      self._known[key] = plans
    return self._known[key]

  def _plan(self, params: Any) -> _Plans:
    num_shards = self.mesh.shape[self.axis_name]
    plan = functools.partial(
      layout_lib.plan,
      axis_name=self.axis_name,
      num_shards=num_shards,
      min_shard_size=self.min_shard_size,
    )
    sharded = plan(params, rule=self.rule)
    stored = sharded if self.stage == 3 else layout_lib.replicated(sharded, self.axis_name)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
    state = plan(jax.eval_shape(self.inner.init, abstract), like=sharded)
    return _Plans(sharded, stored, state)

  def gather(self, params: optax.Params) -> optax.Params:
    with mesh_lib.entered(self.mesh, params):
      return self._gather(params, plans=self.plans(params))

  def _gather_impl(self, params, plans):
    specs = plans.params.map(lambda leaf: leaf.full_spec(self.axis_name))
    return mesh_lib.global_view(self.mesh, plans.to_logical, specs)(params)

  def init(self, params: optax.Params) -> ZeroState:
    with mesh_lib.entered(self.mesh, params):
      return self._init(params, plans=self.plans(params))

  def _init_impl(self, params, plans):
    def init(params):
      return ZeroState(plans.state.pad(self.inner.init(plans.to_logical(params))))

    return mesh_lib.global_view(self.mesh, init, ZeroState(plans.state.specs()))(params)

  def update(self, updates, state, params=None, **extra_args):
    plans = self.plans(updates if params is None else params)
    if not isinstance(state, ZeroState):
      raise ValueError(
        f"state is a {type(state).__name__}, not a ZeroState: pass the state "
        "that this transformation's init returned."
      )
    _check_shapes(state.inner_state, plans.state, "optimizer state")
    with mesh_lib.entered(self.mesh, updates, state, params, extra_args):
      return self._update(updates, state, params, extra_args, plans=plans)

  def _update_impl(self, updates, state, params, extra_args, plans):
    # Logical shapes sharded like the stored ones: unevenly where padded, which
    # jit allows for intermediates.
    logical = plans.sharded.specs()

    def update(updates, inner_state, params):
      updates = mesh_lib.constrain(self.mesh, plans.to_logical(updates), logical)
      if params is not None:
        params = mesh_lib.constrain(self.mesh, plans.to_logical(params), logical)
      inner_state = plans.state.unpad(inner_state)
      updates, inner_state = self.inner.update(updates, inner_state, params, **extra_args)
      return plans.params.pad(updates), ZeroState(plans.state.pad(inner_state))

    out_specs = (plans.params.specs(), ZeroState(plans.state.specs()))
    return mesh_lib.global_view(self.mesh, update, out_specs)(updates, state.inner_state, params)


def _check_shapes(tree: Any, layout: layout_lib.Layout, what: str) -> None:
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  if treedef != layout.treedef:
    raise ValueError(
      f"{what} does not have the structure this transformation expects: got "
      f"{treedef}, expected {layout.treedef}. Use the {what} that init returned "
      "for these parameters."
    )
  for (path, x), leaf in zip(leaves, layout.leaves, strict=True):
    if tuple(np.shape(x)) != leaf.stored_shape:
      raise ValueError(
        f"{what} leaf {jax.tree_util.keystr(path)} has shape {np.shape(x)}, "
        f"expected {leaf.stored_shape}: it was made for another model, stage "
        "or device count."
      )


def _zero(stage: int, inner, mesh, axis_name, layout, min_shard_size) -> ZeroTransformation:
  if not hasattr(inner, "init") or not hasattr(inner, "update"):
    raise ValueError(
      f"zero{stage} wraps an optax.GradientTransformation, got {type(inner).__name__}; "
      "pass e.g. optax.adamw(1e-3)."
    )
  return ZeroTransformation(
    inner,
    stage=stage,
    mesh=mesh_lib.resolve_mesh(mesh, axis_name),
    axis_name=axis_name,
    layout=layout,
    min_shard_size=min_shard_size,
  )


_ARGS_DOC = """
  Args:
    inner: any ``optax.GradientTransformation``. It runs on global arrays, so
      anything that needs a norm or a whole matrix (``clip_by_global_norm``,
      LAMB, Adafactor, Muon) computes exactly what it computes unwrapped.
    mesh: the device mesh; by default the one set with ``jax.set_mesh``.
    axis_name: the data-parallel axis of ``mesh`` to shard over. Other axes
      are left as the arrays' own shardings have them.
    layout: per-leaf override of which dimension is sharded: a pytree (a prefix
      of the params) of ``PartitionSpec`` or ``None``, or a function
      ``(path, jax.ShapeDtypeStruct) -> PartitionSpec | None``. A spec places
      ``axis_name`` on the dimension to shard (``P()`` replicates the leaf);
      ``None`` keeps the default rule (see ``zerojax.default_shard_dim``).
    min_shard_size: leaves with fewer elements stay replicated by default.

  Returns:
    A ``ZeroTransformation``.
"""


def _stage(stage: int, summary: str):
  """The public factory ``zero{stage}``, with ``summary`` and the shared argument docs."""

  def factory(
    inner: optax.GradientTransformation,
    *,
    mesh: Mesh | None = None,
    axis_name: str = "data",
    layout: Any = None,
    min_shard_size: int = layout_lib.DEFAULT_MIN_SHARD_SIZE,
  ) -> ZeroTransformation:
    return _zero(stage, inner, mesh, axis_name, layout, min_shard_size)

  factory.__name__ = factory.__qualname__ = f"zero{stage}"
  factory.__doc__ = summary + _ARGS_DOC
  return factory


zero1 = _stage(
  1,
  """ZeRO stage 1: shards the optimizer state over the data axis.

  Parameters stay replicated. With ``zerojax.value_and_grad`` each device keeps
  its full local gradient and reduce-scatters it once, at the end of the
  backward pass; the optimizer updates each device's 1/N and the updated
  parameters are all-gathered. Per device: Ψ params + Ψ grads + KΨ/N state.

  Example:
    >>> import jax, jax.numpy as jnp, optax, zerojax
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = zerojax.zero1(optax.adam(1e-3), mesh=mesh)
    >>> params = tx.shard({"w": jnp.ones((64, 64))})
    >>> state = tx.init(params)
    >>> state.inner_state[0].mu["w"].sharding.spec
    P(None, 'data')
""",
)
zero2 = _stage(
  2,
  """ZeRO stage 2: shards the optimizer state and the gradients.

  Parameters stay replicated. With ``zerojax.value_and_grad`` each layer's
  gradient is reduce-scattered as soon as the backward pass produces it, so no
  full-size gradient ever exists. Per device: Ψ params + Ψ/N grads + KΨ/N state.

  Example:
    >>> import jax, jax.numpy as jnp, optax, zerojax
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = zerojax.zero2(optax.adam(1e-3), mesh=mesh)
    >>> params = tx.shard({"w": jnp.ones((64, 64))})
    >>> params["w"].sharding.spec
    P()
""",
)
zero3 = _stage(
  3,
  """ZeRO stage 3: shards the optimizer state, the gradients and the parameters.

  Each device stores 1/N of every parameter; ``zerojax.gather`` assembles a
  layer's weights right before use (all-gather), and the backward pass
  reduce-scatters their gradients. Per device: (2 + K)Ψ/N plus one gathered
  layer at a time.

  Example:
    >>> import jax, jax.numpy as jnp, optax, zerojax
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = zerojax.zero3(optax.adam(1e-3), mesh=mesh)
    >>> params = tx.shard({"w": jnp.ones((64, 64))})
    >>> params["w"].sharding.spec
    P(None, 'data')
""",
)
