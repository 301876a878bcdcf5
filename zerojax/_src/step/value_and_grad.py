"""``value_and_grad``: the loss runs once per device, on that device's slice of the batch."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._src.comm import ordering
from zerojax._src.core import checks
from zerojax._src.core import transformation as zero_lib
from zerojax._src.core.plans import Plans
from zerojax._src.core.state import check_policy
from zerojax._src.sharding import layout as layout_lib
from zerojax._src.sharding import mesh as mesh_lib
from zerojax._src.sharding import stored as stored_lib
from zerojax._src.step import batch_mean


def value_and_grad(
  loss_fn: Callable[..., Any],
  tx: zero_lib.ZeroTransformation,
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
      its batch slice), or ``(loss, aux)`` with ``has_aux=True``. A loss that
      sums over its slice instead gets a ``UserWarning``: the result would be
      1/N of ``jax.value_and_grad``'s on the whole batch.
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
  try:
    optimizer = zero_lib.unwrap(tx)
  except ValueError as error:
    raise ValueError(f"value_and_grad needs the zerojax transformation: {error}") from None
  if not isinstance(microbatches, int) or microbatches < 1:
    raise ValueError(f"microbatches must be a positive int, got {microbatches!r}.")
  return _ValueAndGrad(loss_fn, optimizer, has_aux, microbatches)


class _ValueAndGrad:
  """The function ``value_and_grad`` returns: one data-parallel gradient program.

  ``__call__`` checks the arguments and runs ``_per_device`` under
  ``jax.shard_map`` over the batch axes; each leaf's gradient leaves the loss
  by the route its stage gives it (``zerojax/_src/core/stages.py``).
  """

  def __init__(self, loss_fn, optimizer, has_aux: bool, microbatches: int):
    self.loss_fn = loss_fn
    self.optimizer = optimizer
    self.settings = optimizer.settings
    self.has_aux = has_aux
    self.microbatches = microbatches

  def __call__(self, params, *batch, opt_state=None, **keywords):
    if keywords:
      raise TypeError(
        f"the function value_and_grad returns takes the batch as positional arguments, "
        f"f(params, *batch), which it splits over the devices; got keyword argument(s) "
        f"{', '.join(map(repr, keywords))}: pass them in loss_fn's order, e.g. "
        "f(params, x, y) (opt_state= is its only keyword)."
      )
    settings = self.settings
    # Stage 3's Stored parameters give Stored gradients, as jax.grad of them would.
    wrapped = stored_lib.wraps(params)
    scale = self._loss_scale(opt_state)
    plans, params, batch, (param_specs, batch_specs) = placed(
      self.optimizer, params, batch, self.microbatches
    )
    grad_specs = plans.sharded.map(lambda leaf: _data_only(leaf, settings.data_axes))
    per_device = lambda params, scale, *batch: self._per_device(plans, params, scale, *batch)
    mapped = jax.shard_map(
      ordering.ordered(settings.mesh, per_device),
      mesh=settings.mesh,
      in_specs=(param_specs, P(), *batch_specs),
      out_specs=(P(), P(settings.batch_axes), grad_specs),
      axis_names=set(settings.batch_axes),
    )
    loss, aux, grads = mapped(params, scale, *batch)
    grads = stored_lib.wrap(plans.sharded, grads) if wrapped else grads
    return ((loss, aux), grads) if self.has_aux else (loss, grads)

  def _per_device(self, plans: Plans, params, scale, *batch):
    """One device's loss, its aux per micro-batch, and its finished gradient shards."""
    settings = self.settings
    routed = lambda method, *trees: per_leaf_route(plans.sharded, settings, method, *trees)
    differentiable = routed(lambda route, leaf, p: route.differentiable(leaf, p, settings), params)

    def for_loss(route, leaf, param, differentiable):
      return route.for_loss(leaf, param, differentiable, settings)

    def local_loss(differentiable, *chunk):
      loss, aux = self._call_loss(routed(for_loss, params, differentiable), *chunk)
      scaled = loss if scale is None else loss.astype(jnp.float32) * scale
      return scaled, (loss, aux)

    def accumulable(grads):
      return routed(lambda route, leaf, g: route.accumulable(leaf, g, settings), grads)

    # The loss is traced once, here, for both the gradient and the check for a summed loss.
    chunk = batch_mean.resized(batch, 1, self.microbatches)
    traced, out_shape = jax.make_jaxpr(local_loss, return_shape=True)(differentiable, *chunk)
    traced_loss = lambda *args: jax.tree.unflatten(
      jax.tree.structure(out_shape), core.jaxpr_as_fun(traced)(*jax.tree.leaves(args))
    )

    def micro_step(chunk):
      grads, (loss, aux) = jax.grad(traced_loss, has_aux=True)(differentiable, *chunk)
      return loss, aux, accumulable(grads)

    divisor = settings.num_shards * settings.num_replicas * self.microbatches
    self._warn_if_summed(local_loss, traced, (differentiable,), chunk, divisor)
    # A gradient has the shape and dtype of what it differentiates: so the sum over micro-batches
    # starts from zeros of these, found without tracing the loss once more.
    summed = jax.eval_shape(accumulable, differentiable)
    loss, aux, grads = _accumulate(
      micro_step, batch, self.microbatches, summed, settings.batch_axes
    )

    def mean(leaf, grad):
      grad = grad.astype(leaf.dtype) / divisor
      return grad if scale is None else grad / scale

    finished = routed(lambda route, leaf, g: route.finish(leaf, g, settings), grads)
    grads = plans.sharded.map(mean, finished)
    return jax.lax.pmean(loss, settings.batch_axes), aux, grads

  def _warn_if_summed(self, loss, traced, params, chunk, divisor: int) -> None:
    """Warns if ``loss`` (``traced`` on ``params`` and ``chunk``) sums over its micro-batch,
    which the mean over ``divisor`` of them would shrink by ``divisor``
    (``batch_mean.looks_summed``)."""
    if divisor == 1 or not jax.tree.leaves(chunk):
      return
    if not batch_mean.looks_summed(loss, chunk, params=params, traced=traced):
      return
    warnings.warn(
      f"zerojax.value_and_grad: loss_fn's loss looks like a sum over its batch, not a mean "
      "(no constant in it changes with the batch size, as jnp.mean's divisor does, and it "
      "divides by nothing computed from the batch). value_and_grad returns the mean of the "
      f"losses of the {divisor} devices and micro-batches, each on its slice, so a sum comes "
      f"out 1/{divisor} of jax.value_and_grad's on the whole batch, and so do the gradients. "
      "Average over the batch (jnp.mean), or multiply a sum you mean by the number of "
      "devices x micro-batches.",
      stacklevel=5,
    )

  def _call_loss(self, params, *chunk):
    """``(loss, aux)`` from ``loss_fn``, with a clear error for a result of the wrong shape."""
    result = self.loss_fn(params, *chunk)
    if self.has_aux and not (isinstance(result, tuple | list) and len(result) == 2):
      raise ValueError(
        f"value_and_grad(..., has_aux=True) expects loss_fn to return (loss, aux), but it "
        f"returned {_describe(result)}: return a pair, or drop has_aux=True."
      )
    loss, aux = result if self.has_aux else (result, None)
    loss = jnp.asarray(loss)
    if jnp.shape(loss) != ():
      rows = jax.tree.leaves(chunk)[0].shape[0] if jax.tree.leaves(chunk) else 0
      raise TypeError(
        f"value_and_grad needs loss_fn to return a scalar loss, the mean over its slice of the "
        f"batch, but it returned {_describe(loss)} on one device's slice of {rows} rows: "
        "reduce it (jnp.mean over the batch)."
      )
    return loss, aux

  def _loss_scale(self, opt_state: Any) -> jax.Array | None:
    """The current loss scale, from the optimizer state, if the policy scales the loss."""
    if self.settings.precision.loss_scale is None:
      return None
    if opt_state is None:
      raise ValueError(
        "tx's precision policy scales the loss, and the scale lives in the optimizer "
        "state: call value_and_grad(loss_fn, tx)(params, *batch, opt_state=opt_state)."
      )
    check_policy(opt_state, loss_scaled=True)
    return opt_state.loss_scale.scale


