"""The collectives inside ``jax.shard_map``, on one array each.

Every array moves in a collective of its own: an all-gather of a layer's
weights is one ``all_gather`` per leaf, issued together, and its transpose one
``psum_scatter`` per leaf. XLA's all-gather and reduce-scatter combiners (on
GPU and TPU) merge the collectives of one step into a variadic collective of
several operands when that pays, without copying a byte, up to a threshold
(XLA:GPU's default is 30 MiB: the 64 MiB matrices of benchmarks/nodes.py's
model stay apart). Packing the leaves into one buffer by hand copies every
weight out of it once per use, and packing them as bytes on TPU, where a
bitcast to bytes is emulated, cost temporaries several times a layer's size
(docs/performance.md has the measurements). Across nodes, where XLA:GPU
prices each collective at a round trip per node, stage 3 packs a layer's
weights of one dtype all the same (``all_gather_together``, docs/scaling.md).

Each collective casts on the way: a weight to the compute dtype before its
all-gather (so a bfloat16 policy moves half the bytes; float32 to bfloat16 by
rounding the bits, ``narrowed_bits``, which XLA cannot hoist), a gradient to the
reduce dtype before its reduce-scatter. With quantization
(``quantized_weights``, ``quantized_gradients``) a weight's all-gather moves
its block-quantized codes and their scales (two collectives), and a
reduce-scatter becomes an all-to-all of quantized chunks that each device sums
in float32 (see ``quantized.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from zerojax._src.comm import quantized as quantize
from zerojax._src.sharding import layout as layout_lib
from zerojax._src.sharding import mesh as mesh_lib


def as_bits(x: jax.Array) -> jax.Array:
  """``x``'s bits as unsigned integers of the same width, for moving it unchanged.

  A collective on the bits moves exactly ``x``'s bytes: XLA cannot widen it
  (XLA:CPU runs bfloat16 collectives in float32) or move a preceding
  narrowing cast past it. The bitcast keeps the element count, so it costs
  nothing on any platform.
  """
  return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def narrowed_bits(x: jax.Array, dtype: Any) -> jax.Array:
  """The bits of ``x.astype(dtype)``, as ``as_bits`` gives them, computed so XLA keeps them small.

  A float32 weight narrowed to bfloat16 is rounded here in integer arithmetic
  on its bits (round to nearest even, as ``astype`` does; NaNs stay NaNs):
  the same bits, but no ``convert`` for XLA to move. Given a layer sliced from
  a stack of them in a loop, ``x.astype`` lets XLA:TPU's bfloat16
  propagation narrow the whole stack before the loop instead, a bfloat16 copy
  of every layer's shard alive for the whole loop (docs/performance.md).
  Other dtypes are cast with ``astype``.

  Example:
    >>> import jax.numpy as jnp
    >>> from zerojax._src.comm import primitives
    >>> x = jnp.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, jnp.inf])
    >>> bool(jnp.all(primitives.narrowed_bits(x, jnp.bfloat16)
    ...               == primitives.as_bits(x.astype(jnp.bfloat16))))
    True
  """
  if x.dtype != jnp.float32 or jnp.dtype(dtype) != jnp.bfloat16:
    return as_bits(x.astype(dtype))
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  # Adding 0x7fff, plus one when the kept part is odd, carries into the kept 16 bits exactly
  # when the dropped half is above one half, or equal to it with the kept part odd.
  rounded = (bits + jnp.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16
  nan = (bits & jnp.uint32(0x7FFFFFFF)) > jnp.uint32(0x7F800000)
  quiet = (bits >> 16) | jnp.uint32(0x0040)  # a NaN whose payload was all in the dropped bits
  return jnp.where(nan, quiet, rounded).astype(jnp.uint16)


def from_bits(bits: jax.Array, dtype: Any) -> jax.Array:
  """The inverse of ``as_bits``."""
  return jax.lax.bitcast_convert_type(bits, dtype)


def all_gather(
  x: jax.Array,
  axis_name: Any,
  axis: int,
  dtype: Any,
  quantization: quantize.Quantization | None = None,
) -> jax.Array:
  """A tiled ``jax.lax.all_gather`` of ``x`` along ``axis``, arriving as ``dtype``.

  ``x`` is cast to ``dtype`` before it moves (a narrower ``dtype`` moves as
  its bits, see ``as_bits``); with ``quantization``, its codes and scales
  move instead and are dequantized to ``dtype`` on arrival. Over axes of one
  device nothing moves, and nothing is quantized (hpZ's gather across nodes
  on a single node, say).
  """
  if quantization is not None and _is_real(x) and jax.lax.axis_size(axis_name) > 1:
    return quantize.all_gather(x, axis_name, axis, quantization, dtype)
  if x.dtype == dtype:
    return jax.lax.all_gather(x, axis_name, axis=axis, tiled=True)
  bits = narrowed_bits(x, dtype)
  return from_bits(jax.lax.all_gather(bits, axis_name, axis=axis, tiled=True), dtype)


def spans_nodes(axis_name: Any) -> bool:
  """Whether ``axis_name`` has several axes of more than one device each (inside ``jax.shard_map``).

  On a mesh that lists the axes across nodes apart from those inside one
  (``node x data``), its collectives cross nodes.
  """
  return sum(jax.lax.axis_size(name) > 1 for name in layout_lib.axes(axis_name)) > 1


def on_gpu() -> bool:
  """Whether the mesh being traced is of GPUs: where zerojax's schedule defaults are measured
  to pay (XLA:GPU's estimate; XLA:TPU gives none)."""
  return mesh_lib.traced_platform() == "gpu"


def all_gather_together(
  xs: Sequence[jax.Array],
  axis_name: Any,
  axes: Sequence[int],
  dtypes: Sequence[Any],
  quantization: quantize.Quantization | None = None,
) -> list[jax.Array]:
  """``all_gather`` of each of ``xs`` along its ``axes`` entry, one collective per dtype moved.

  Each array is cast as ``all_gather`` casts it (a narrower dtype as its
  bits), laid out with its gathered dimension first and flattened; the arrays
  that move in one dtype are concatenated into one buffer, which is gathered
  once (a row per device) and cut apart again into the full arrays, each
  arriving as its ``dtypes`` entry. The gather moves the same bytes as one
  per array, but pays a collective's fixed costs once: across nodes, XLA:GPU
  prices every collective at a round trip per ring step (per node) plus its
  launch, and its combiner leaves collectives of large arrays apart
  (docs/scaling.md). Cutting the full arrays out of the gathered rows copies
  each once, inside the device.

  With ``quantization`` the real arrays' codes and scales move as the bytes
  of one buffer instead (``quantized.all_gather_together``; on TPUs, where a
  bitcast to bytes is emulated, each array's in collectives of its own).
  """
  results: list[Any] = [None] * len(xs)
  if quantization is not None and jax.lax.axis_size(axis_name) > 1:
    real = [i for i, x in enumerate(xs) if _is_real(x)]
    pick = lambda values: [values[i] for i in real]
    fulls = quantize.all_gather_together(
      pick(xs), axis_name, pick(axes), quantization, pick(dtypes)
    )
    for i, full in zip(real, fulls, strict=True):
      results[i] = full
  moving: dict[int, jax.Array] = {}
  by_dtype: dict[Any, list[int]] = {}
  for i, (x, dtype) in enumerate(zip(xs, dtypes, strict=True)):
    if results[i] is None:
      moving[i] = x if x.dtype == dtype else narrowed_bits(x, dtype)
      by_dtype.setdefault(moving[i].dtype, []).append(i)
  count = jax.lax.axis_size(axis_name)
  for indices in by_dtype.values():
    fronts = [jnp.moveaxis(moving[i], axes[i], 0) for i in indices]
    buffer = jnp.concatenate([front.reshape(-1) for front in fronts])
    rows = jax.lax.all_gather(buffer, axis_name, axis=0)  # (devices, buffer)
    start = 0
    for i, front in zip(indices, fronts, strict=True):
      piece = rows[:, start : start + front.size].reshape(count * front.shape[0], *front.shape[1:])
      start += front.size
      full = jnp.moveaxis(piece, 0, axes[i])
      results[i] = full if full.dtype == dtypes[i] else from_bits(full, dtypes[i])
  return results


def reduce_scatter(
  x: jax.Array, axis_name: Any, axis: int, quantization: quantize.Quantization | None = None
) -> jax.Array:
  """A tiled ``psum_scatter`` along ``axis``; with ``quantization``, ZeRO++'s quantized one.

  The quantized reduction sums in float32 (or ``x``'s dtype, if wider), over
  several axes in two rounds, inside a node first (``reduce_scatter_together``).
  """
  return reduce_scatter_together([x], axis_name, [axis], quantization)[0]


def reduce_scatter_together(
  xs: Sequence[jax.Array],
  axis_name: Any,
  axes: Sequence[int],
  quantization: quantize.Quantization | None = None,
  inner_axes: tuple[str, ...] | None = None,
) -> list[jax.Array]:
  """``reduce_scatter`` of each of ``xs`` along its entry of ``axes``.

  Unquantized (or over axes of one device, where nothing moves), one
  ``psum_scatter`` each (XLA combines them where that pays).
  Quantized, the real arrays' chunks move together, one all-to-all per round;
  over several axes the first round stays inside a node: over ``inner_axes``,
  by default the last axis (``quantized.hierarchy``). Complex arrays move
  unquantized.
  """
  results: list[Any] = [None] * len(xs)
  moves = quantization is not None and jax.lax.axis_size(axis_name) > 1
  quantized = [i for i, x in enumerate(xs) if moves and _is_real(x)]
  for i, (x, axis) in enumerate(zip(xs, axes, strict=True)):
    if i not in quantized:
      results[i] = jax.lax.psum_scatter(x, axis_name, scatter_dimension=axis, tiled=True)
  if quantized:
    assert quantization is not None
    sums = quantize.reduce_scatter_together(
      [xs[i] for i in quantized],
      axis_name,
      [axes[i] for i in quantized],
      quantization,
      [_summed_in(xs[i]) for i in quantized],
      inner_axes,
    )
    for i, summed in zip(quantized, sums, strict=True):
      results[i] = summed
  return results


def all_reduce(
  x: jax.Array, axis_name: Any, quantization: quantize.Quantization | None = None
) -> jax.Array:
  """A ``psum``; with ``quantization``, a quantized reduce-scatter and all-gather."""
  if quantization is None or not _is_real(x) or jax.lax.axis_size(axis_name) == 1:
    return jax.lax.psum(x, axis_name)
  return quantize.all_reduce(x, axis_name, quantization, _summed_in(x))


def _is_real(x: jax.Array) -> bool:
  """Whether ``x`` can move quantized. Complex leaves cannot: a block's codes and scale are real."""
  return not jnp.issubdtype(x.dtype, jnp.complexfloating)


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

  ``dim`` (counted from the end) is zero-padded to ``size`` first (by default,
  to the next multiple of the number of shards). With ``quantization`` the
  chunks move block-quantized (see ``reduce_scatter``).

  An array of stacked layers whose sharded dimension is not its first is
  reduce-scattered one layer at a time: a collective over a dimension other
  than the most major moves strided blocks, and XLA lays the whole array out
  again first, a second full-size copy of the gradient.
  """
  split = {
    name
    for entry in getattr(jax.typeof(x).sharding, "spec", None) or ()
    for name in layout_lib.axes(entry or ())
  }
  if split:
    # Also split over explicit mesh axes (pipeline stages): reduce each piece
    # where it lives, manual over those axes, as loops and collectives want.
    spec = jax.typeof(x).sharding.spec
    each = lambda x: scatter(x, dim, axis_name, size, quantization)
    return jax.shard_map(each, in_specs=spec, out_specs=spec, axis_names=split)(x)
  axis = x.ndim + dim
  if axis > 0 and x.ndim > 2:
    return jax.lax.map(lambda layer: scatter(layer, dim, axis_name, size, quantization), x)
  count = jax.lax.axis_size(axis_name)
  if size is None:
    size = -(-x.shape[axis] // count) * count
  return reduce_scatter(layout_lib.pad_to(x, axis, size), axis_name, axis, quantization)
