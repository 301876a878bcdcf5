"""Parameter shards inside ``shard_map`` and the collectives that open them.

Inside ``zerojax.value_and_grad`` each parameter that the layout shards reaches
the loss function as a ``Shard``: this device's piece plus the static facts
``gather`` needs (which dimension, how much padding). ``gather`` turns it into
the full array:

* stage 3: a tiled ``all_gather`` whose backward pass is a ``psum_scatter``,
  so the gradient comes back reduce-scattered, one layer at a time in a scan;
* stage 2: the parameter is already whole on every device, so the forward pass
  reads it as is, and a custom VJP reduce-scatters the cotangent into a
  shard-sized gradient "sink" during the backward pass.

Both cast on the way: the weight to the compute dtype before the all-gather
(so a bfloat16 policy moves half the bytes), the cotangent to the reduce dtype
before the reduce-scatter, and the result to the master dtype. With
quantization (``quantized_weights``, ``quantized_gradients``) the all-gather
moves block-quantized integers instead, and the reduce-scatter becomes an
all-to-all of quantized chunks summed in float32 (see ``quantize.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from zerojax._src import quantize

#: ``jax.checkpoint_name`` of every array ``gather`` returns.
GATHERED = "zerojax_gathered"


def remat_policy(primitive, *_, **params) -> bool:
  """A ``jax.checkpoint`` policy that saves everything except gathered parameters.

  With it, a checkpointed layer re-gathers its weights in the backward pass
  instead of keeping every layer's gathered weights alive from the forward
  pass to the backward pass, which would hold the whole model on each device.
  Slices and casts are not saved either: they are free to recompute, and the
  slice that removes padding (stage 3) or the cast that reads a replicated
  weight (stage 2) would otherwise keep a full weight alive.

  Example:
    >>> import jax, zerojax
    >>> body = jax.checkpoint(lambda h, w: h @ zerojax.gather(w), policy=zerojax.remat_policy)
  """
  name = primitive.name
  if name.startswith("all_gather") or name == "slice":
    return False
  if name == "custom_vjp_call" and _reads(params["call_jaxpr"]):
    return False
  return not (name == "name" and params.get("name") == GATHERED)


#: What the forward passes of ``gather``'s custom VJPs consist of.
_READS = frozenset({"pvary", "pcast", "convert_element_type", "bitcast_convert_type", "all_gather"})


def _reads(closed_jaxpr) -> bool:
  """Whether a custom VJP's forward pass reads a parameter: casts it, or gathers it."""
  names = [eqn.primitive.name for eqn in closed_jaxpr.jaxpr.eqns]
  return "all_gather" in names or all(name in _READS for name in names)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Shard:
  """This device's part of a parameter, as the loss function of ``value_and_grad`` sees it.

  Use ``zerojax.gather`` to turn it into the full parameter. Slicing by
  ``jax.lax.scan`` over stacked layers is fine: the sharded dimension is
  counted from the end.

  Attributes:
    value: the local array: a 1/N shard (stage 3) or the whole parameter
      (stage 2).
    sink: stage 2 only: a zero array of the shard's shape that receives the
      reduce-scattered gradient; ``None`` in stage 3.
    dim: the sharded dimension, counted from the end.
    size: the logical (unpadded) size of that dimension.
    axis_name: the data-parallel mesh axis, or tuple of axes.
    compute_dtype: the dtype ``gather`` returns (the precision policy's
      compute dtype); ``None`` keeps ``value``'s.
    reduce_dtype: the dtype the gradient is reduce-scattered in; ``None``
      keeps the gradient's.
    replica_axes: the other axes the batch is split over (hybrid sharding).
      The gradient is reduce-scattered over ``axis_name`` only and left
      varying over these, for ``value_and_grad`` to sum once per step.
    quantized_weights: stage 3: how the all-gather quantizes the weight
      (``None``: it moves the compute dtype).
    quantized_gradients: how the reduce-scatter quantizes the gradient
      (``None``: it moves the reduce dtype).

  Example:
    >>> import jax, jax.numpy as jnp, optax, zerojax
    >>> tx = zerojax.zero3(optax.sgd(0.1), mesh=jax.make_mesh((jax.device_count(),), ("data",)))
    >>> def loss_fn(params, x):
    ...   print(type(params["w"]).__name__, params["w"].value.shape)
    ...   return jnp.sum(x @ zerojax.gather(params["w"]))
    >>> params = tx.shard({"w": jnp.ones((4, 1024))})
    >>> _ = zerojax.value_and_grad(loss_fn, tx)(params, jnp.ones((8, 4)))
    Shard (4, 128)
  """

  value: jax.Array
  sink: jax.Array | None
  dim: int = dataclasses.field(metadata=dict(static=True))
  size: int = dataclasses.field(metadata=dict(static=True))
  axis_name: str = dataclasses.field(metadata=dict(static=True))
  compute_dtype: Any = dataclasses.field(default=None, metadata=dict(static=True))
  reduce_dtype: Any = dataclasses.field(default=None, metadata=dict(static=True))
  replica_axes: tuple[str, ...] = dataclasses.field(default=(), metadata=dict(static=True))
  quantized_weights: quantize.Quantization | None = dataclasses.field(
    default=None, metadata=dict(static=True)
  )
  quantized_gradients: quantize.Quantization | None = dataclasses.field(
    default=None, metadata=dict(static=True)
  )

  def __jax_array__(self):
    raise TypeError(
      "this is a zerojax parameter shard, not the parameter: call "
      "zerojax.gather(...) on it (or on the pytree that holds it) first."
    )


