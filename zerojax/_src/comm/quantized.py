"""Block-wise symmetric quantization, for moving weights and gradients in fewer bytes.

ZeRO++ (Wang et al., 2023) sends stage 3's weight all-gathers (qwZ) and its
gradient reduce-scatters (qgZ) as 8-bit (or 4-bit) integers: an array is cut
into blocks of ``block_size`` consecutive elements, each block gets one
float32 scale (its largest magnitude), and each element becomes the nearest of
the ``2 * qmax + 1`` evenly spaced levels between ``-scale`` and ``scale``.
Dequantizing multiplies back, so every element is off by at most half a level,
``scale / (2 * qmax)``, whatever the other blocks hold: one outlier coarsens
only its own block.

Non-finite values survive: a block holding an inf or a NaN gets a non-finite
scale, and every element of it dequantizes to NaN, so a step whose gradients
overflowed is still seen as non-finite and skipped.

4-bit codes are packed two to a byte, so the bytes that move are
``n * bits / 8 + 4 * n / block_size``: 0.254 of float32's for 8 bits and
0.129 for 4, with blocks of 256.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from zerojax._src.sharding import mesh as mesh_lib

#: The ``quantized_weights`` / ``quantized_gradients`` values and their bit widths.
FORMATS = {"int8": 8, "int4": 4}
#: ZeRO++'s block size: elements per scale.
DEFAULT_BLOCK_SIZE = 256


class Quantization(NamedTuple):
  """How a collective's payload is quantized: bits per element and elements per scale.

  Attributes:
    bits: 8 or 4.
    block_size: consecutive elements sharing one scale.

  Example:
    >>> import jax, optax, zerojax
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = zerojax.zero3(optax.adam(1e-3), mesh=mesh, quantized_weights="int8")
    >>> tx.quantized_weights, tx.quantized_gradients
    (Quantization(bits=8, block_size=256), None)
    >>> tx.quantized_weights.moved_bytes(1024)  # against 4096 bytes of float32
    1040
  """

  bits: int
  block_size: int

  @property
  def qmax(self) -> int:
    """The largest code; levels run from ``-qmax`` to ``qmax`` (127 for 8 bits, 7 for 4)."""
    return 2 ** (self.bits - 1) - 1

  def block(self, num_elements: int) -> int:
    """The block size used for an array of ``num_elements``: smaller arrays are one block."""
    return min(self.block_size, num_elements + num_elements % 2) or 2

  def moved_bytes(self, num_elements: int) -> int:
    """Bytes of codes and float32 scales that quantizing ``num_elements`` elements gives."""
    block = self.block(num_elements)
    blocks = -(-num_elements // block)
    return blocks * (block * self.bits // 8 + 4)


class Blocks(NamedTuple):
  """A quantized array: codes and one scale per block, with any leading batch dimensions.

  Attributes:
    codes: ``int8`` codes of shape ``(*batch, blocks, block_size)``; for 4
      bits, ``uint8`` of shape ``(*batch, blocks, block_size // 2)``, two codes
      a byte.
    scales: ``float32`` of shape ``(*batch, blocks)``: each block's largest
      magnitude.
  """

  codes: jax.Array
  scales: jax.Array


def resolve(what: str, name: str | None, block_size: int) -> Quantization | None:
  """The ``Quantization`` that the option ``what`` (e.g. ``"quantized_weights"``) names."""
  integral = isinstance(block_size, numbers.Integral) and not isinstance(block_size, bool)
  if not integral or block_size < 2 or block_size % 2:
    raise ValueError(
      f"quantization_block_size must be a positive even int (elements per scale), "
      f"got {block_size!r}; 256 is ZeRO++'s choice."
    )
  if name is None:
    return None
  if name not in FORMATS:
    raise ValueError(
      f"{what}={name!r} is not a format zerojax has: pass None or one of {sorted(FORMATS)}."
    )
  return Quantization(FORMATS[name], int(block_size))


def check_stage(stage: int, quantized_weights: Any) -> None:
  """Raises unless ``quantized_weights`` is ``None`` or ``stage`` is 3, the stage that gathers."""
  if quantized_weights is not None and stage < 3:
    raise ValueError(
      "quantized_weights quantizes the weight all-gathers that stage 3 makes before each use; "
      f"stage {stage} keeps the parameters whole on every device and makes none (stages 1 and 2 "
      "gather the updated parameters once, unquantized). Use stage 3 (zerojax.zero3) for "
      "quantized weights, or quantized_gradients alone."
    )


def quantize(x: jax.Array, spec: Quantization, batch_dims: int = 0) -> Blocks:
  """Quantizes ``x`` block-wise, each of its first ``batch_dims`` dimensions kept apart.

  The remaining dimensions are flattened and zero-padded to a multiple of the
  block size (``spec.block(n)``: an array smaller than a block is one block of
  its own size, so a small leaf is not padded to a whole block).

  Args:
    x: a floating-point array (any float dtype; the arithmetic is float32).
    spec: bits and block size.
    batch_dims: how many leading dimensions to quantize separately (one row per
      device of a collective, say).

  Returns:
    The ``Blocks``.

  Example:
    >>> import jax.numpy as jnp
    >>> from zerojax._src.comm import quantized as q
    >>> spec = q.Quantization(bits=8, block_size=4)
    >>> blocks = q.quantize(jnp.array([1.0, -0.5, 0.25, 0.0, 3.0]), spec)
    >>> blocks.codes.tolist(), blocks.scales.tolist()
    ([[127, -64, 32, 0], [127, 0, 0, 0]], [1.0, 3.0])
    >>> q.dequantize(blocks, spec, (5,), jnp.float32).tolist()
    [1.0, -0.5039370059967041, 0.25196850299835205, 0.0, 3.0]
  """
  batch = x.shape[:batch_dims]
  flat = x.reshape(*batch, -1).astype(jnp.float32)
  block = spec.block(flat.shape[-1])
  padding = -flat.shape[-1] % block
  if padding:
    flat = jnp.pad(flat, [(0, 0)] * batch_dims + [(0, padding)])
  blocks = flat.reshape(*batch, -1, block)
  # NaN-propagating, so a block holding a NaN or an inf gets a non-finite scale.
  scales = jnp.max(jnp.abs(blocks), axis=-1)
  step = scales / spec.qmax
  safe = jnp.where(step > 0, step, 1.0)  # all-zero blocks: codes 0, scale 0
  codes = jnp.clip(jnp.round(blocks / safe[..., None]), -spec.qmax, spec.qmax)
  # Codes 0 in a non-finite block (0 x inf is NaN): it dequantizes to NaN on every platform.
  codes = jnp.where(jnp.isfinite(scales)[..., None], codes, 0).astype(jnp.int8)
  if spec.bits == 4:
    codes = _pack(codes)
  return Blocks(codes, scales)


def dequantize(blocks: Blocks, spec: Quantization, shape: tuple[int, ...], dtype: Any) -> jax.Array:
  """The array that ``quantize`` saw, to within half a level per element, as ``dtype``.

  Args:
    blocks: what ``quantize`` returned, or a collective made of it.
    spec: the ``Quantization`` it was made with.
    shape: the logical shape, batch dimensions included (the padding of the
      last block is dropped).
    dtype: the result's dtype.

  Returns:
    An array of ``shape`` and ``dtype``.
  """
  codes = _unpack(blocks.codes) if spec.bits == 4 else blocks.codes
  values = codes.astype(jnp.float32) * (blocks.scales / spec.qmax)[..., None]
  batch = blocks.scales.ndim - 1
  values = values.reshape(*values.shape[:batch], -1)
  size = math.prod(shape[batch:])
  return values[..., :size].reshape(shape).astype(dtype)


def _pack(codes: jax.Array) -> jax.Array:
  """Two 4-bit codes (offset by 8, so 1..15) per ``uint8``: the even one in the low nibble."""
  nibbles = (codes + 8).astype(jnp.uint8)
  return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def _unpack(packed: jax.Array) -> jax.Array:
  low = (packed & 15).astype(jnp.int8) - 8
  high = (packed >> 4).astype(jnp.int8) - 8
  return jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], -1)


def all_gather(
  x: jax.Array, axis_name: Any, axis: int, spec: Quantization, dtype: Any, invariant=False
) -> jax.Array:
  """A tiled ``jax.lax.all_gather`` of ``x`` along ``axis`` that moves quantized blocks.

  Each device quantizes its own piece; the codes and scales are gathered and
  dequantized to ``dtype`` on arrival. ``invariant`` types the result as the
  same on every device of ``axis_name`` (which it is), as a ``psum``'s is.
  """
  gather = (
    functools.partial(jax.lax.all_gather, to="invarying") if invariant else jax.lax.all_gather
  )
  blocks = gather(quantize(x, spec), axis_name, axis=0)
  count = blocks.scales.shape[0]
  pieces = dequantize(blocks, spec, (count, *x.shape), dtype)
  # (devices, ..., piece, ...) -> (..., devices * piece, ...)
  pieces = jnp.moveaxis(pieces, 0, axis)
  shape = list(x.shape)
  shape[axis] *= count
  return pieces.reshape(shape)


def all_gather_together(
  xs: Sequence[jax.Array],
  axis_name: Any,
  axes: Sequence[int],
  spec: Quantization,
  dtypes: Sequence[Any],
) -> list[jax.Array]:
  """``all_gather`` of each of ``xs``, every array's codes and scales as the bytes of one buffer.

  One collective instead of two per array: across nodes each pays a round
  trip per node (``_exchanged_sums`` says how XLA:GPU prices them). Each
  array is quantized on its own, so what arrives is ``all_gather``'s. On
  TPUs, where a bitcast to bytes is emulated, each array moves apart, as
  ``all_gather`` moves it.
  """
  if mesh_lib.traced_platform() == "tpu" or len(xs) < 2:
    return [all_gather(x, axis_name, a, spec, d) for x, a, d in zip(xs, axes, dtypes, strict=True)]
  blocks = [quantize(x, spec) for x in xs]
  parts = [jax.lax.bitcast_convert_type(part, jnp.int8).reshape(-1) for b in blocks for part in b]
  rows = jax.lax.all_gather(jnp.concatenate(parts), axis_name, axis=0)  # (devices, bytes)
  count, start, results = rows.shape[0], 0, []
  for x, b, axis, dtype in zip(xs, blocks, axes, dtypes, strict=True):
    gathered = []
    for part in b:
      width = part.dtype.itemsize
      piece = rows[:, start : start + part.size * width]
      start += part.size * width
      shape = (count, *part.shape, width) if width > 1 else (count, *part.shape)
      gathered.append(jax.lax.bitcast_convert_type(piece.reshape(shape), part.dtype))
    pieces = dequantize(Blocks(*gathered), spec, (count, *x.shape), dtype)
    shape = list(x.shape)
    shape[axis] *= count
    results.append(jnp.moveaxis(pieces, 0, axis).reshape(shape))
  return results


def hierarchy(
  axis_name: Any, inner_axes: tuple[str, ...] | None = None
) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """The axes a quantized reduction over ``axis_name`` crosses first, and those it crosses after.

  Inside ``jax.shard_map``. Over one axis of more than one device, one round:
  ``((), axes)``. Over several, two, as ZeRO++'s hierarchical all-to-all:
  first over the axes inside a node, ``inner_axes`` (hpZ's secondary axes) or
  by default the last axis of ``axis_name`` (the innermost, the fast links
  on a mesh that lists the axes across nodes first), then over the others.
  Axes of one device are left out: nothing crosses them.

  Example:
    >>> import jax
    >>> mesh = jax.make_mesh((2, 4), ("node", "data"))
    >>> def rounds(x):
    ...   print(hierarchy(("node", "data")), hierarchy(("data", "node"), ("data",)))
    ...   return x
    >>> _ = jax.shard_map(rounds, mesh=mesh, in_specs=jax.P(), out_specs=jax.P())(0.0)
    (('data',), ('node',)) (('data',), ('node',))
  """
  axes = tuple(name for name in _names(axis_name) if jax.lax.axis_size(name) > 1)
  named = inner_axes or _names(axis_name)[-1:]
  inner = tuple(name for name in axes if name in named)
  outer = tuple(name for name in axes if name not in inner)
  if inner and outer:
    return inner, outer
  return (), axes or _names(axis_name)  # over devices of one axis, or of none (a round trip)


def _names(axis_name: Any) -> tuple[str, ...]:
  return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def reduce_scatter(
  x: jax.Array,
  axis_name: Any,
  axis: int,
  spec: Quantization,
  dtype: Any,
  inner_axes: tuple[str, ...] | None = None,
) -> jax.Array:
  """A tiled ``jax.lax.psum_scatter`` along ``axis`` built on quantized all-to-alls.

  ``x.shape[axis]`` must divide by the number of devices. Each device cuts its
  ``x`` into one chunk per device, quantizes the chunks and sends each to its
  owner (``jax.lax.all_to_all``); the owner dequantizes the chunks it
  received and sums them in float32, and returns the sum as ``dtype``.

  Over several mesh axes it takes two rounds (``hierarchy``), ZeRO++'s
  hierarchical qgZ: inside the node first, where each device receives, from
  every device of its node, the chunks of every device that has its
  coordinates on ``inner_axes``, and sums them; then that node-wide sum is
  quantized again and sent across nodes, to the chunks' owners. A device thus
  sends across nodes ``1 / (devices in a node)`` of ``x``, not all of it.
  Each element of the result is off by at most the first round's half levels
  (one per device, of its own chunk's block) plus the second round's (one per
  node, of the block of its node's sum).
  """
  return reduce_scatter_together([x], axis_name, [axis], spec, [dtype], inner_axes)[0]


def reduce_scatter_together(
  xs: Sequence[jax.Array],
  axis_name: Any,
  axes: Sequence[int],
  spec: Quantization,
  dtypes: Sequence[Any],
  inner_axes: tuple[str, ...] | None = None,
) -> list[jax.Array]:
  """``reduce_scatter`` of each of ``xs`` along its ``axes`` entry, in one all-to-all per round.

  The arrays' codes and scales travel as the bytes of one buffer, so that a
  layer's gradients pay one collective's latency per round, not two per array.
  """
  names = _names(axis_name)
  inner, outer = hierarchy(axis_name, inner_axes)
  chunks = [_device_major(x, axis, names, inner + outer) for x, axis in zip(xs, axes, strict=True)]
  ranks = [x.ndim for x in xs]
  if inner:
    count = math.prod(jax.lax.axis_size(name) for name in inner)
    chunks = [c.reshape(count, -1, *c.shape[1:]) for c in chunks]
    chunks = _exchanged_sums(chunks, inner, spec, ranks)  # the node's sums, to send on
  sums = _exchanged_sums(chunks, outer, spec, ranks)
  return [summed.astype(dtype) for summed, dtype in zip(sums, dtypes, strict=True)]


def _device_major(
  x: jax.Array, axis: int, names: tuple[str, ...], order: tuple[str, ...]
) -> jax.Array:
  """``x`` cut along ``axis`` into a chunk per device of ``names``, the devices first, in ``order``.

  Returns ``(devices, *x.shape)`` with ``axis`` shrunk to one chunk; the
  devices of the axes in ``order`` are counted as ``order`` lists them (axes
  of one device, which ``order`` leaves out, count for nothing).
  """
  sizes = [jax.lax.axis_size(name) for name in names]
  shape = list(x.shape)
  chunk = shape[axis] // math.prod(sizes)
  split = x.reshape(*shape[:axis], *sizes, chunk, *shape[axis + 1 :])
  devices = [axis + names.index(name) for name in order]
  rest = [dim for dim in range(split.ndim) if dim not in devices]
  return jnp.transpose(split, devices + rest).reshape(-1, *shape[:axis], chunk, *shape[axis + 1 :])


def _exchanged_sums(
  chunks: Sequence[jax.Array], axes: tuple[str, ...], spec: Quantization, ranks: Sequence[int]
) -> list[jax.Array]:
  """Row ``i`` of each of ``chunks`` sent quantized to device ``i`` of ``axes``; arrivals summed.

  ``ranks`` holds each array's rank: its leading dimensions beyond it index
  chunks (the devices of this round, and of the next one). What arrives is
  summed in float32, after dequantizing: a sum of codes would overflow, and
  would mix the senders' scales.

  How the codes and scales move depends on the platform. On TPUs each
  array's codes and its scales move in all-to-alls of their own: XLA:TPU
  holds a concatenated buffer apart from its pieces (0.3-0.5 GiB more
  temporaries on an 8-chip v5e, benchmarks/nodes.py's activation-heavy
  model). Elsewhere every array's codes and scales travel as the bytes of one
  buffer, one all-to-all a round: XLA:GPU prices each collective across nodes
  at about 80 cycles before its first byte, and runs one at a time.
  """
  # Each chunk (one per device of the reduction, whichever round) is blocked on its own, so
  # the blocks, and the numbers, do not depend on how the devices are grouped into rounds.
  blocks = [
    quantize(c, spec, batch_dims=c.ndim - rank) for c, rank in zip(chunks, ranks, strict=True)
  ]
  axis_name = axes[0] if len(axes) == 1 else axes
  exchanged = _exchanged_apart if mesh_lib.traced_platform() == "tpu" else _exchanged_together
  arrived = exchanged(blocks, axis_name)
  return [
    jnp.sum(dequantize(b, spec, c.shape, jnp.float32), axis=0)
    for c, b in zip(chunks, arrived, strict=True)
  ]


def _exchanged_apart(blocks: list[Blocks], axis_name: Any) -> list[Blocks]:
  """Row ``i`` of every array's codes and of its scales to device ``i``, each on its own."""
  exchange = lambda x: jax.lax.all_to_all(x, axis_name, 0, 0, tiled=True)
  return [Blocks(*map(exchange, b)) for b in blocks]


def _exchanged_together(blocks: list[Blocks], axis_name: Any) -> list[Blocks]:
  """Row ``i`` of every array's codes and scales to device ``i``, as the bytes of one buffer."""
  packed = [_as_bytes(b) for b in blocks]
  buffer = packed[0] if len(packed) == 1 else jnp.concatenate(packed, axis=1)
  received = jax.lax.all_to_all(buffer, axis_name, 0, 0, tiled=True)
  starts = np.cumsum([0] + [p.shape[1] for p in packed])
  return [
    _from_bytes(received[:, start : start + p.shape[1]], b)
    for b, p, start in zip(blocks, packed, starts, strict=False)
  ]


def _as_bytes(blocks: Blocks) -> jax.Array:
  """Each row's codes, then its scales' bytes: ``int8`` of shape ``(rows, bytes)``."""
  rows = blocks.scales.shape[0]
  codes = jax.lax.bitcast_convert_type(blocks.codes, jnp.int8).reshape(rows, -1)
  scales = jax.lax.bitcast_convert_type(blocks.scales, jnp.int8).reshape(rows, -1)
  return jnp.concatenate([codes, scales], axis=1)


def _from_bytes(rows: jax.Array, like: Blocks) -> Blocks:
  """The inverse of ``_as_bytes``, for blocks shaped as ``like``."""
  count = rows.shape[0]
  codes_shape = (count, *like.codes.shape[1:])
  size = math.prod(codes_shape[1:])
  codes = jax.lax.bitcast_convert_type(rows[:, :size].reshape(codes_shape), like.codes.dtype)
  scales = rows[:, size:].reshape(count, *like.scales.shape[1:], 4)
  return Blocks(codes, jax.lax.bitcast_convert_type(scales, jnp.float32))


def all_reduce(x: jax.Array, axis_name: Any, spec: Quantization, dtype: Any) -> jax.Array:
  """A ``jax.lax.psum`` that moves quantized blocks: ``reduce_scatter``, then ``all_gather``.

  ``x`` is flattened and cut into one chunk per device; each device sums its
  chunk in float32 as ``reduce_scatter`` does, quantizes the sum once more, and
  the sums are gathered. Every device dequantizes the same gathered codes, its
  own chunk's included, so the result is identical on all of them (replicas
  stay in step).
  """
  count = jax.lax.axis_size(axis_name)
  flat = x.reshape(-1)
  padding = -flat.size % count
  if padding:
    flat = jnp.pad(flat, (0, padding))
  summed = reduce_scatter(flat, axis_name, 0, spec, jnp.float32)
  gathered = all_gather(summed, axis_name, 0, spec, dtype, invariant=True)
  return gathered[: x.size].reshape(x.shape)
