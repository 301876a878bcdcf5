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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

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


def reduce_scatter(
  x: jax.Array, axis_name: Any, axis: int, spec: Quantization, dtype: Any
) -> jax.Array:
  """A tiled ``jax.lax.psum_scatter`` along ``axis`` built on a quantized all-to-all.

  ``x.shape[axis]`` must divide by the number of devices. Each device cuts its
  ``x`` into one chunk per device, quantizes every chunk and sends it to its
  owner (``jax.lax.all_to_all``); each device then dequantizes the chunks it
  received and sums them in float32, so no partial sum is ever quantized
  again, and returns the sum as ``dtype``.
  """
  count = jax.lax.axis_size(axis_name)
  shape = list(x.shape)
  shape[axis : axis + 1] = [count, shape[axis] // count]
  chunks = jnp.moveaxis(x.reshape(shape), axis, 0)  # (devices, ..., chunk, ...)
  blocks = quantize(chunks, spec, batch_dims=1)
  received = Blocks(
    *(jax.lax.all_to_all(b, axis_name, 0, 0, tiled=True) for b in blocks)
  )  # row i: this device's chunk as device i quantized it
  summed = jnp.sum(dequantize(received, spec, chunks.shape, jnp.float32), axis=0)
  return summed.astype(dtype)


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