def gather(tree: Any) -> Any:
  """Turns the parameter shards in ``tree`` into full arrays.

  Call it inside the loss function given to ``zerojax.value_and_grad``, as late
  as possible: inside a ``jax.lax.scan`` over stacked layers, gather the layer
  the body is about to use, so that only one layer is ever whole. Leaves that
  are already full arrays pass through, so the same model code runs at every
  stage and outside ``value_and_grad`` (for evaluation).

  Args:
    tree: a pytree whose leaves are ``Shard`` s or arrays.

  Returns:
    The same pytree with every ``Shard`` replaced by the full parameter.

  Example:
    >>> import jax, jax.numpy as jnp, zerojax
    >>> zerojax.gather({"w": jnp.ones(3)})["w"]
    Array([1., 1., 1.], dtype=float32)
  """
  return jax.tree.map(
    lambda x: _gather(x) if isinstance(x, Shard) else x,
    tree,
    is_leaf=lambda x: isinstance(x, Shard),
  )


def _gather(shard: Shard) -> jax.Array:
  if shard.sink is None:
    axis = shard.value.ndim + shard.dim
    compute = shard.compute_dtype or shard.value.dtype
    wire = _Wire(
      compute,
      shard.reduce_dtype,
      shard.value.dtype,
      shard.quantized_weights,
      shard.quantized_gradients,
    )
    full = _all_gather(shard.value, axis, shard.axis_name, wire)
    full = jax.lax.slice_in_dim(full, 0, shard.size, axis=axis)
  else:
    # Stage 2 stores the replicated copy in the compute dtype already.
    wire = _Wire(
      shard.value.dtype, shard.reduce_dtype, shard.sink.dtype, None, shard.quantized_gradients
    )
    # The gradient's padded size: a dimension shared with other mesh axes may
    # be padded to more than a multiple of the data shards.
    padded = shard.sink.shape[shard.sink.ndim + shard.dim] * jax.lax.axis_size(shard.axis_name)
    place = _Placement(shard.dim, padded, shard.axis_name, shard.replica_axes)
    full = _read_whole(shard.value, shard.sink, place, wire)
  return checkpoint_name(full, GATHERED)


