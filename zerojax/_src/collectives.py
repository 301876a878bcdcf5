"""Parameter shards inside ``shard_map`` and the collectives that open them.

Inside ``zerojax.value_and_grad`` each parameter that the layout shards reaches
the loss function as a ``Shard``: this device's piece plus the static facts
``gather`` needs (which dimension, how much padding). ``gather`` turns it into
the full array:

* stage 3: an all-gather whose backward pass is a reduce-scatter, so the
  gradient comes back reduce-scattered, one layer at a time in a scan;
* stage 2: the parameter is already whole on every device, so the forward pass
  reads it as is, and a custom VJP reduce-scatters the cotangent into a
  shard-sized gradient "sink" during the backward pass.

Both cast on the way: the weight to the compute dtype before the all-gather
(so a bfloat16 policy moves half the bytes), the cotangent to the reduce dtype
before the reduce-scatter, and the result to the master dtype. With
quantization (``quantized_weights``, ``quantized_gradients``) the all-gather
moves block-quantized integers instead, and the reduce-scatter becomes an
all-to-all of quantized chunks summed in float32 (see ``quantize.py``). The
shards opened together move together, one collective each way
(``buckets.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from zerojax._src import buckets, quantize

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
  the body is about to use, so that only one layer is ever whole (or let
  ``zerojax.scan`` gather each layer for you, one layer ahead). Leaves that
  are already full arrays pass through, so the same model code runs at every
  stage and outside ``value_and_grad`` (for evaluation). The shards of one
  call travel together: one all-gather for all of them, and one
  reduce-scatter for their gradients.

  Args:
    tree: a pytree whose leaves are ``Shard`` s or arrays.

  Returns:
    The same pytree with every ``Shard`` replaced by the full parameter.

  Example:
    >>> import jax, jax.numpy as jnp, zerojax
    >>> zerojax.gather({"w": jnp.ones(3)})["w"]
    Array([1., 1., 1.], dtype=float32)
  """
  leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: isinstance(x, Shard))
  groups: dict[Any, list[int]] = {}
  for index, leaf in enumerate(leaves):
    if isinstance(leaf, Shard):
      groups.setdefault(_bucket_key(leaf), []).append(index)
  for indices in groups.values():
    for index, full in zip(indices, open_shards([leaves[i] for i in indices]), strict=True):
      leaves[index] = full
  return jax.tree.unflatten(treedef, leaves)


def open_shards(shards: list[Shard]) -> list[jax.Array]:
  """The full parameters of ``shards``, which share a bucket (see ``_bucket_key``).

  Stage 3 gathers them with one all-gather; stage 2 reads its replicated
  copies. Either way their gradients are reduce-scattered together.
  """
  bucket = bucket_of(shards)
  values = [shard.value for shard in shards]
  if shards[0].sink is None:
    fulls = buckets.gather(bucket, values)
  else:
    fulls = buckets.read(bucket, values, [shard.sink for shard in shards])
  return [checkpoint_name(full, GATHERED) for full in fulls]


def bucket_of(shards: list[Shard]) -> buckets.Bucket:
  """The static ``Bucket`` that opens ``shards`` together."""
  first = shards[0]
  return buckets.Bucket(
    tuple(map(_piece, shards)),
    first.axis_name,
    first.replica_axes,
    first.quantized_weights,
    first.quantized_gradients,
  )


def _bucket_key(shard: Shard) -> tuple[Any, ...]:
  """What shards must share to travel in one bucket: kind, axes and quantization."""
  return (
    shard.sink is None,
    shard.axis_name,
    shard.replica_axes,
    shard.quantized_weights,
    shard.quantized_gradients,
  )


def _piece(shard: Shard) -> buckets.Piece:
  value = shard.value
  compute = jnp.dtype(shard.compute_dtype or value.dtype)
  if shard.sink is None:
    shard_shape, grad = value.shape, value.dtype
  else:  # stage 2: the replicated copy is already in the compute dtype
    shard_shape, grad = shard.sink.shape, shard.sink.dtype
  return buckets.Piece(
    axis=value.ndim + shard.dim,
    size=shard.size,
    shard_shape=tuple(shard_shape),
    compute=compute,
    reduce=jnp.dtype(shard.reduce_dtype or compute),
    grad=jnp.dtype(grad),
    quantized=not jnp.issubdtype(value.dtype, jnp.complexfloating),
  )


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
  spec = tuple(getattr(jax.typeof(x).sharding, "spec", None) or ())
  split = {name for entry in spec if entry is not None for name in _axes_of(entry)}
  if split:
    # Split over explicit mesh axes too (pipeline stages): reduce each piece
    # where it lives, manual over those axes, as loops and collectives want.
    each = lambda x: scatter(x, dim, axis_name, size, quantization)
    return jax.shard_map(each, in_specs=P(*spec), out_specs=P(*spec), axis_names=split)(x)
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


def _axes_of(entry: Any) -> tuple[str, ...]:
  return tuple(entry) if isinstance(entry, tuple) else (entry,)