def placed(optimizer, params, batch, microbatches: int = 1) -> tuple[Any, Any, Any, Any]:
  """``params`` and ``batch`` checked and placed for a program under ``jax.shard_map`` over the
  batch axes: ``(plans, params, batch, (param_specs, batch_specs))``, the params as arrays."""
  settings = optimizer.settings
  checks.not_manual(settings)
  plans = optimizer.plans(params)
  params = plans.arrays(params, settings.mesh)
  checks.params(params, plans.params, settings)
  checks.batch(batch, settings, microbatches)
  param_specs = plans.params.map(lambda leaf: _data_only(leaf, settings.data_axes))
  batch_specs = tuple(jax.tree.map(lambda _: P(settings.batch_axes), b) for b in batch)
  if mesh_lib.is_explicit(settings.mesh):
    # Explicit axes: shard_map takes inputs only as they are typed, so place them.
    params = _reshard(params, plans.params.specs(), settings.mesh)
    batch = _reshard(batch, batch_specs, settings.mesh)
  return plans, params, batch, (param_specs, batch_specs)


def per_leaf_route(layout: layout_lib.Layout, settings, method, *trees: Any) -> Any:
  """``method(route, leaf, *values)`` for every leaf, with the ``Route`` its stage gives it."""
  route_of = settings.stage.route_of
  return layout.map(lambda leaf, *values: method(route_of(leaf), leaf, *values), *trees)


