"""ZeRO stages 1, 2 and 3 as Optax gradient transformations."""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._src import collectives, quantize
from zerojax._src import layout as layout_lib
from zerojax._src import mesh as mesh_lib
from zerojax._src import precision as precision_lib


class ZeroState(NamedTuple):
  """The state of a ZeRO-wrapped optimizer.

  Attributes:
    inner_state: the wrapped optimizer's state, every float leaf big enough to
      matter sharded over the data axis (and zero-padded along the sharded
      dimension where that dimension does not divide by the number of devices).
    master: stages 1 and 2 under a precision policy whose compute dtype
      differs from its master dtype: the master parameters, sharded like the
      gradients (the parameters themselves are the replicated compute-dtype
      copy). ``None`` otherwise.
    loss_scale: the ``zerojax.LossScaleState`` when the policy scales the loss,
      else ``None``.
    skipped_steps: how many updates were skipped because their gradients were
      not finite (int32 scalar).
    pre_clip_grad_norm: the global L2 norm of the gradients the last
      ``update`` received, before the wrapped optimizer (and any clipping in
      it) saw them (float32 scalar).

  Example:
    >>> import jax, jax.numpy as jnp, optax, zerojax
    >>> tx = zerojax.zero2(optax.adam(1e-3), mesh=jax.make_mesh((jax.device_count(),), ("data",)))
    >>> state = tx.init({"w": jnp.ones((4, 1024))})
    >>> state.inner_state[0].mu["w"].sharding.shard_shape((4, 1024)), int(state.skipped_steps)
    ((4, 128), 0)
  """

  inner_state: optax.OptState
  master: optax.Params | None = None
  loss_scale: precision_lib.LossScaleState | None = None
  skipped_steps: jax.Array | None = None
  pre_clip_grad_norm: jax.Array | None = None


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
    axis_name: the data-parallel mesh axis (or tuple of axes) that everything is
      sharded over, as given.
    data_axes: ``axis_name`` as a tuple.
    replica_axes: the axes everything is replicated over and the batch split
      over (hybrid sharding), as a tuple; empty without ``replica_axis``.
    inner: the wrapped transformation.
    precision: the ``zerojax.Precision`` policy.
    quantized_weights: ``"int8"``, ``"int4"`` or ``None``, as given.
    quantized_gradients: ``"int8"``, ``"int4"`` or ``None``, as given.
    weight_quantization: the ``Quantization`` (bits, block size) of stage 3's
      weight all-gathers, or ``None``.
    gradient_quantization: that of the gradient reduce-scatters, or ``None``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, zerojax
    >>> tx = zerojax.zero3(optax.adam(1e-3), mesh=jax.make_mesh((jax.device_count(),), ("data",)))
    >>> params = tx.shard({"w": jnp.ones((4, 1024))})
    >>> tx.stage, params["w"].sharding.shard_shape((4, 1024)), tx.gather(params)["w"].shape
    (3, (4, 128), (4, 1024))
  """

  stage: int
  mesh: Mesh
  axis_name: str | tuple[str, ...]
  data_axes: tuple[str, ...]
  replica_axes: tuple[str, ...]
  inner: optax.GradientTransformationExtraArgs
  precision: precision_lib.Precision
  quantized_weights: str | None
  quantized_gradients: str | None
  weight_quantization: quantize.Quantization | None
  gradient_quantization: quantize.Quantization | None

  def __new__(
    cls,
    inner,
    *,
    stage,
    mesh,
    axis_name,
    replica_axis,
    layout,
    min_shard_size,
    precision,
    quantized_weights=None,
    quantized_gradients=None,
    quantization_block_size=quantize.DEFAULT_BLOCK_SIZE,
  ):
    data_axes, replica_axes = layout_lib.axes(axis_name), layout_lib.axes(replica_axis or ())
    planner = Planner(
      inner, stage, mesh, data_axes, replica_axes, layout, min_shard_size, precision
    )
    self = super().__new__(cls, planner.init, planner.update)
    self.stage, self.mesh, self.axis_name, self.inner = stage, mesh, axis_name, planner.inner
    self.data_axes, self.replica_axes = data_axes, replica_axes
    self.precision = precision
    self.quantized_weights, self.quantized_gradients = quantized_weights, quantized_gradients
    self.weight_quantization = quantize.resolve(
      "quantized_weights", quantized_weights, quantization_block_size
    )
    self.gradient_quantization = quantize.resolve(
      "quantized_gradients", quantized_gradients, quantization_block_size
    )
    self._planner = planner
    return self

  @property
  def num_shards(self) -> int:
    """How many shards the data axes split everything into (the product of their sizes)."""
    return math.prod(self.mesh.shape[name] for name in self.data_axes)

  @property
  def batch_axes(self) -> tuple[str, ...]:
    """The axes a batch is split over (the replica axes first, then the data axes).

    Place a batch with ``NamedSharding(mesh, P(tx.batch_axes))``.
    """
    return self.replica_axes + self.data_axes

  @property
  def num_replicas(self) -> int:
    """How many copies the replica axes hold (1 without ``replica_axis``)."""
    return math.prod(self.mesh.shape[name] for name in self.replica_axes)

  def shard(self, params: optax.Params) -> optax.Params:
    """Places full parameters as this stage stores them.

    Stages 1 and 2 replicate them over the data axis; stage 3 keeps 1/N of
    each (zero-padding leaves whose sharded dimension does not divide by N).
    Floating-point leaves are cast to the stored dtype: the precision policy's
    master dtype in stage 3; in stages 1 and 2 its compute dtype (so call
    ``init`` on the full-precision parameters first). Inside ``jax.jit`` this
    is a sharding constraint.
    """
    plans = self._planner.plans(params)
    if mesh_lib.is_traced(params):
      store = lambda tree: plans.params.map(_stored, plans.to_logical(tree))
      return mesh_lib.global_view(self.mesh, store, plans.params.specs())(params)
    place = lambda leaf, x: jax.device_put(x, NamedSharding(self.mesh, leaf.partition_spec))
    return plans.params.map(lambda leaf, x: place(leaf, _stored(leaf, x)), plans.to_logical(params))

  def gather(self, params: optax.Params) -> optax.Params:
    """Full, unpadded parameters, replicated over the data axis (for evaluation and export).

    Pass ``tx.master_params(params, state)`` instead of ``params`` for the
    full-precision copy.
    """
    return self._planner.gather(params)

  def master_params(self, params: optax.Params, state: ZeroState) -> optax.Params:
    """The master (full-precision) parameters, as stored: sharded in every stage.

    They are ``params`` themselves unless stages 1 or 2 keep a separate master
    copy in ``state`` (a precision policy with a lower compute dtype).
    """
    return params if state.master is None else state.master

  def unpad(self, params: optax.Params) -> optax.Params:
    """Stored parameters with their padding sliced off, still sharded (inside ``jax.jit``).

    Only a drop-in stage-3 step whose parameters have padded leaves needs this:
    call the model on ``tx.unpad(params)``. It is the identity for leaves that
    needed no padding, and for stages 1 and 2. On a mesh with explicit axes,
    whose types cannot express an uneven split, padded leaves come out whole
    over the data axes (other axes kept); on ``Auto`` axes the compiler keeps
    them split.
    """
    plans = self._planner.plans(params)
    if not (mesh_lib.is_explicit(self.mesh) and mesh_lib.is_traced(params)):
      return plans.to_logical(params)
    specs = plans.params.map(
      lambda leaf: leaf.full_spec(self.data_axes) if leaf.padding else leaf.partition_spec
    )
    return mesh_lib.global_view(self.mesh, plans.to_logical, specs)(params)

  def param_shardings(self, params: optax.Params) -> Any:
    """The ``NamedSharding`` of every stored parameter (for ``jax.jit`` and checkpoint restore).

    Args:
      params: the parameters, full or stored, as arrays or ``jax.ShapeDtypeStruct``.
    """
    return self._planner.plans(params).params.shardings(self.mesh)

  def state_shardings(self, params: optax.Params) -> ZeroState:
    """The ``NamedSharding`` of every optimizer-state leaf that ``init(params)`` returns."""
    specs = self._planner.plans(params).state_specs()
    return jax.tree.map(
      lambda spec: NamedSharding(self.mesh, spec), specs, is_leaf=lambda x: isinstance(x, P)
    )

  def logical_shapes(self, params: optax.Params) -> tuple[Any, ZeroState]:
    """``jax.ShapeDtypeStruct`` s of the stored parameters and state, without the padding.

    What the training state is whatever the device count: checkpoints record
    it, and restore across device counts and stages where it agrees.
    """
    plans = self._planner.plans(params)
    logical = lambda layout: layout.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
    state = ZeroState(
      inner_state=logical(plans.state),
      master=None if plans.master is None else logical(plans.master),
      **jax.eval_shape(lambda: bookkeeping(self.precision)),
    )
    return logical(plans.params), state

  def layout(self, params: optax.Params) -> layout_lib.Layout:
    """The plan: how each leaf of ``params`` is split (see ``zerojax.Layout``)."""
    return self._planner.plans(params).sharded


class Plans(NamedTuple):
  """Every layout that one parameter tree implies."""

  sharded: layout_lib.Layout  # gradients and master params, what optimizer state mirrors
  params: layout_lib.Layout  # stored parameters: ``sharded`` in stage 3, else replicated
  state: layout_lib.Layout  # inner optimizer state
  master: layout_lib.Layout | None  # a separate master copy (stages 1-2, lower compute dtype)
  loss_scaled: bool

  def to_logical(self, tree: Any) -> Any:
    """Unpads leaves given in stored shape; leaves already in logical shape pass."""
    return self.sharded.map(_to_logical, tree)

  def to_master(self, tree: Any) -> Any:
    """Logical shape, master dtype."""
    return self.sharded.map(lambda leaf, x: _to_logical(leaf, x).astype(leaf.dtype), tree)

  def state_specs(self) -> ZeroState:
    """The ``PartitionSpec`` of every leaf of the ``ZeroState``."""
    return ZeroState(
      inner_state=self.state.specs(),
      master=None if self.master is None else self.master.specs(),
      loss_scale=precision_lib.LossScaleState(P(), P(), P()) if self.loss_scaled else None,
      skipped_steps=P(),
      pre_clip_grad_norm=P(),
    )


def _stored(leaf: layout_lib.LeafLayout, x: Any) -> Any:
  """A leaf cast to its stored dtype and padded (host arrays stay on the host)."""
  return leaf.pad(x if np.dtype(x.dtype) == leaf.dtype else x.astype(leaf.dtype))


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


class Planner:
  """Holds the configuration and the layouts of the parameter trees it has seen."""

  def __init__(self, inner, stage, mesh, data_axes, replica_axes, layout, min_shard_size, policy):
    self.inner = optax.with_extra_args_support(inner)
    self.stage = stage
    self.mesh = mesh
    self.data_axes = data_axes
    self.replica_axes = replica_axes
    self.rule = layout
    self.min_shard_size = min_shard_size
    self.policy = policy
    # Keyed by the logical and the stored signature of each tree seen, so that
    # stored (padded) parameters find the plan made from their full shapes.
    self._known: dict[Any, Plans] = {}
    self._update = jax.jit(self._update_impl, static_argnames="plans")
    self._init = jax.jit(self._init_impl, static_argnames="plans")
    self._gather = jax.jit(self._gather_impl, static_argnames="plans")

  def plans(self, tree: Any) -> Plans:
    key = layout_lib.signature(tree)
    if key not in self._known:
      plans = self.plan(tree)
      for stored in (False, True):
        self._known.setdefault(plans.sharded.key(stored), plans)
        self._known.setdefault(plans.params.key(stored), plans)
      self._known[key] = plans
    return self._known[key]

  def plan(self, params: Any) -> Plans:
    """Plans every layout that the parameter tree ``params`` implies."""
    plan = functools.partial(
      layout_lib.plan,
      axis_name=self.data_axes,
      num_shards=math.prod(self.mesh.shape[name] for name in self.data_axes),
      min_shard_size=self.min_shard_size,
      axis_sizes=dict(self.mesh.shape),
      replica_axes=self.replica_axes,
    )
    sharded = plan(params, rule=self.rule).with_dtypes(self.policy.master_dtype)
    if self.stage == 3:
      stored, master = sharded, None
    else:
      stored = layout_lib.replicated(sharded, self.data_axes).with_dtypes(self.policy.compute_dtype)
      master = sharded if stored.key(False) != sharded.key(False) else None
    logical = sharded.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
    state = plan(jax.eval_shape(self.inner.init, logical), like=sharded)
    return Plans(sharded, stored, state, master, self.policy.loss_scale is not None)

  def gather(self, params: optax.Params) -> optax.Params:
    with mesh_lib.entered(self.mesh, params):
      return self._gather(params, plans=self.plans(params))

  def _gather_impl(self, params, plans):
    specs = plans.params.map(lambda leaf: leaf.full_spec(self.data_axes))
    return mesh_lib.global_view(self.mesh, plans.to_logical, specs)(params)

  def init(self, params: optax.Params) -> ZeroState:
    plans = self.plans(params)
    if plans.master is not None:
      _check_full_precision(params, plans.sharded)
    with mesh_lib.entered(self.mesh, params):
      return self._init(params, plans=plans)

  def _init_impl(self, params, plans):
    def init(params):
      master = plans.to_master(params)
      return ZeroState(
        inner_state=plans.state.pad(self.inner.init(master)),
        master=None if plans.master is None else plans.master.pad(master),
        **bookkeeping(self.policy),
      )

    return mesh_lib.global_view(self.mesh, init, plans.state_specs())(params)

  def update(self, updates, state, params=None, **extra_args):
    plans = self.plans(updates if params is None else params)
    check_policy(state, master=plans.master is not None, loss_scaled=plans.loss_scaled)
    _check_shapes(state.inner_state, plans.state, "optimizer state")
    if plans.master is not None and params is None:
      raise ValueError(
        "this transformation keeps master parameters apart from the (lower-"
        "precision) parameters, so update needs them: call "
        "tx.update(grads, state, params)."
      )
    with mesh_lib.entered(self.mesh, updates, state, params, extra_args):
      return self._update(updates, state, params, extra_args, plans=plans)

  def _update_impl(self, updates, state, params, extra_args, plans):
    # Logical shapes sharded like the stored ones: unevenly where padded, which
    # jit allows for intermediates.
    logical = plans.sharded.specs()
    policy = self.policy

    def update(grads, state, params):
      grads = mesh_lib.constrain(self.mesh, plans.to_master(grads), logical)
      if plans.master is not None:
        master = plans.master.unpad(state.master)
      elif params is not None:
        master = plans.to_master(params)
      else:
        master = None
      if master is not None:
        master = mesh_lib.constrain(self.mesh, master, logical)
      inner_state = plans.state.unpad(state.inner_state)
      new_updates, new_inner = self.inner.update(grads, inner_state, master, **extra_args)
      finite = precision_lib.all_finite(grads)
      keep = finite if policy.skip_nonfinite else jnp.asarray(True)
      new_inner = precision_lib.select(keep, new_inner, inner_state)
      new_master = None
      if plans.master is not None:
        new_master = precision_lib.select(keep, optax.apply_updates(master, new_updates), master)
        new_updates = _difference(self.mesh, plans, new_master, params)
      new_updates = jax.tree.map(lambda u: _unless(keep, u), new_updates)
      new_state = ZeroState(
        inner_state=plans.state.pad(new_inner),
        master=None if new_master is None else plans.master.pad(new_master),
        loss_scale=precision_lib.adjust_loss_scale(policy, state.loss_scale, finite),
        skipped_steps=state.skipped_steps + (~keep).astype(jnp.int32),
        pre_clip_grad_norm=optax.tree.norm(grads).astype(jnp.float32),
      )
      return plans.params.pad(new_updates), new_state

    out_specs = (plans.params.specs(), plans.state_specs())
    return mesh_lib.global_view(self.mesh, update, out_specs)(updates, state, params)


def check_policy(
  state: Any, *, master: bool | None = None, loss_scaled: bool | None = None
) -> None:
  """Raises unless ``state`` is a ``ZeroState`` with (or without) a master copy and loss scale.

  ``None`` leaves that part unchecked.
  """
  if not isinstance(state, ZeroState):
    raise ValueError(
      f"state is a {type(state).__name__}, not a ZeroState: pass the state "
      "that this transformation's init returned."
    )
  for what, expected, has in (
    ("master parameters", master, state.master is not None),
    ("a loss scale", loss_scaled, state.loss_scale is not None),
  ):
    if expected is not None and expected != has:
      raise ValueError(
        f"the optimizer state was made for another precision policy (it "
        f"{'has' if has else 'lacks'} {what}): pass the state that this "
        "transformation's init returned."
      )


def bookkeeping(policy: precision_lib.Precision) -> dict[str, Any]:
  """The ``ZeroState`` fields of a fresh state besides the optimizer's and the master copy."""
  return dict(
    loss_scale=precision_lib.init_loss_scale(policy),
    skipped_steps=jnp.zeros((), jnp.int32),
    pre_clip_grad_norm=jnp.zeros((), jnp.float32),
  )


