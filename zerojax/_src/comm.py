"""The collectives inside ``jax.shard_map``: on one array, and on the shards a layer opens together.

Every array moves in a collective of its own: an all-gather of a layer's
weights is one ``all_gather`` per leaf, issued together, and its transpose one
``psum_scatter`` per leaf. XLA's all-gather and reduce-scatter combiners (on
GPU and TPU) merge the collectives of one step into a variadic collective of
several operands when that pays, without copying a byte; packing the leaves
into one buffer by hand would copy every weight twice per use, and on TPU,
where a bitcast to bytes is emulated, cost temporaries several times a layer's
size (docs/performance.md has the measurements).

Each collective casts on the way: a weight to the compute dtype before its
all-gather (so a bfloat16 policy moves half the bytes), a gradient to the
reduce dtype before its reduce-scatter. With quantization
(``quantized_weights``, ``quantized_gradients``) a weight's all-gather moves
its block-quantized codes and their scales (two collectives), and a
reduce-scatter becomes an all-to-all of quantized chunks that each device sums
in float32 (see ``quantize.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from zerojax._src import layout as layout_lib
from zerojax._src import quantize

# ---------------------------------------------------------------------------
# One array.
# ---------------------------------------------------------------------------


def as_bits(x: jax.Array) -> jax.Array:
  """``x``'s bits as unsigned integers of the same width, for moving it unchanged.

  A collective on the bits moves exactly ``x``'s bytes: XLA cannot widen it
  (XLA:CPU runs bfloat16 collectives in float32) or move a preceding
  narrowing cast past it. The bitcast keeps the element count, so it costs
  nothing on any platform.
  """
  return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


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
  move instead and are dequantized to ``dtype`` on arrival.
  """
  if quantization is not None and _is_real(x):
    return quantize.all_gather(x, axis_name, axis, quantization, dtype)
  if x.dtype == dtype:
    return jax.lax.all_gather(x, axis_name, axis=axis, tiled=True)
  bits = as_bits(x.astype(dtype))
  return from_bits(jax.lax.all_gather(bits, axis_name, axis=axis, tiled=True), dtype)


def reduce_scatter(
  x: jax.Array, axis_name: Any, axis: int, quantization: quantize.Quantization | None = None
) -> jax.Array:
  """A tiled ``psum_scatter`` along ``axis``; with ``quantization``, ZeRO++'s quantized one.

  The quantized reduction sums in float32 (or ``x``'s dtype, if wider).
  """
  if quantization is None or not _is_real(x):
    return jax.lax.psum_scatter(x, axis_name, scatter_dimension=axis, tiled=True)
  return quantize.reduce_scatter(x, axis_name, axis, quantization, _summed_in(x))


def all_reduce(
  x: jax.Array, axis_name: Any, quantization: quantize.Quantization | None = None
) -> jax.Array:
  """A ``psum``; with ``quantization``, a quantized reduce-scatter and all-gather."""
  if quantization is None or not _is_real(x):
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


# ---------------------------------------------------------------------------
# The shards one layer opens together.
# ---------------------------------------------------------------------------


class Transfer(NamedTuple):
  """How one shard moves, as static facts.

  Attributes:
    axis: the sharded dimension of the full array (non-negative).
    size: its logical (unpadded) size in the full array.
    shard_shape: the shape of one device's piece (of the gradient, at stage 2).
    compute: the dtype the full weight is returned in.
    reduce: the dtype its gradient is reduced in.
    grad: the dtype its gradient is returned in.
  """

  axis: int
  size: int
  shard_shape: tuple[int, ...]
  compute: Any
  reduce: Any
  grad: Any


