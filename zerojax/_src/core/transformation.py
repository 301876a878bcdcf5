"""ZeRO stages 1, 2 and 3 as Optax gradient transformations.

A ``ZeroTransformation`` is an ``optax.GradientTransformationExtraArgs`` whose
``init`` and ``update`` are the bound methods of one ``ShardedOptimizer``.
Everything else it offers (its settings, ``shard``, ``gather``, the
shardings) is read from that object, found through ``init``. So the
transformation is nothing but its two functions, as every optax
transformation is: ``copy.copy``, ``copy.deepcopy``, ``jax.tree.map`` and
``_replace`` give back a transformation that behaves the same (see
docs/design.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from zerojax._src.comm import quantized as quantize
from zerojax._src.comm import shards as shards_lib
from zerojax._src.core import checks
from zerojax._src.core import precision as precision_lib
from zerojax._src.core import settings as settings_lib
from zerojax._src.core.optimizer import ShardedOptimizer
from zerojax._src.core.plans import Plans
from zerojax._src.core.state import ZeroState, fresh_loss_scale_and_counters
from zerojax._src.sharding import layout as layout_lib
from zerojax._src.sharding import mesh as mesh_lib
from zerojax._src.sharding import stored as stored_lib


class ZeroTransformation(optax.GradientTransformationExtraArgs):
  """An Optax transformation whose state (and gradients, and parameters) are sharded.

  Build one with ``zerojax.zero1``, ``zero2`` or ``zero3``. It is an
  ``optax.GradientTransformationExtraArgs``: ``init``, ``update`` and
  ``optax.apply_updates`` work as usual, inside or outside ``jax.jit``, and
  like any optax transformation it survives ``copy.copy``, ``copy.deepcopy``,
  ``jax.tree.map`` and ``_replace``. The extra methods place arrays as the
  stage stores them.

  ``update`` accepts gradients either in the stage's layout (as
  ``zerojax.value_and_grad`` returns them) or as plain full arrays (as
  ``jax.grad`` returns them in a drop-in step), and returns updates in the
  parameters' layout (in stage 3 as ``zerojax.Stored`` s, with ``params`` or
  without), which ``optax.apply_updates`` adds to them.

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
    quantized_weights: the ``zerojax.Quantization`` (bits, block size) of
      stage 3's weight all-gathers, or ``None``.
    quantized_gradients: that of the gradient reductions, or ``None``.
    offload: ``None``, ``"optimizer"`` or ``"optimizer+master"``: what lives in
      host memory between steps (see the factories' ``offload``).
    secondary_axis: stage 3's hpZ axis (or axes), as given, or ``None``.

  Example:
    >>> import copy, jax, jax.numpy as jnp, optax, zerojax
    >>> tx = zerojax.zero3(optax.adam(1e-3), mesh=jax.make_mesh((jax.device_count(),), ("data",)))
    >>> params = tx.shard({"w": jnp.ones((4, 1024))})
    >>> tx.stage, params["w"].sharding.shard_shape((4, 1024)), tx.gather(params)["w"].shape
    (3, (4, 128), (4, 1024))
    >>> copy.deepcopy(tx).stage, jax.tree.map(lambda f: f, tx).stage
    (3, 3)
  """

  __slots__ = ()

  def __setattr__(self, name: str, value: Any) -> None:
    raise AttributeError(
      f"a ZeroTransformation is immutable (setting {name!r}): build another with "
      "zerojax.zero1/2/3(...), or replace init/update with tx._replace(...)."
    )

  @property
  def _optimizer(self) -> ShardedOptimizer:
    return unwrap(self)

  @property
  def stage(self) -> int:
    return self._optimizer.settings.stage.number

  @property
  def mesh(self) -> Mesh:
    return self._optimizer.settings.mesh

  @property
  def axis_name(self) -> str | tuple[str, ...]:
    return self._optimizer.settings.axis_name

  @property
  def data_axes(self) -> tuple[str, ...]:
    return self._optimizer.settings.data_axes

  @property
  def replica_axes(self) -> tuple[str, ...]:
    return self._optimizer.settings.replica_axes

  @property
  def inner(self) -> optax.GradientTransformationExtraArgs:
    return self._optimizer.settings.inner

  @property
  def precision(self) -> precision_lib.Precision:
    return self._optimizer.settings.precision

  @property
  def quantized_weights(self) -> quantize.Quantization | None:
    return self._optimizer.settings.quantized_weights

  @property
  def quantized_gradients(self) -> quantize.Quantization | None:
    return self._optimizer.settings.quantized_gradients

  @property
  def offload(self) -> str | None:
    return self._optimizer.settings.offload.mode

  @property
  def secondary_axis(self) -> str | tuple[str, ...] | None:
    return self._optimizer.settings.secondary_axis

  @property
  def num_shards(self) -> int:
    """How many shards the data axes split everything into (the product of their sizes)."""
    return self._optimizer.settings.num_shards

  @property
  def batch_axes(self) -> tuple[str, ...]:
    """The axes a batch is split over (the replica axes first, then the data axes).

    Place a batch with ``NamedSharding(mesh, P(tx.batch_axes))``.
    """
    return self._optimizer.settings.batch_axes

  @property
  def num_replicas(self) -> int:
    """How many copies the replica axes hold (1 without ``replica_axis``)."""
    return self._optimizer.settings.num_replicas

  def shard(self, params: optax.Params) -> optax.Params:
    """Places full parameters as this stage stores them.

    Stages 1 and 2 replicate them over the data axis; stage 3 keeps 1/N of
    each (zero-padding leaves whose sharded dimension does not divide by N).
    Floating-point leaves are cast to the stored dtype: the precision policy's
    master dtype in stage 3; in stages 1 and 2, and in stage 3 with
    ``offload="optimizer+master"``, its compute dtype (so call ``init`` on the
    full-precision parameters first). Inside ``jax.jit`` this is a sharding
    constraint.

    Stage 3 returns each leaf as a ``zerojax.Stored``, which carries its
    layout: every zerojax API reads from it what the leaf is, and a model that
    uses it as a whole array gets an error saying what to call instead
    (``zerojax.gather`` in ``zerojax.value_and_grad``, ``tx.unpad`` in a
    drop-in step, ``tx.gather`` to evaluate).
    """
    plans = self._optimizer.plans(params)
    params = plans.arrays(params, self.mesh)
    store = lambda tree: plans.as_stored(plans.params.map(_cast, tree))
    if mesh_lib.is_traced(params):
      placed = mesh_lib.global_view(self.mesh, store, plans.params.specs())(params)
    else:
      checks.same_model_on_every_process(params)
      place = lambda leaf, x: jax.device_put(x, NamedSharding(self.mesh, leaf.partition_spec))
      placed = plans.params.map(place, store(params))
    return self._as_stored(plans, placed)

  def sharded_init(self, init_fn: Callable[..., Any]) -> Any:
    """A jitted function that initialises the parameters and the optimizer state into shards.

    ``init = tx.sharded_init(init_fn)`` and then ``params, opt_state =
    init(*args)`` give what ``params = init_fn(*args)``, ``opt_state =
    tx.init(params)`` and ``params = tx.shard(params)`` give, without ever
    making the whole model: ``init_fn`` runs in one program whose outputs are
    placed as the stage stores them, so the compiler partitions every
    initialiser (JAX's random numbers are the same however they are split)
    and each device computes its own shards, on a mesh of explicit axes too
    (where a value traced without a sharding would be whole on every device).
    ``init.lower(*args).compile().memory_analysis()`` says what it holds.

    Args:
      init_fn: makes the full-precision parameters, e.g.
        ``lambda key: model.init(key, x)["params"]``; its arguments are
        ``init``'s (a PRNG key, example inputs).

    Returns:
      The jitted ``init(*args, **kwargs) -> (params, opt_state)``, run and
      lowered under ``tx.mesh`` (``jax.set_mesh``).

    Raises:
      TypeError: if ``init_fn`` is not callable (built parameters: ``tx.shard`` places them).

    Example:
      >>> import jax, jax.numpy as jnp, optax, zerojax
      >>> tx = zerojax.zero3(optax.adam(1e-3), mesh=jax.make_mesh((jax.device_count(),), ("data",)))
      >>> init_fn = lambda key: {"w": jax.random.normal(key, (512, 1001))}
      >>> params, opt_state = tx.sharded_init(init_fn)(jax.random.key(0))
      >>> params["w"].value.addressable_shards[0].data.shape, params["w"].layout.shape
      ((512, 126), (512, 1001))
      >>> bool(jnp.all(tx.gather(params)["w"] == init_fn(jax.random.key(0))["w"]))
      True
    """
    if not callable(init_fn):
      raise TypeError(
        "tx.sharded_init takes the function that makes the parameters, not the parameters "
        f"(got {type(init_fn).__name__}): tx.sharded_init(lambda key: model.init(key, x))(key), "
        "or tx.sharded_init(init_fn)(*args) for an init_fn of arguments. For parameters "
        "already built, use tx.shard(params) (and tx.init for the optimizer state)."
      )
    optimizer = self._optimizer
    settings = optimizer.settings

    def arrays(*args: Any, **kwargs: Any) -> Any:
      # Tracing makes a Python float an array; tx.shard would refuse it, and so does this.
      params = init_fn(*args, **kwargs)
      layout_lib.check_arrays(params)
      return params

    def init(*args: Any, **kwargs: Any) -> tuple[Any, ZeroState]:
      plans = optimizer.plans(jax.eval_shape(arrays, *args, **kwargs))

      def fresh(*args: Any, **kwargs: Any) -> tuple[Any, ZeroState]:
        full = init_fn(*args, **kwargs)
        stored = plans.as_stored(plans.params.map(_cast, full))
        return stored, optimizer.fresh_state(full, plans)

      specs = (plans.params.specs(), plans.state_specs())
      params, state = mesh_lib.global_view(self.mesh, fresh, specs)(*args, **kwargs)
      return self._as_stored(plans, params), settings.offload.store(state)

    return _UnderMesh(jax.jit(init), self.mesh)

  def _as_stored(self, plans: Plans, tree: Any) -> Any:
    """A plain tree in the stored parameters' layout, as ``shard`` returns it."""
    if self._optimizer.settings.stage.splits_params:
      return stored_lib.wrap(plans.params, tree)
    return tree

  def gather(self, params: optax.Params) -> optax.Params:
    """Full, unpadded parameters, replicated over the data axis (for evaluation and export).

    Pass ``tx.master_params(params, state)`` instead of ``params`` for the
    full-precision copy.

    Raises:
      TypeError: given ``zerojax.Shard`` s, inside the loss of ``zerojax.value_and_grad``,
        where ``zerojax.gather`` opens them.
    """
    if any(isinstance(x, shards_lib.Shard) for x in jax.tree.leaves(params, is_leaf=_is_shard)):
      raise TypeError(
        "tx.gather was given zerojax.Shards, as the loss of zerojax.value_and_grad sees the "
        "parameters: there, open them with zerojax.gather(params) (or layer by layer in "
        "zerojax.scan). tx.gather is for the stored parameters outside the step (evaluation, "
        "export)."
      )
    return self._optimizer.gather(params)

  def master_params(self, params: optax.Params, state: ZeroState) -> optax.Params:
    """The master (full-precision) parameters, as stored: sharded in every stage.

    They are ``params`` themselves unless the transformation keeps a separate
    master copy in ``state``: stages 1 and 2 under a precision policy with a
    lower compute dtype, and stage 3 too with ``offload="optimizer+master"``
    (the copy then lives in host memory; ``tx.gather`` brings it back).
    """
    return params if state.master is None else state.master

  def unpad(self, params: optax.Params) -> optax.Params:
    """Stored parameters as plain arrays with their padding sliced off, still sharded.

    A drop-in stage-3 step (inside ``jax.jit``) calls the model on
    ``tx.unpad(params)``: stage 3's stored leaves are ``zerojax.Stored``, not
    arrays. It is the identity for stages 1 and 2. On a mesh with explicit axes,
    whose types cannot express an uneven split, padded leaves come out whole
    over the data axes (other axes kept); on ``Auto`` axes the compiler keeps
    them split.
    """
    plans = self._optimizer.plans(params)
    params = plans.arrays(params, self.mesh)
    if not (mesh_lib.is_explicit(self.mesh) and mesh_lib.is_traced(params)):
      return plans.to_logical(params)
    specs = plans.params.map(
      lambda leaf: leaf.full_spec(self.data_axes) if leaf.padding else leaf.partition_spec
    )
    return mesh_lib.global_view(self.mesh, plans.to_logical, specs)(params)

  def param_shardings(self, params: optax.Params) -> Any:
    """The ``NamedSharding`` of every stored parameter (for ``jax.jit`` and checkpoint restore),
    in the structure ``shard`` returns (each in a ``zerojax.Stored`` in stage 3).

    Args:
      params: the parameters, full or stored, as arrays or ``jax.ShapeDtypeStruct``.
    """
    plans = self._optimizer.plans(params)
    return self._as_stored(plans, plans.params.shardings(self.mesh))

  def state_shardings(self, params: optax.Params) -> ZeroState:
    """The ``NamedSharding`` of every optimizer-state leaf that ``init(params)`` returns.

    With ``offload``, those of the offloaded leaves name the ``pinned_host``
    memory kind, so that a checkpoint restores them into host memory.
    """
    specs = self._optimizer.plans(params).state_specs()
    return self._optimizer.settings.offload.shardings(self.mesh, specs)

  def logical_shapes(self, params: optax.Params) -> tuple[Any, ZeroState]:
    """``jax.ShapeDtypeStruct`` s of the stored parameters and state, without the padding.

    What the training state is whatever the device count: checkpoints record
    it, and restore across device counts and stages where it agrees.
    """
    plans = self._optimizer.plans(params)
    logical = lambda layout: layout.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
    state = ZeroState(
      inner_state=logical(plans.state),
      master=None if plans.master is None else logical(plans.master),
      **jax.eval_shape(lambda: fresh_loss_scale_and_counters(self.precision)),
    )
    return logical(plans.params), state

  def num_params(self, params: optax.Params) -> int:
    """How many parameters the model has: the elements of its leaves in their logical shapes.

    Stage 3 stores a leaf padded where its split dimension does not divide by
    the device count, so the sizes of the stored arrays,
    ``sum(x.size for x in jax.tree.leaves(params))``, count the padding too;
    this counts the model's own, the same in every stage and on any device
    count.

    Args:
      params: the parameters, full or stored, as arrays or ``jax.ShapeDtypeStruct`` s.

    Example:
      >>> import jax, jax.numpy as jnp, optax, zerojax
      >>> tx = zerojax.zero3(optax.sgd(0.1), mesh=jax.make_mesh((jax.device_count(),), ("data",)))
      >>> params = tx.shard({"w": jnp.ones((4, 1001))})
      >>> sum(x.size for x in jax.tree.leaves(params)), tx.num_params(params)
      (4032, 4004)
    """
    return sum(math.prod(leaf.shape) for leaf in self._optimizer.plans(params).sharded.leaves)

  def layout(self, params: optax.Params) -> layout_lib.Layout:
    """The plan: how each leaf of ``params`` is split (see ``zerojax.Layout``)."""
    return self._optimizer.plans(params).sharded


def _is_shard(x: Any) -> bool:
  return isinstance(x, shards_lib.Shard)


class _UnderMesh:
  """A jitted function that is called and lowered under its mesh (explicit axes need it)."""

  def __init__(self, jitted: Any, mesh: Mesh):
    self._jitted, self._mesh = jitted, mesh

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    with mesh_lib.set_mesh_unless_traced(self._mesh, args, kwargs):
      return self._jitted(*args, **kwargs)

  def lower(self, *args: Any, **kwargs: Any) -> Any:
    with mesh_lib.set_mesh_unless_traced(self._mesh, args, kwargs):
      return self._jitted.lower(*args, **kwargs)


def unwrap(tx: Any) -> ShardedOptimizer:
  """The ``ShardedOptimizer`` behind a zerojax transformation.

  Raises:
    ValueError: if ``tx`` is not one (another optax transformation, a chain
      holding one, or one whose ``init`` was replaced).
  """
  optimizer = getattr(getattr(tx, "init", None), "__self__", None)
  if isinstance(optimizer, ShardedOptimizer):
    return optimizer
  if isinstance(tx, ZeroTransformation):
    raise ValueError(
      "this ZeroTransformation's init is not zerojax's any more (replaced with "
      "_replace or jax.tree.map), so its settings are lost: keep init as "
      "zerojax.zero1/2/3 made it."
    )
  raise ValueError(
    f"expected the transformation zerojax.zero1/zero2/zero3(...) returned, got "
    f"{type(tx).__name__}: pass that transformation itself (not an optax.chain "
    "or other wrapper around it)."
  )


def _cast(leaf: layout_lib.LeafLayout, x: Any) -> Any:
  """A leaf cast to its stored dtype (host arrays stay on the host)."""
  return x if np.dtype(x.dtype) == leaf.dtype else x.astype(leaf.dtype)


def zero1(
  inner: optax.GradientTransformation,
  *,
  mesh: Mesh | None = None,
  axis_name: str | tuple[str, ...] = "data",
  replica_axis: str | tuple[str, ...] | None = None,
  layout: Any = None,
  min_shard_size: int = layout_lib.DEFAULT_MIN_SHARD_SIZE,
  precision: precision_lib.Precision | str | None = None,
  quantized_gradients: str | None = None,
  quantization_block_size: int = quantize.DEFAULT_BLOCK_SIZE,
  offload: str | None = None,
) -> ZeroTransformation:
  """ZeRO stage 1: shards the optimizer state over the data axis.

  Parameters stay replicated. With ``zerojax.value_and_grad`` each device keeps
  its full local gradient and reduce-scatters it once, at the end of the
  backward pass; the optimizer updates each device's 1/N and the updated
  parameters are all-gathered. Per device: Ψ params + Ψ grads + KΨ/N state.

  Args:
    inner: any ``optax.GradientTransformation`` (see ``zero3``).
    mesh: as in ``zero3``.
    axis_name: as in ``zero3``.
    replica_axis: as in ``zero3``.
    layout: as in ``zero3``; it splits the optimizer state (and the gradient
      shards), the parameters staying whole.
    min_shard_size: as in ``zero3``.
    precision: as in ``zero3``; a lower compute dtype keeps a sharded master
      copy in the state, so ``init`` wants the full-precision parameters.
    quantized_gradients: as in ``zero3``.
    quantization_block_size: as in ``zero3``.
    offload: as in ``zero3``.

  Returns:
    A ``ZeroTransformation``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, zerojax
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = zerojax.zero1(optax.adam(1e-3), mesh=mesh)
    >>> params = tx.shard({"w": jnp.ones((64, 64))})
    >>> state = tx.init(params)
    >>> state.inner_state[0].mu["w"].sharding.spec
    P(None, 'data')
  """
  return _transformation(1, **locals())


def zero2(
  inner: optax.GradientTransformation,
  *,
  mesh: Mesh | None = None,
  axis_name: str | tuple[str, ...] = "data",
  replica_axis: str | tuple[str, ...] | None = None,
  layout: Any = None,
  min_shard_size: int = layout_lib.DEFAULT_MIN_SHARD_SIZE,
  precision: precision_lib.Precision | str | None = None,
  quantized_gradients: str | None = None,
  quantization_block_size: int = quantize.DEFAULT_BLOCK_SIZE,
  offload: str | None = None,
) -> ZeroTransformation:
  """ZeRO stage 2: shards the optimizer state and the gradients.

  Parameters stay replicated. With ``zerojax.value_and_grad`` each layer's
  gradient is reduce-scattered as soon as the backward pass produces it, so no
  full-size gradient ever exists. Per device: Ψ params + Ψ/N grads + KΨ/N state.

  Args:
    inner: any ``optax.GradientTransformation`` (see ``zero3``).
    mesh: as in ``zero3``.
    axis_name: as in ``zero3``.
    replica_axis: as in ``zero3``.
    layout: as in ``zero3``; it splits the optimizer state and the
      gradients, the parameters staying whole.
    min_shard_size: as in ``zero3``.
    precision: as in ``zero3``; a lower compute dtype keeps a sharded master
      copy in the state, so ``init`` wants the full-precision parameters.
    quantized_gradients: as in ``zero3``.
    quantization_block_size: as in ``zero3``.
    offload: as in ``zero3``.

  Returns:
    A ``ZeroTransformation``.

  Example:
    The parameters stay whole; the gradients come back split:

    >>> import jax, jax.numpy as jnp, optax, zerojax
    >>> tx = zerojax.zero2(optax.adam(1e-3), mesh=jax.make_mesh((jax.device_count(),), ("data",)))
    >>> params = tx.shard({"w": jnp.ones((64, 64))})
    >>> loss_fn = lambda params, x: jnp.mean(x @ zerojax.gather(params)["w"])
    >>> _, grads = zerojax.value_and_grad(loss_fn, tx)(params, jnp.ones((8, 64)))
    >>> params["w"].sharding.spec, grads["w"].sharding.spec
    (P(), P(None, 'data'))

  With the optimizer state in host memory between steps:

    >>> offloaded = zerojax.zero2(optax.adam(1e-3), mesh=tx.mesh, offload="optimizer")
    >>> offloaded.init(params).inner_state[0].mu["w"].sharding.memory_kind
    'pinned_host'
  """
  return _transformation(2, **locals())


def zero3(
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
  offload: str | None = None,
  secondary_axis: str | tuple[str, ...] | None = None,
  packed_gathers: bool | None = None,
) -> ZeroTransformation:
  """ZeRO stage 3: shards the optimizer state, the gradients and the parameters.

  Each device stores 1/N of every parameter; ``zerojax.gather`` assembles a
  layer's weights right before use (all-gather), and the backward pass
  reduce-scatters their gradients. Per device: (2 + K)Ψ/N plus one gathered
  layer at a time.

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
    quantized_weights: ``"int8"`` (or ``"int4"``) sends each weight
      all-gather of ``zerojax.value_and_grad`` as block-quantized integers
      plus one float32 scale per block (ZeRO++'s qwZ), dequantized to the
      compute dtype on arrival. Only the moved copy is quantized: stored
      parameters and optimizer state never are. ``None`` by default.
    quantized_gradients: ``"int8"`` (or ``"int4"``) turns each gradient
      reduce-scatter of ``zerojax.value_and_grad`` into an all-to-all of
      block-quantized chunks that each device sums in float32 (ZeRO++'s
      qgZ); with ``replica_axis``, the shard's sum across replicas becomes a
      quantized all-to-all and all-gather too. Over several data axes
      (``axis_name=("node", "data")``) the reduction is ZeRO++'s hierarchical
      one: an all-to-all inside each node first, over ``secondary_axis`` or
      else the last axis of ``axis_name`` (list the axes across nodes first),
      whose sums are quantized again and sent across nodes, so that a node
      sends its share of the gradient across, not each device's whole one.
      Replicated small leaves stay unquantized. ``None`` by default.
    quantization_block_size: elements per scale (even; 256 by default).
    offload: ``"optimizer"`` keeps the optimizer state in host memory
      (``memory_kind="pinned_host"``, split as it would be on the devices)
      between steps: ``init`` puts it there, and ``update`` copies it to
      device memory, updates it there and writes it back, inside the jitted
      step. ``"optimizer+master"`` moves the master copy of the parameters
      too, under a precision policy with a lower compute dtype: stages 1 and
      2 keep it apart from their compute-dtype parameters already; stage 3
      then keeps it apart as well, and stores its shards in the compute
      dtype. Numbers do not change beyond rounding (another program, which
      XLA may fuse otherwise; docs/offload.md). Raises on a platform without
      ``pinned_host`` memory. ``None`` by default; see docs/offload.md.
    secondary_axis: ZeRO++'s hierarchical partitioning (hpZ): the data axis
      (or tuple of adjacent axes) of ``axis_name`` whose devices share a
      node, e.g. ``axis_name=("node", "data"), secondary_axis="data"``.
      Parameters are stored as without it, split over all of ``axis_name``;
      each weight all-gather of ``zerojax.value_and_grad`` becomes one over
      the other data axes (across nodes), which leaves each device its
      secondary partition (1/(devices per node) of the layer), then one over
      ``secondary_axis`` (inside the node). The forward pass keeps the
      secondary partitions, and the backward pass gathers from them, inside
      the node. Numbers do not change: the gradients' reduce-scatter still
      spans all the data axes. ``None`` by default; see docs/compression.md.
    packed_gathers: whether the shards that ``zerojax.gather`` (or
      ``zerojax.scan``) opens together, a layer's, move in one all-gather per
      dtype, packed into one buffer, rather than one all-gather each. The
      same bytes move, but a collective's fixed costs are paid once a layer:
      across nodes XLA:GPU prices every collective at a round trip per node
      plus its launch, and combines the gathers of large weights only up to
      its threshold. Cutting the weights out of the gathered buffer copies
      each once on the device, and the buffer adds up to a layer of
      temporaries at the gather. ``None`` (the default): packed on GPUs where
      ``axis_name`` spans several axes of more than one device each (across
      nodes), and never on other platforms (XLA:TPU gives no estimate of what
      it buys, and it held up to a layer more on a v5e-256 pod); ``True`` or
      ``False``: always or never. Quantized
      (``quantized_weights``), a layer's codes and scales move as the bytes of
      one buffer (on TPUs, two collectives a weight either way); hpZ's
      gathers move one a weight either way. Numbers do not change; see
      docs/scaling.md.

  Returns:
    A ``ZeroTransformation``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, zerojax
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = zerojax.zero3(optax.adam(1e-3), mesh=mesh)
    >>> params = tx.shard({"w": jnp.ones((64, 64))})
    >>> params["w"].sharding.spec
    P(None, 'data')
  """
  return _transformation(3, **locals())


def _transformation(
  stage: int, inner: optax.GradientTransformation, **options: Any
) -> ZeroTransformation:
  """The transformation of ``zero{stage}``: its options (the factory's keywords, each declared
  once, in its signature) checked and resolved once."""
  if isinstance(inner, ZeroTransformation):
    raise ValueError(
      f"zero{stage} was given a zerojax transformation (zero{inner.stage}) to wrap: wrap "
      f"the optax optimizer once, e.g. zerojax.zero{stage}(optax.adamw(1e-3), mesh=mesh)."
    )
  optimizer = ShardedOptimizer(settings_lib.resolve(stage, inner, **options))
  return ZeroTransformation(optimizer.init, optimizer.update)  # pyright: ignore[reportArgumentType]
