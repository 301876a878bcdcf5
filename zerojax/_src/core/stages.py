"""What each ZeRO stage splits, stores, and how a gradient leaves a device's loss.

A ``Stage`` is the one place that knows what a stage does:

* which model states it splits over the data axes (the estimator asks);
* how it stores the parameters, and whether it keeps a separate master copy
  (the planner asks);
* for each leaf, the ``Route`` its gradient takes out of the per-device loss
  of ``zerojax.value_and_grad``:

  ============================  ==================  ===========================
  route                         leaves              the sum over devices
  ============================  ==================  ===========================
  ``ALL_REDUCED``               replicated leaves   one all-reduce at the end
  ``SCATTERED_AT_END``          stage 1             one reduce-scatter at the end
  ``SCATTERED_IN_BACKWARD``     stage 2             a reduce-scatter per use, in
                                                    the backward pass
  ``SCATTERED_BY_GATHER``       stage 3             the transpose of the gather
  ============================  ==================  ===========================

Every route then sums the shard once across replicas (hybrid sharding).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from zerojax._src.comm import primitives as comm
from zerojax._src.comm import shards as shards_lib
from zerojax._src.sharding import layout as layout_lib

if TYPE_CHECKING:
  from zerojax._src.core.settings import Settings


class Route:
  """How one leaf's gradient leaves a device's loss (inside ``jax.shard_map``).

  The gradient path calls, in order: ``differentiable`` (what ``jax.grad``
  differentiates), ``for_loss`` (what the loss function sees), ``accumulable``
  (a micro-batch's gradient, as summed over micro-batches) and ``finish`` (the
  sum over every device of the batch axes, before the mean is taken). A
  forward pass (``zerojax.forward``) calls ``for_forward`` alone.
  """

  name = "route"

  def differentiable(self, leaf: layout_lib.LeafLayout, param: Any, settings: Settings) -> Any:
    raise NotImplementedError

  def for_loss(self, leaf, param, differentiable, settings: Settings) -> Any:
    raise NotImplementedError

  def for_forward(self, leaf: layout_lib.LeafLayout, param: Any, settings: Settings) -> Any:
    """What a forward pass sees, with no gradient to route: the parameter in the compute dtype."""
    return param.astype(settings.precision.compute_dtype(leaf.dtype))

  def accumulable(self, leaf, grad: jax.Array, settings: Settings) -> jax.Array:
    raise NotImplementedError

  def finish(self, leaf, grad: jax.Array, settings: Settings) -> jax.Array:
    raise NotImplementedError

  def __repr__(self) -> str:
    return self.name.upper()


class _LocalGradient(Route):
  """The loss reads the device's whole parameter and differentiates it locally.

  The full-size local gradient is summed over micro-batches in the reduce
  dtype, and over devices once, at the end.
  """

  def differentiable(self, leaf, param, settings):
    return _per_device(param, settings.batch_axes)

  def for_loss(self, leaf, param, differentiable, settings):
    return differentiable.astype(settings.precision.compute_dtype(leaf.dtype))

  def accumulable(self, leaf, grad, settings):
    return grad.astype(settings.precision.reduce_dtype(leaf.dtype))


class _AllReduced(_LocalGradient):
  name = "all_reduced"

  def finish(self, leaf, grad, settings):
    return jax.lax.psum(grad, settings.batch_axes)


class _ScatteredAtEnd(_LocalGradient):
  name = "scattered_at_end"

  def finish(self, leaf, grad, settings):
    data = layout_lib.entry(settings.data_axes)
    grad = comm.scatter(grad, leaf.dim, data, leaf.padded_size, settings.quantized_gradients)
    return _across_replicas(leaf, grad, settings)


class _ScatteredInLoss(Route):
  """The loss sees a ``zerojax.Shard``; ``gather``'s backward pass reduce-scatters.

  What comes back is already this device's shard of the sum over its data
  group, in the master dtype, so micro-batches sum shards.
  """

  def accumulable(self, leaf, grad, settings):
    return grad

  def finish(self, leaf, grad, settings):
    return _across_replicas(leaf, grad, settings)

  def _shard(self, leaf, value, sink, settings) -> shards_lib.Shard:
    return shards_lib.Shard(
      value=value,
      sink=sink,
      dim=leaf.dim,
      size=leaf.shape[leaf.dim],
      axis_name=layout_lib.entry(settings.data_axes),
      compute_dtype=settings.precision.compute_dtype(leaf.dtype),
      reduce_dtype=settings.precision.reduce_dtype(leaf.dtype),
      replica_axes=settings.replica_axes,
      quantized_weights=settings.quantized_weights,
      quantized_gradients=settings.quantized_gradients,
      secondary_axes=settings.secondary_axes,
      packed_gathers=settings.packed_gathers,
    )


class _ScatteredInBackward(_ScatteredInLoss):
  """Stage 2: the loss reads the replicated copy; its cotangent goes to a shard-sized sink."""

  name = "scattered_in_backward"

  def differentiable(self, leaf, param, settings):
    assert leaf.dim is not None  # route_of gives replicated leaves another route
    shape = list(leaf.stored_shape)
    shape[leaf.dim] //= settings.num_shards
    return _per_device(np.zeros(shape, leaf.dtype), settings.batch_axes)

  def for_loss(self, leaf, param, differentiable, settings):
    return self._shard(leaf, param, differentiable, settings)


class _ScatteredByGather(_ScatteredInLoss):
  """Stage 3: the loss gathers the shard; the gather's transpose reduce-scatters."""

  name = "scattered_by_gather"

  def differentiable(self, leaf, param, settings):
    # The shard already varies over the data axes; over replicas it is made a
    # device's own too, so that its gradient is summed across them once, at
    # the end, rather than by JAX at every use. It is differentiated in the
    # master dtype (``leaf``'s), so that the gradient comes back in it even
    # when the shard is stored in the compute dtype (the master copy apart).
    return _per_device(param.astype(leaf.dtype), settings.replica_axes)

  def for_loss(self, leaf, param, differentiable, settings):
    return self._shard(leaf, differentiable, None, settings)

  def for_forward(self, leaf, param, settings):
    return self._shard(leaf, param, None, settings)  # gathered where the model uses it