def _describe(x: Any) -> str:
  shape = getattr(x, "shape", None)
  return f"an array of shape {tuple(shape)}" if shape is not None else f"a {type(x).__name__}"


def _accumulate(micro_step, batch, microbatches, summed, axes):
  """Runs ``micro_step`` on each of ``microbatches`` slices of ``batch``, summing gradients.

  Returns the mean loss, every slice's aux stacked in batch order, and the
  summed gradients, in the shapes ``micro_step`` gives them (``summed``'s shapes
  and dtypes): so stages 2 and 3 accumulate reduce-scattered shards, and stage
  1 the full local gradient.
  """
  if microbatches == 1:
    loss, aux, grads = micro_step(batch)
    return loss, jax.tree.map(lambda a: jnp.asarray(a)[None], aux), grads
  chunks = jax.tree.map(lambda x: x.reshape(microbatches, -1, *x.shape[1:]), batch)
  zeros = jax.tree.map(lambda s: jax.lax.pcast(_zeros(s), axes, to="varying"), summed)

  def body(total, chunk):
    loss, aux, grads = micro_step(chunk)
    return jax.tree.map(jnp.add, total, grads), (loss, aux)

  grads, (losses, aux) = jax.lax.scan(body, zeros, chunks)
  return jnp.mean(losses), aux, grads


def _zeros(like: jax.ShapeDtypeStruct) -> jax.Array:
  """Zeros typed as ``like``, placed as it is over explicit mesh axes (pipeline stages)."""
  spec = tuple(getattr(like.sharding, "spec", None) or ())
  placed = {"out_sharding": P(*spec)} if any(e is not None for e in spec) else {}
  return jnp.zeros(like.shape, like.dtype, **placed)


def _reshard(tree, specs, mesh):
  return jax.tree.map(
    lambda x, spec: jax.sharding.reshard(x, NamedSharding(mesh, spec)),
    tree,
    specs,
    is_leaf=lambda x: isinstance(x, P),
  )


def _data_only(leaf: layout_lib.LeafLayout, data_axes: tuple[str, ...]) -> P:
  """The leaf's spec over the data axes alone (the other axes are not ``shard_map``'s)."""
  data = layout_lib.entry(data_axes)
  if leaf.dim is None:
    return P()
  spec = [None] * len(leaf.shape)
  spec[leaf.dim] = data
  return P(*spec[: len(spec) + leaf.dim + 1])  # no trailing Nones, as the params' specs