class Group(NamedTuple):
  """Shards opened together, over one data axis (static, hashable).

  Attributes:
    transfers: one ``Transfer`` per shard.
    axis_name: the data axis (or tuple of axes).
    replica_axes: the other axes the batch is split over (hybrid sharding):
      stage 2's weights are typed as varying over them too.
    weights: the ``Quantization`` of the weight all-gathers, or ``None``.
    gradients: the ``Quantization`` of the gradient reductions, or ``None``.
    secondary_axes: hpZ: the intra-node data axes the weights are gathered
      over from their secondary partitions (``hpz.py``); ``()`` without hpZ.
  """

  transfers: tuple[Transfer, ...]
  axis_name: Any
  replica_axes: tuple[str, ...]
  weights: quantize.Quantization | None
  gradients: quantize.Quantization | None
  secondary_axes: tuple[str, ...] = ()

  def all_gather(self, values: Sequence[jax.Array]) -> list[jax.Array]:
    """The full weights of ``values`` (this device's shards), padding sliced off.

    No derivative rule: ``gather`` gives them one.
    """
    fulls = []
    for transfer, value in zip(self.transfers, values, strict=True):
      full = all_gather(value, self.axis_name, transfer.axis, transfer.compute, self.weights)
      fulls.append(jax.lax.slice_in_dim(full, 0, transfer.size, axis=transfer.axis))
    return fulls

  def read(self, values: Sequence[jax.Array]) -> list[jax.Array]:
    """Stage 2's replicated weights as they are, typed as this device's own.

    Varying over the data and replica axes, so that the cotangent reaching the
    backward pass is this device's own, which ``reduce_scatter`` then sums
    (rather than one JAX has already all-reduced).
    """
    axes = (*layout_lib.axes(self.axis_name), *self.replica_axes)
    return [jax.lax.pcast(value, axes, to="varying") for value in values]

  def reduce_scatter(self, cotangents: Sequence[jax.Array]) -> list[jax.Array]:
    """Each device's shard of the sum over devices of ``cotangents`` (full, unpadded)."""
    count = jax.lax.axis_size(self.axis_name)
    shards = []
    for transfer, cotangent in zip(self.transfers, cotangents, strict=True):
      size = transfer.shard_shape[transfer.axis] * count
      padded = layout_lib.pad_to(cotangent.astype(transfer.reduce), transfer.axis, size)
      shard = reduce_scatter(padded, self.axis_name, transfer.axis, self.gradients)
      shards.append(shard.astype(transfer.grad))
    return shards


def gather(group: Group, values: Sequence[jax.Array]) -> list[jax.Array]:
  """Stage 3's opening of shards: full weights in the compute dtype, padding sliced off.

  Its backward pass (``jax.grad`` through this function) is
  ``group.reduce_scatter``.
  """
  return list(_gather(group, tuple(values)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gather(group: Group, values: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
  return tuple(group.all_gather(values))


def _gather_fwd(group, values):
  return _gather(group, values), None


def _gather_bwd(group, residuals, cotangents):
  del residuals
  return (tuple(group.reduce_scatter(cotangents)),)


_gather.defvjp(_gather_fwd, _gather_bwd)


def read(group: Group, values: Sequence[jax.Array], sinks: Sequence[jax.Array]) -> list[Any]:
  """Stage 2's opening: the replicated weights as they are; their gradients go to ``sinks``.

  ``sinks`` are zero arrays of the gradient shards' shapes, differentiated in
  the weights' place: the backward pass reduce-scatters each weight's
  cotangent into its sink. Under hpZ (stage 3) ``values`` are the secondary
  partitions, the weights are gathered from them inside the node
  (``hpz.fulls``), and the sinks are the shards themselves.
  """
  return list(_read(group, tuple(values), tuple(sinks)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _read(group: Group, values, sinks):
  del sinks
  if group.secondary_axes:
    from zerojax._src import hpz  # (which builds on this module)

    return tuple(hpz.fulls(group, values))
  return tuple(group.read(values))


def _read_fwd(group, values, sinks):
  return _read(group, values, sinks), None


def _read_bwd(group, residuals, cotangents):
  del residuals
  # None: zero cotangents of the values' own types. Explicit zeros would lack
  # their varying axes (the stage axis, inside zerojax.pipeline's stages).
  return tuple(None for _ in cotangents), tuple(group.reduce_scatter(cotangents))


_read.defvjp(_read_fwd, _read_bwd)