class _Wire(NamedTuple):
  """How one gather's collectives move data.

  Forward: cast to ``compute`` (or quantize as ``weights``); backward: cast to
  ``reduce`` (and quantize as ``gradients``), then to ``grad``.
  """

  compute: Any
  reduce: Any
  grad: Any
  weights: quantize.Quantization | None
  gradients: quantize.Quantization | None

  def for_reduction(self, cotangent: jax.Array) -> jax.Array:
    return cotangent.astype(self.reduce or cotangent.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _all_gather(value, axis, axis_name, wire):
  """A tiled all-gather in the compute dtype whose backward pass reduce-scatters."""
  if _quantizable(value, wire.weights):
    return quantize.all_gather(value, axis_name, axis, wire.weights, wire.compute)
  if value.dtype == wire.compute:
    return jax.lax.all_gather(value, axis_name, axis=axis, tiled=True)
  bits = as_bits(value.astype(wire.compute))
  return from_bits(jax.lax.all_gather(bits, axis_name, axis=axis, tiled=True), wire.compute)


def as_bits(x: jax.Array) -> jax.Array:
  """``x``'s bits as unsigned integers of the same width, for moving it unchanged.

  A collective on the bits moves exactly ``x``'s bytes: XLA cannot widen it
  (XLA:CPU runs bfloat16 collectives in float32) or move a preceding
  narrowing cast past it.
  """
  return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def from_bits(bits: jax.Array, dtype: Any) -> jax.Array:
  """The inverse of ``as_bits``."""
  return jax.lax.bitcast_convert_type(bits, dtype)


def _all_gather_fwd(value, axis, axis_name, wire):
  return _all_gather(value, axis, axis_name, wire), None


def _all_gather_bwd(axis, axis_name, wire, residuals, cotangent):
  del residuals
  grad = reduce_scatter(wire.for_reduction(cotangent), axis_name, axis, wire.gradients)
  return (grad.astype(wire.grad),)


_all_gather.defvjp(_all_gather_fwd, _all_gather_bwd)


def reduce_scatter(
  x: jax.Array, axis_name: Any, axis: int, quantization: quantize.Quantization | None = None
) -> jax.Array:
  """A tiled ``psum_scatter`` along ``axis``; with ``quantization``, ZeRO++'s quantized one.

  The quantized reduction sums in float32 (or ``x``'s dtype, if wider).
  """
  if not _quantizable(x, quantization):
    return jax.lax.psum_scatter(x, axis_name, scatter_dimension=axis, tiled=True)
  return quantize.reduce_scatter(x, axis_name, axis, quantization, _summed_in(x))


def all_reduce(
  x: jax.Array, axis_name: Any, quantization: quantize.Quantization | None = None
) -> jax.Array:
  """A ``psum``; with ``quantization``, a quantized reduce-scatter and all-gather."""
  if not _quantizable(x, quantization):
    return jax.lax.psum(x, axis_name)
  return quantize.all_reduce(x, axis_name, quantization, _summed_in(x))


def _quantizable(x: jax.Array, quantization: quantize.Quantization | None) -> bool:
  """Whether ``x`` moves quantized: ``quantization`` is set and ``x`` is real.

  Complex leaves move unquantized: a block's codes and scale are real numbers.
  """
  return quantization is not None and not jnp.issubdtype(x.dtype, jnp.complexfloating)


def _summed_in(x: jax.Array) -> Any:
  """The dtype a quantized reduction of ``x`` sums in: float32, or ``x``'s if wider."""
  return jnp.promote_types(x.dtype, jnp.float32)


def scatter(
  x: jax.Array,
  dim: int,
  axis_name: Any,
  size: int | None = None,
  quantization: quantize.Quantization | None = None,
) -> jax.Array:
  """Reduce-scatters a full per-device array into this device's padded shard (a sum).

  ``dim`` is zero-padded to ``size`` first (by default, to the next multiple of
  the number of shards). With ``quantization`` the chunks move block-quantized
  (see ``reduce_scatter``).

  An array of stacked layers whose sharded dimension is not its first is
  reduce-scattered one layer at a time: a collective over a dimension other
  than the most major moves strided blocks, and XLA lays the whole array out
  again first, a second full-size copy of the gradient.
  """
  axis = x.ndim + dim
  if axis > 0 and x.ndim > 2:
    return jax.lax.map(lambda layer: scatter(layer, dim, axis_name, size, quantization), x)
  if size is None:
    size = -(-x.shape[axis] // jax.lax.axis_size(axis_name)) * jax.lax.axis_size(axis_name)
  padding = size - x.shape[axis]
  if padding:
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, padding)
    x = jnp.pad(x, widths)
  return reduce_scatter(x, axis_name, axis, quantization)


class _Placement(NamedTuple):
  """Where a stage-2 gradient goes: its dimension, padded size and axes."""

  dim: int
  padded: int
  axis_name: Any
  replica_axes: tuple[str, ...]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _read_whole(value, sink, place, wire):
  """Reads a replicated parameter; its gradient goes, reduce-scattered, to ``sink``."""
  del sink, wire
  # Varying, so that the cotangent reaching the backward pass is this device's
  # own, not one JAX has already all-reduced (over replicas either).
  data = (place.axis_name,) if isinstance(place.axis_name, str) else tuple(place.axis_name)
  return jax.lax.pcast(value, (*data, *place.replica_axes), to="varying")


def _read_whole_fwd(value, sink, place, wire):
  return _read_whole(value, sink, place, wire), None


def _read_whole_bwd(place, wire, residuals, cotangent):
  del residuals
  # The stored replicated copy is already in the compute dtype (the master copy
  # lives elsewhere), so the cotangent's shape and dtype are the value's.
  reduced = wire.for_reduction(cotangent)
  grad = scatter(reduced, place.dim, place.axis_name, place.padded, wire.gradients)
  return jnp.zeros(cotangent.shape, cotangent.dtype), grad.astype(wire.grad)


_read_whole.defvjp(_read_whole_fwd, _read_whole_bwd)