def _unless(keep: jax.Array, update: jax.Array) -> jax.Array:
  """``update``, or, for a skipped step, one that leaves every parameter bit-identical.

  That is -0.0 for floats: ``x + -0.0 == x`` for every ``x``, -0.0 included
  (``-0.0 + 0.0`` would be +0.0).
  """
  no_op = -0.0 if jnp.issubdtype(update.dtype, jnp.floating) else 0
  return jnp.where(keep, update, jnp.asarray(no_op, update.dtype))


def _difference(mesh: Mesh, plans: Plans, new_master: Any, params: Any) -> Any:
  """Updates that take the compute-dtype ``params`` to ``new_master`` rounded to the compute dtype.

  They are computed in the master dtype, where the difference of two
  compute-dtype values is exact, so that ``optax.apply_updates`` (which adds in
  the wider dtype, then casts back) lands on the rounded master exactly. The
  rounding comes before the replication, so the all-gather moves compute-dtype
  bytes.
  """
  # Pinning the master's sharding, and moving the rounded values as bits, keep
  # the compiler from replicating the master first and rounding afterwards.
  new_master = mesh_lib.constrain(mesh, new_master, plans.sharded.specs())
  bits = plans.params.map(lambda leaf, x: collectives.as_bits(x.astype(leaf.dtype)), new_master)
  bits = mesh_lib.constrain(mesh, bits, plans.params.specs())
  return plans.params.map(
    lambda leaf, new, old, wide: (
      collectives.from_bits(new, leaf.dtype).astype(wide.dtype) - old.astype(wide.dtype)
    ),
    bits,
    params,
    new_master,
  )


