"""One collective for many shards: a layer's weights gathered, and their gradients reduced, at once.

Small leaves (biases, norm scales) cost a collective's latency, not its
bandwidth, and on XLA:CPU every collective is a rendezvous of every device's
thread. So the shards that are opened together (a layer's, in a scan body, or
whatever ``zerojax.gather`` is given at once) travel together, as FSDP2's flat
buffer per module does:

* the all-gather of stage 3 moves every shard's bytes (cast to the compute
  dtype, or block-quantized with ``quantized_weights``) in one ``uint8``
  buffer per device, and cuts the full weights out of the gathered rows;
* its transpose, the gradient reduce-scatter, moves every leaf's cotangent in
  one buffer per reduce dtype (one all-to-all of quantized bytes with
  ``quantized_gradients``);
* stage 2 reads its replicated weights without a collective, and reduces
  their cotangents into its shard-sized sinks the same way.

A quantized leaf keeps blocks of its own, so bucketing changes no number: the
values each device receives are those the per-leaf collectives would give.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from zerojax._src import quantize

_BYTE = np.dtype(np.uint8)


class Piece(NamedTuple):
  """One shard of a bucket, as static facts.

  Attributes:
    axis: the sharded dimension of the layer's array (non-negative).
    size: its logical (unpadded) size in the full array.
    shard_shape: the shape of one device's piece.
    compute: the dtype the full weight is returned in.
    reduce: the dtype its gradient is reduced in.
    grad: the dtype its gradient is returned in.
    quantized: whether it moves block-quantized (real leaves only).
  """

  axis: int
  size: int
  shard_shape: tuple[int, ...]
  compute: Any
  reduce: Any
  grad: Any
  quantized: bool


class Bucket(NamedTuple):
  """Shards opened and reduced together, over one data axis (static, hashable).

  Attributes:
    pieces: one ``Piece`` per shard.
    axis_name: the data axis (or tuple of axes).
    replica_axes: the other axes the batch is split over (hybrid sharding):
      stage 2's weights are typed as varying over them too.
    weights: the ``Quantization`` of the gather, or ``None``.
    gradients: the ``Quantization`` of the reduction, or ``None``.
  """

  pieces: tuple[Piece, ...]
  axis_name: Any
  replica_axes: tuple[str, ...]
  weights: quantize.Quantization | None
  gradients: quantize.Quantization | None


def gather(bucket: Bucket, values: Sequence[jax.Array]) -> list[jax.Array]:
  """Stage 3's opening of shards: full weights in the compute dtype, padding sliced off.

  One all-gather moves every shard; its backward pass (``jax.grad`` through
  this function) is ``reduce_scatter``.
  """
  return list(_gather(bucket, tuple(values)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gather(bucket: Bucket, values: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
  return tuple(all_gather(bucket, values))


def _gather_fwd(bucket, values):
  return _gather(bucket, values), None


def _gather_bwd(bucket, residuals, cotangents):
  del residuals
  return (tuple(reduce_scatter(bucket, cotangents)),)


_gather.defvjp(_gather_fwd, _gather_bwd)


def read(bucket: Bucket, values: Sequence[jax.Array], sinks: Sequence[jax.Array]) -> list[Any]:
  """Stage 2's opening: the replicated weights as they are; their gradients go to ``sinks``.

  The weights are typed as varying over ``replica_axes`` and the data axes, so
  that the cotangent reaching the backward pass is this device's own, which
  one reduce-scatter then sums into the sinks.
  """
  return list(_read(bucket, tuple(values), tuple(sinks)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _read(bucket: Bucket, values, sinks):
  del sinks
  axes = (*_axes(bucket.axis_name), *bucket.replica_axes)
  return tuple(jax.lax.pcast(v, axes, to="varying") for v in values)


def _read_fwd(bucket, values, sinks):
  return _read(bucket, values, sinks), None


def _read_bwd(bucket, residuals, cotangents):
  del residuals
  # None: zero cotangents of the values' own types. Explicit zeros would lack
  # their varying axes (the stage axis, inside zerojax.pipeline's stages).
  return tuple(None for _ in cotangents), tuple(reduce_scatter(bucket, cotangents))


_read.defvjp(_read_fwd, _read_bwd)


def _axes(axis_name: Any) -> tuple[str, ...]:
  return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def all_gather(bucket: Bucket, values: Sequence[jax.Array]) -> list[jax.Array]:
  """The full weights of ``values`` (this device's shards), by one all-gather of bytes."""
  payloads = [
    _encode(piece, v, bucket.weights) for piece, v in zip(bucket.pieces, values, strict=True)
  ]
  rows = jax.lax.all_gather(jnp.concatenate(payloads), bucket.axis_name, axis=0)
  count = rows.shape[0]
  fulls, start = [], 0
  for piece, payload in zip(bucket.pieces, payloads, strict=True):
    chunk = rows[:, start : start + payload.size]
    start += payload.size
    pieces = _decode(piece, chunk, bucket.weights, count)
    fulls.append(_unpad(piece, _join(pieces, piece.axis)))
  return fulls


def reduce_scatter(bucket: Bucket, cotangents: Sequence[jax.Array]) -> list[jax.Array]:
  """Each device's shard of the sum over devices of ``cotangents`` (full, unpadded).

  One reduce-scatter per reduce dtype, or one all-to-all of quantized bytes
  whose chunks each device sums in float32.
  """
  count = jax.lax.axis_size(bucket.axis_name)
  chunks = [
    _split(_pad(piece, c.astype(piece.reduce), count), piece.axis, count)
    for piece, c in zip(bucket.pieces, cotangents, strict=True)
  ]
  quantized = [
    bucket.gradients is not None and piece.quantized for piece in bucket.pieces
  ]  # complex leaves move as they are
  shards: list[Any] = [None] * len(chunks)
  for flag, summed in ((False, _sum_scattered), (True, _sum_quantized)):
    indices = [i for i, q in enumerate(quantized) if q == flag]
    if indices:
      for i, shard in zip(indices, summed(bucket, [chunks[i] for i in indices]), strict=True):
        shards[i] = shard
  return [
    s.reshape(piece.shard_shape).astype(piece.grad)
    for piece, s in zip(bucket.pieces, shards, strict=True)
  ]


def _sum_scattered(bucket: Bucket, chunks: list[jax.Array]) -> list[jax.Array]:
  """Plain reduce-scatters of the ``(devices, n)`` chunks, one per dtype."""
  shards: list[Any] = [None] * len(chunks)
  by_dtype: dict[Any, list[int]] = {}
  for index, chunk in enumerate(chunks):
    by_dtype.setdefault(chunk.dtype, []).append(index)
  for indices in by_dtype.values():
    rows = jnp.concatenate([chunks[i] for i in indices], axis=1)
    summed = jax.lax.psum_scatter(rows, bucket.axis_name, scatter_dimension=0)
    start = 0
    for i in indices:
      shards[i] = summed[start : start + chunks[i].shape[1]]
      start += chunks[i].shape[1]
  return shards


def _sum_quantized(bucket: Bucket, chunks: list[jax.Array]) -> list[jax.Array]:
  """One all-to-all of every chunk's quantized bytes; each device sums what it receives."""
  spec = bucket.gradients
  payloads = [_quantized_rows(chunk, spec) for chunk in chunks]
  received = jax.lax.all_to_all(
    jnp.concatenate(payloads, axis=1), bucket.axis_name, 0, 0, tiled=True
  )  # row i: this device's chunks as device i sent them
  shards, start = [], 0
  for chunk, payload in zip(chunks, payloads, strict=True):
    rows = received[:, start : start + payload.shape[1]]
    start += payload.shape[1]
    values = _dequantized_rows(rows, spec, chunk.shape[1])
    summed = jnp.sum(values, axis=0)
    shards.append(summed.astype(jnp.promote_types(chunk.dtype, jnp.float32)))
  return shards


def _encode(piece: Piece, value: jax.Array, spec: quantize.Quantization | None) -> jax.Array:
  """This device's shard as bytes: the compute dtype's, or codes then scales."""
  if spec is None or not piece.quantized:
    return _bytes(value.astype(piece.compute))
  blocks = quantize.quantize(value.reshape(-1), spec)
  return jnp.concatenate([_bytes(blocks.codes), _bytes(blocks.scales)])


def _decode(piece: Piece, rows: jax.Array, spec, count: int) -> jax.Array:
  """``(devices, *shard_shape)`` in the compute dtype, from each device's bytes."""
  if spec is None or not piece.quantized:
    return _from_bytes(rows, piece.compute).reshape(count, *piece.shard_shape)
  n = math.prod(piece.shard_shape)
  return _dequantized_rows(rows, spec, n).reshape(count, *piece.shard_shape).astype(piece.compute)


def _quantized_rows(rows: jax.Array, spec: quantize.Quantization) -> jax.Array:
  """Each row of ``(devices, n)`` block-quantized on its own, as bytes: codes, then scales."""
  blocks = quantize.quantize(rows, spec, batch_dims=1)
  count = rows.shape[0]
  codes = _bytes(blocks.codes).reshape(count, -1)
  scales = _bytes(blocks.scales).reshape(count, -1)
  return jnp.concatenate([codes, scales], axis=1)


def _dequantized_rows(rows: jax.Array, spec: quantize.Quantization, n: int) -> jax.Array:
  """The float32 ``(devices, n)`` that ``_quantized_rows`` rows of ``n`` elements hold."""
  block = spec.block(n)
  blocks = -(-n // block)
  code_bytes = blocks * block * spec.bits // 8
  count = rows.shape[0]
  codes_dtype = jnp.uint8 if spec.bits == 4 else jnp.int8
  codes = _from_bytes(rows[:, :code_bytes], codes_dtype).reshape(count, blocks, -1)
  scales = _from_bytes(rows[:, code_bytes:], jnp.float32).reshape(count, blocks)
  return quantize.dequantize(quantize.Blocks(codes, scales), spec, (count, n), jnp.float32)


def _bytes(x: jax.Array) -> jax.Array:
  """``x``'s bytes, flat (``uint8``): a collective on them moves exactly ``x``'s bytes.

  A complex number is its real part's bytes, then its imaginary part's.
  """
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    x = jnp.stack([x.real, x.imag], axis=-1)
  return jax.lax.bitcast_convert_type(x, _BYTE).reshape(-1)


def _from_bytes(rows: jax.Array, dtype: Any) -> jax.Array:
  """The inverse of ``_bytes`` for each row of ``(devices, k)`` bytes."""
  dtype = np.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    parts = _from_bytes(rows, np.finfo(dtype).dtype).reshape(*rows.shape[:-1], -1, 2)
    return jax.lax.complex(parts[..., 0], parts[..., 1])
  if dtype.itemsize == 1:
    return jax.lax.bitcast_convert_type(rows, dtype)
  return jax.lax.bitcast_convert_type(rows.reshape(*rows.shape[:-1], -1, dtype.itemsize), dtype)


def _join(pieces: jax.Array, axis: int) -> jax.Array:
  """``(devices, *shard)`` -> the full array, the devices' pieces in order along ``axis``."""
  moved = jnp.moveaxis(pieces, 0, axis)
  shape = list(pieces.shape[1:])
  shape[axis] *= pieces.shape[0]
  return moved.reshape(shape)


def _split(full: jax.Array, axis: int, count: int) -> jax.Array:
  """The inverse of ``_join``, flattened: ``(devices, elements of a shard)``."""
  shape = list(full.shape)
  shape[axis : axis + 1] = [count, shape[axis] // count]
  return jnp.moveaxis(full.reshape(shape), axis, 0).reshape(count, -1)


def _unpad(piece: Piece, full: jax.Array) -> jax.Array:
  if full.shape[piece.axis] == piece.size:
    return full
  return jax.lax.slice_in_dim(full, 0, piece.size, axis=piece.axis)


def _pad(piece: Piece, full: jax.Array, count: int) -> jax.Array:
  padding = piece.shard_shape[piece.axis] * count - full.shape[piece.axis]
  if not padding:
    return full
  widths = [(0, 0)] * full.ndim
  widths[piece.axis] = (0, padding)
  return jnp.pad(full, widths)
