"""``value_and_grad``: the loss runs once per device, on that device's slice of the batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._src import collectives, ordering
from zerojax._src import layout as layout_lib
from zerojax._src import mesh as mesh_lib
from zerojax._src.zero import ZeroTransformation, check_policy


def value_and_grad(
  loss_fn: Callable[..., Any],
  tx: ZeroTransformation,
  *,
  has_aux: bool = False,
  microbatches: int = 1,
) -> Callable[..., Any]:
  """Like ``jax.value_and_grad``, with the loss computed data-parallel under ``jax.shard_map``.

  The returned ``f(params, *batch, opt_state=None)`` splits every leaf of
  every ``batch`` argument along its leading dimension over ``tx.axis_name``
  and calls ``loss_fn(params, *batch)`` once per device, on that device's
  slice (``microbatches`` times per device, on successive slices of it, when
  accumulating). Inside,
  parameters that the layout shards arrive as ``zerojax.Shard`` s: open them
  with ``zerojax.gather``, one layer at a time in a scan. The gradients come
  back in the stage's layout:

  * stage 1: each device's full local gradient is reduce-scattered once, at the
    end of the backward pass;
  * stage 2: each parameter's gradient is reduce-scattered as the backward pass
    reaches the ``gather`` that read it (per layer, inside a scan);
  * stage 3: ``gather``'s all-gather transposes into a reduce-scatter.

  Gradients are never all-reduced to full size, except those of the tiny leaves
  the layout replicates. Parameters must be placed with ``tx.shard``.

  With ``microbatches=k`` the gradients are summed over k micro-batches inside
  the step, with ZeRO's semantics: stage 1 sums full local gradients and
  reduce-scatters once at the end; stages 2 and 3 reduce-scatter every
  micro-batch into a shard-sized accumulator, so accumulating costs Ψ/N, not
  Ψ. The result equals one step on the whole batch.

  Under ``tx.precision``, ``loss_fn`` sees parameters in the compute dtype,
  gradients are reduce-scattered in the reduce dtype and returned in the
  master dtype; with a loss scale, the loss is multiplied by the scale in
  ``opt_state`` before differentiating and the gradients divided by it (so
  what comes back is the true gradient, or non-finite on overflow, which
  ``tx.update`` then skips).

  Args:
    loss_fn: ``loss_fn(params, *batch)`` returning a scalar loss (the mean over
      its batch slice), or ``(loss, aux)`` with ``has_aux=True``.
    tx: the ``ZeroTransformation`` that will apply the gradients.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    microbatches: how many micro-batches each device's slice of the batch is
      split into (gradient accumulation within the step).

  Returns:
    ``f(params, *batch, opt_state=None)`` returning ``(loss, grads)``, or
    ``((loss, aux), grads)``. ``opt_state`` (the ``ZeroState``) is needed only
    when the precision policy scales the loss. ``loss`` is the mean over
    devices and micro-batches, which equals the loss on the whole batch.
    ``aux`` holds the ``aux`` of every call of ``loss_fn``, stacked along a new
    leading axis of size ``tx.num_shards * microbatches``, in batch order
    (reduce it as your metric needs, e.g. ``jax.tree.map(jnp.mean, aux)``).

  Example:
    >>> import jax, jax.numpy as jnp, optax, zerojax
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = zerojax.zero3(optax.sgd(0.1), mesh=mesh)
    >>> params = tx.shard({"w": jnp.zeros((16, 64))})
    >>> def loss_fn(params, x, y):
    ...   w = zerojax.gather(params)["w"]
    ...   return jnp.mean((x @ w - y) ** 2)
    >>> x, y = jnp.ones((8, 16)), jnp.ones((8, 64))
    >>> loss, grads = zerojax.value_and_grad(loss_fn, tx)(params, x, y)
    >>> float(loss), grads["w"].sharding.spec
    (1.0, P(None, 'data'))
  """
  if not isinstance(tx, ZeroTransformation):
    raise ValueError(
      f"value_and_grad needs the zerojax transformation, got {type(tx).__name__}: "
      "pass tx = zerojax.zero1/zero2/zero3(...)."
    )
  if not isinstance(microbatches, int) or microbatches < 1:
    raise ValueError(f"microbatches must be a positive int, got {microbatches!r}.")
  data = layout_lib.entry(tx.data_axes)
  # The axes the batch is split over, which shard_map manages; the others
  # (tensor parallelism) stay the compiler's.
  manual = tx.batch_axes
  # XLA:CPU can start a collective while a loop's collectives are still under
  # way, and devices then meet in the wrong one; see zerojax/_src/ordering.py.
  linked = ordering.links_needed(tx.mesh)

  def value_and_grad_fn(params, *batch, opt_state=None):
    plans = tx._planner.plans(params)
    _check_params(params, plans.params, tx)
    _check_batch(batch, tx, microbatches)
    scale = _loss_scale(tx, opt_state)
    sharded = plans.sharded
    param_specs = plans.params.map(lambda leaf: _data_only(leaf, data))
    grad_specs = sharded.map(lambda leaf: _data_only(leaf, data))

    def per_device(params, scale, *batch):
      differentiable = sharded.map(lambda leaf, x: _differentiable(leaf, x, tx), params)

      def local_loss(differentiable, *chunk):
        tree = sharded.map(lambda leaf, p, d: _for_loss(leaf, p, d, tx), params, differentiable)
        loss, aux = loss_fn(tree, *chunk) if has_aux else (loss_fn(tree, *chunk), None)
        scaled = loss if scale is None else loss.astype(jnp.float32) * scale
        return scaled, (loss, aux)

      def micro_step(chunk):
        grads, (loss, aux) = jax.grad(local_loss, has_aux=True)(differentiable, *chunk)
        return loss, aux, sharded.map(lambda leaf, g: _accumulable(leaf, g, tx), grads)

      if linked and microbatches > 1:
        micro_step = ordering.link_loops(micro_step)
      loss, aux, grads = _accumulate(micro_step, batch, microbatches, manual)
      divisor = tx.num_shards * tx.num_replicas * microbatches
      grads = sharded.map(lambda leaf, g: _reduce(leaf, g, tx, divisor, scale), grads)
      return jax.lax.pmean(loss, manual), aux, grads

    if linked:
      per_device = ordering.link_loops(per_device)
    batch_specs = tuple(jax.tree.map(lambda _: P(manual), b) for b in batch)
    if mesh_lib.is_explicit(tx.mesh):
      # Explicit axes: shard_map takes inputs only as they are typed, so place them.
      params = _reshard(params, plans.params.specs(), tx.mesh)
      batch = _reshard(batch, batch_specs, tx.mesh)
    loss, aux, grads = jax.shard_map(
      per_device,
      mesh=tx.mesh,
      in_specs=(param_specs, P(), *batch_specs),
      out_specs=(P(), P(manual), grad_specs),
      axis_names=set(manual),
    )(params, scale, *batch)
    return ((loss, aux), grads) if has_aux else (loss, grads)

  return value_and_grad_fn


def _accumulate(micro_step, batch, microbatches, manual):
  """Runs ``micro_step`` on each of ``microbatches`` slices of ``batch``, summing gradients.

  Returns the mean loss, every slice's aux stacked in batch order, and the
  summed gradients, in the shapes ``micro_step`` gives them: so stages 2 and 3
  accumulate reduce-scattered shards, and stage 1 the full local gradient.
  """
  if microbatches == 1:
    loss, aux, grads = micro_step(batch)
    return loss, jax.tree.map(lambda a: jnp.asarray(a)[None], aux), grads
  chunks = jax.tree.map(lambda x: x.reshape(microbatches, -1, *x.shape[1:]), batch)
  first = jax.tree.map(lambda x: x[0], chunks)
  zeros = jax.tree.map(
    lambda s: jax.lax.pcast(jnp.zeros(s.shape, s.dtype), manual, to="varying"),
    jax.eval_shape(micro_step, first)[2],
  )

  def body(total, chunk):
    loss, aux, grads = micro_step(chunk)
    return jax.tree.map(jnp.add, total, grads), (loss, aux)

  grads, (losses, aux) = jax.lax.scan(body, zeros, chunks)
  return jnp.mean(losses), aux, grads


def _loss_scale(tx: ZeroTransformation, opt_state: Any) -> jax.Array | None:
  """The current loss scale, from the optimizer state, if the policy scales the loss."""
  if tx.precision.loss_scale is None:
    return None
  if opt_state is None:
    raise ValueError(
      "tx's precision policy scales the loss, and the scale lives in the optimizer "
      "state: call value_and_grad(loss_fn, tx)(params, *batch, opt_state=opt_state)."
    )
  check_policy(opt_state, loss_scaled=True)
  return opt_state.loss_scale.scale


def _reshard(tree, specs, mesh):
  return jax.tree.map(
    lambda x, spec: jax.sharding.reshard(x, NamedSharding(mesh, spec)),
    tree,
    specs,
    is_leaf=lambda x: isinstance(x, P),
  )


def _data_only(leaf: layout_lib.LeafLayout, data: Any) -> P:
  """The leaf's spec over the data axes alone (the other axes are not ``shard_map``'s)."""
  if leaf.dim is None:
    return P()
  spec = [None] * len(leaf.shape)
  spec[leaf.dim] = data
  return P(*spec)


def _per_device(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """``x`` typed as varying over ``axes``: a device's own, which JAX must not sum for us."""
  return jax.lax.pcast(x, axes, to="varying") if axes else x