def _check_full_precision(params: Any, sharded: layout_lib.Layout) -> None:
  for (path, x), leaf in zip(
    jax.tree_util.tree_flatten_with_path(params)[0], sharded.leaves, strict=True
  ):
    if np.dtype(x.dtype) != leaf.dtype:
      raise ValueError(
        f"init makes the {leaf.dtype} master copy of the parameters, but "
        f"params{jax.tree_util.keystr(path)} is {np.dtype(x.dtype)}: call "
        "tx.init(params) on the full-precision parameters, before tx.shard(params) "
        f"casts them (or cast them with jax.tree.map(lambda p: p.astype('{leaf.dtype}'), params))."
      )


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


def _zero(stage: int, inner, mesh, axis_name, **options) -> ZeroTransformation:
  if not hasattr(inner, "init") or not hasattr(inner, "update"):
    raise ValueError(
      f"zero{stage} wraps an optax.GradientTransformation, got {type(inner).__name__}; "
      "pass e.g. optax.adamw(1e-3)."
    )
  quantize.check_stage(stage, options["quantized_weights"])
  return ZeroTransformation(
    inner,
    stage=stage,
    mesh=mesh_lib.resolve_mesh(mesh, axis_name, options["replica_axis"]),
    axis_name=axis_name,
    **{**options, "precision": precision_lib.resolve(options["precision"])},
  )