ALL_REDUCED = _AllReduced()
SCATTERED_AT_END = _ScatteredAtEnd()
SCATTERED_IN_BACKWARD = _ScatteredInBackward()
SCATTERED_BY_GATHER = _ScatteredByGather()


def _per_device(x: Any, axes: tuple[str, ...]) -> Any:
  """``x`` typed as varying over ``axes``: a device's own, which JAX must not sum for us."""
  return jax.lax.pcast(x, axes, to="varying") if axes else x


def _across_replicas(leaf, grad: jax.Array, settings: Settings) -> jax.Array:
  """The shard summed across replicas (hybrid sharding), in the reduce dtype."""
  if not settings.replica_axes:
    return grad
  reduce = settings.precision.reduce_dtype(leaf.dtype)
  return comm.all_reduce(grad.astype(reduce), settings.replica_axes, settings.quantized_gradients)


class Stage:
  """One ZeRO stage: what it splits, how it stores parameters, how gradients leave the loss.

  Attributes:
    number: 0 (plain data parallelism, for estimates), 1, 2 or 3.
    splits_state: whether the optimizer state is split over the data axes.
    splits_grads: whether gradients are (never whole on a device).
    splits_params: whether the parameters are.
    route: the ``Route`` of a sharded leaf's gradient.
  """

  def __init__(self, number: int, route: Route):
    self.number = number
    self.route = route
    self.splits_state = number >= 1
    self.splits_grads = number >= 2
    self.splits_params = number >= 3

  def route_of(self, leaf: layout_lib.LeafLayout) -> Route:
    """The route of ``leaf``'s gradient: replicated leaves are all-reduced at every stage."""
    return ALL_REDUCED if leaf.dim is None else self.route

  def stored(
    self,
    sharded: layout_lib.Layout,
    compute_dtype: Any,
    data_axes: tuple[str, ...],
    *,
    master_apart: bool = False,
  ) -> tuple[layout_lib.Layout, layout_lib.Layout | None]:
    """The stored parameters' layout, and that of a separate master copy (or ``None``).

    Stages 1 and 2 store a replicated copy in the compute dtype, and keep the
    master copy apart (sharded) when the dtypes differ. Stage 3 stores the
    master copy itself as the parameters, unless ``master_apart``: then, like
    stages 1 and 2, it stores its shards in the compute dtype and keeps the
    master copy apart (for ``offload="optimizer+master"``, which moves it to
    host memory).

    Args:
      sharded: the plan, in the master dtype: how gradients, master parameters
        and the optimizer state are split.
      compute_dtype: the precision policy's ``compute_dtype``.
      data_axes: the data axes.
      master_apart: stage 3: store the parameters in the compute dtype.
    """
    if self.splits_params and not master_apart:
      return sharded, None
    stored = sharded if self.splits_params else layout_lib.replicated(sharded, data_axes)
    stored = stored.with_dtypes(compute_dtype)
    return stored, (sharded if stored.key(False) != sharded.key(False) else None)

  def __repr__(self) -> str:
    return f"Stage({self.number})"


_STAGES = {
  0: Stage(0, ALL_REDUCED),
  1: Stage(1, SCATTERED_AT_END),
  2: Stage(2, SCATTERED_IN_BACKWARD),
  3: Stage(3, SCATTERED_BY_GATHER),
}

#: Every stage number, 0 (plain data parallelism) first.
NUMBERS = tuple(_STAGES)


def of(number: int) -> Stage:
  """The ``Stage`` numbered ``number``.

  Raises:
    ValueError: for a number that is not a stage.

  Example:
    >>> from zerojax._src.core import stages
    >>> stages.of(2).splits_grads, stages.of(2).splits_params
    (True, False)
  """
  if number not in _STAGES:
    raise ValueError(
      f"stage must be one of {NUMBERS} (0 is plain data parallelism), got {number!r}."
    )
  return _STAGES[number]