def _differentiable(leaf, x, tx):
  """What the gradient is taken with respect to, per device."""
  if leaf.dim is None or tx.stage == 1:
    return _per_device(x, tx.batch_axes)
  if tx.stage == 2:
    shape = list(leaf.stored_shape)
    shape[leaf.dim] //= tx.num_shards
    return _per_device(np.zeros(shape, leaf.dtype), tx.batch_axes)
  # Stage 3: the shard already varies over the data axes; over replicas it is
  # made a device's own too, so its gradient is summed across them once, at
  # the end, rather than by JAX at every use.
  return _per_device(x, tx.replica_axes)


def _for_loss(leaf, param, differentiable, tx):
  """What ``loss_fn`` sees for one leaf: an array in the compute dtype, or a ``Shard``."""
  compute = tx.precision.compute_dtype(leaf.dtype)
  if leaf.dim is None or tx.stage == 1:
    return differentiable.astype(compute)
  reduce = tx.precision.reduce_dtype(leaf.dtype)
  value, sink = (param, differentiable) if tx.stage == 2 else (differentiable, None)
  return collectives.Shard(
    value,
    sink,
    leaf.dim,
    leaf.shape[leaf.dim],
    layout_lib.entry(tx.data_axes),
    compute,
    reduce,
    tx.replica_axes,
    tx.weight_quantization,
    tx.gradient_quantization,
  )