_ARGS_DOC = """
  Args:
    inner: any ``optax.GradientTransformation``. It runs on global arrays, so
      anything that needs a norm or a whole matrix (``clip_by_global_norm``,
      LAMB, Adafactor, Muon) computes exactly what it computes unwrapped.
    mesh: the device mesh; by default the one set with ``jax.set_mesh``.
    axis_name: the data-parallel axis of ``mesh`` to shard over, or a tuple of
      axes to shard over jointly (all the fast axes of a TPU slice, say).
      Gathers and reduce-scatters never leave a group of these axes. Other
      axes that the parameters are already placed on (tensor parallelism,
      with ``jax.device_put`` and a ``NamedSharding``) are kept: the data axes
      are added on another dimension, or jointly on the same one when no
      other divides.
    replica_axis: an axis (or tuple of axes) of ``mesh`` over which
      everything is replicated and the batch split (hybrid sharding, HSDP):
      gradients are reduce-scattered inside each data group, then the
      shard-sized result is all-reduced across replicas. ``None`` by default.
    layout: per-leaf override of which dimension is sharded: a pytree (a prefix
      of the params) of ``PartitionSpec`` or ``None``, or a function
      ``(path, jax.ShapeDtypeStruct) -> PartitionSpec | None``. A spec places
      ``axis_name`` on the dimension to shard (``P()`` replicates the leaf)
      and may name other mesh axes to place the leaf on; ``None`` keeps the
      default rule (see ``zerojax.default_shard_dim``).
    min_shard_size: leaves with fewer elements stay replicated by default.
    precision: a ``zerojax.Precision`` policy (master, compute and reduce
      dtypes; loss scaling; skipping non-finite steps), or one of ``"fp32"``,
      ``"bf16"``, ``"fp16"``. By default nothing is cast and no step skipped.
    quantized_weights: stage 3 only: ``"int8"`` (or ``"int4"``) sends each
      weight all-gather of ``zerojax.value_and_grad`` as block-quantized
      integers plus one float32 scale per block (ZeRO++'s qwZ), dequantized to
      the compute dtype on arrival. Only the moved copy is quantized: stored
      parameters and optimizer state never are. ``None`` by default.
    quantized_gradients: ``"int8"`` (or ``"int4"``) turns each gradient
      reduce-scatter of ``zerojax.value_and_grad`` into an all-to-all of
      block-quantized chunks that each device sums in float32 (ZeRO++'s
      qgZ); with ``replica_axis``, the shard's sum across replicas becomes a
      quantized all-to-all and all-gather too. Replicated small leaves stay
      unquantized. ``None`` by default.
    quantization_block_size: elements per scale (even; 256 by default).

  Returns:
    A ``ZeroTransformation``.
"""


def _stage(stage: int, summary: str):
  """The public factory ``zero{stage}``, with ``summary`` and the shared argument docs."""

  def factory(
    inner: optax.GradientTransformation,
    *,
    mesh: Mesh | None = None,
    axis_name: str | tuple[str, ...] = "data",
    replica_axis: str | tuple[str, ...] | None = None,
    layout: Any = None,
    min_shard_size: int = layout_lib.DEFAULT_MIN_SHARD_SIZE,
    precision: precision_lib.Precision | str | None = None,
    quantized_weights: str | None = None,
    quantized_gradients: str | None = None,
    quantization_block_size: int = quantize.DEFAULT_BLOCK_SIZE,
  ) -> ZeroTransformation:
    return _zero(
      stage,
      inner,
      mesh,
      axis_name,
      replica_axis=replica_axis,
      layout=layout,
      min_shard_size=min_shard_size,
      precision=precision,
      quantized_weights=quantized_weights,
      quantized_gradients=quantized_gradients,
      quantization_block_size=quantization_block_size,
    )

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