def _accumulable(leaf, grad, tx):
  """One micro-batch's gradient, in the dtype it is summed over micro-batches in.

  A gradient still to be reduced across devices (stage 1, replicated leaves)
  is local and full-size: it is summed in the reduce dtype. Stages 2 and 3
  gradients arrive reduce-scattered, in the master dtype.
  """
  if leaf.dim is None or tx.stage == 1:
    return grad.astype(tx.precision.reduce_dtype(leaf.dtype))
  return grad


def _reduce(leaf, grad, tx, divisor, scale):
  """Finishes one leaf's gradient: a sum over devices, then the mean, unscaled.

  Sharded gradients are reduce-scattered inside each data group, and only the
  shard-sized result is summed across replicas, in the reduce dtype like the
  reduce-scatter (both quantized with ``quantized_gradients``).
  """
  if leaf.dim is None:
    grad = jax.lax.psum(grad, tx.batch_axes)
  else:
    if tx.stage == 1:
      data = layout_lib.entry(tx.data_axes)
      grad = collectives.scatter(grad, leaf.dim, data, leaf.padded_size, tx.gradient_quantization)
    if tx.replica_axes:
      reduce = tx.precision.reduce_dtype(leaf.dtype)
      grad = collectives.all_reduce(grad.astype(reduce), tx.replica_axes, tx.gradient_quantization)
  grad = grad.astype(leaf.dtype) / divisor
  return grad if scale is None else grad / scale


def _check_batch(batch, tx, microbatches) -> None:
  n = tx.num_shards * tx.num_replicas
  for index, argument in enumerate(batch):
    for path, x in jax.tree_util.tree_flatten_with_path(argument)[0]:
      shape = np.shape(x)
      if not shape or shape[0] % (n * microbatches):
        axes = tx.batch_axes
        split = (
          f"{n} devices of mesh axes {axes}"
          if len(axes) > 1
          else f"{n} devices of mesh axis {axes[0]!r}"
        )
        if tx.replica_axes:
          split += f" ({tx.num_replicas} replicas x {tx.num_shards} shards)"
        if microbatches > 1:
          split += f" times {microbatches} micro-batches"
        raise ValueError(
          f"batch argument {index}{jax.tree_util.keystr(path)} has shape {shape}: "
          f"its leading dimension must divide by the {split}. Use a batch size that "
          f"is a multiple of {n * microbatches}; pass per-step constants by closing "
          "over them instead of as batch arguments."
        )


def _check_params(params, stored: layout_lib.Layout, tx) -> None:
  for (path, x), leaf in zip(
    jax.tree_util.tree_flatten_with_path(params)[0], stored.leaves, strict=True
  ):
    if tuple(np.shape(x)) != leaf.stored_shape:
      raise ValueError(
        f"params{jax.tree_util.keystr(path)} has shape {np.shape(x)} but stage "
        f"{tx.stage} stores it as {leaf.stored_shape}: place the params with "
        "tx.shard(params) first."
      )
    mesh = getattr(getattr(x, "sharding", None), "mesh", None)
    if mesh is not None and not isinstance(x, jax.core.Tracer) and mesh != tx.mesh:
      raise ValueError(
        f"params{jax.tree_util.keystr(path)} lives on {mesh}, not on this "
        f"transformation's mesh {tx.mesh}: place the params with tx.shard(params), "
        "or build the transformation with the params' mesh."
      )
