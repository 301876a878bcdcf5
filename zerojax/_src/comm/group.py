"""The shards one layer opens together, as static facts: each one's ``Transfer``, their ``Group``.

A ``Group`` moves its shards side by side, one collective per shard issued
together (XLA's combiners merge them where that pays): ``all_gather`` for
stage 3's weights, ``read`` for stage 2's replicated copies, ``reduce_scatter``
for every gradient, in buckets of at most ``BUCKET_BYTES`` that go one after
another. How a layer is opened from these is an ``Opening`` (``opening.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from zerojax._src.comm import primitives as comm
from zerojax._src.comm import quantized as quantize
from zerojax._src.sharding import layout as layout_lib

#: The most bytes, in the reduce dtype, that one bucket of a group's gradient reductions moves
#: (a larger gradient is a bucket of its own); the buckets go one after another. Issued at
#: once, XLA:GPU's combiner merged a group's reductions into one collective, and the first
#: layer's with the embedding's and the head's, so each cotangent and its float32 cast stayed
#: alive until the last of them was ready. A layer that reduces less is one bucket, as before.
#: The memory and XLA's estimate of the step, with and without: docs/big_models.md.
BUCKET_BYTES = 256 * 2**20


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
      over from their secondary partitions (``comm/hierarchical.py``); ``()`` without hpZ.
    packed: whether ``all_gather`` moves the shards in one collective per
      dtype; ``None``: on GPUs where ``axis_name`` crosses nodes
      (``comm.spans_nodes``).
    bucket_bytes: the most bytes, in the reduce dtype, that one bucket of
      unquantized gradient reductions moves (``reduce_scatter``).
  """

  transfers: tuple[Transfer, ...]
  axis_name: Any
  replica_axes: tuple[str, ...]
  weights: quantize.Quantization | None
  gradients: quantize.Quantization | None
  secondary_axes: tuple[str, ...] = ()
  packed: bool | None = None
  bucket_bytes: int = BUCKET_BYTES

  def all_gather(self, values: Sequence[jax.Array]) -> list[jax.Array]:
    """The full weights of ``values`` (this device's shards), padding sliced off.

    ``packed`` (by default, on GPUs across nodes: over several data axes of
    more than one device each), the shards move together, in one all-gather per
    dtype, or quantized in one for all their codes and scales
    (``comm.all_gather_together``); else one each (two quantized). No
    derivative rule: ``gather`` gives them one.
    """
    axes = [transfer.axis for transfer in self.transfers]
    dtypes = [transfer.compute for transfer in self.transfers]
    if self.packed is None:
      packed = comm.on_gpu() and comm.spans_nodes(self.axis_name)
    else:
      packed = self.packed
    if packed and len(values) > 1:
      fulls = comm.all_gather_together(values, self.axis_name, axes, dtypes, self.weights)
    else:
      fulls = [
        comm.all_gather(value, self.axis_name, axis, dtype, self.weights)
        for value, axis, dtype in zip(values, axes, dtypes, strict=True)
      ]
    return [
      jax.lax.slice_in_dim(full, 0, transfer.size, axis=transfer.axis)
      for transfer, full in zip(self.transfers, fulls, strict=True)
    ]

  def read(self, values: Sequence[jax.Array]) -> list[jax.Array]:
    """Stage 2's replicated weights as they are, typed as this device's own.

    Varying over the data and replica axes, so that the cotangent reaching the
    backward pass is this device's own, which ``reduce_scatter`` then sums
    (rather than one JAX has already all-reduced).
    """
    axes = (*layout_lib.axes(self.axis_name), *self.replica_axes)
    return [jax.lax.pcast(value, axes, to="varying") for value in values]

  def reduce_scatter(self, cotangents: Sequence[jax.Array]) -> list[jax.Array]:
    """Each device's shard of the sum over devices of ``cotangents`` (full, unpadded).

    Unquantized, the reductions go in buckets (``buckets``), largest first,
    held by optimization barriers: none starts before the last cotangent is
    ready, and each bucket's cotangents wait for the previous bucket's
    result, so that XLA neither merges the buckets nor casts a cotangent to
    the reduce dtype early. Started as each cotangent became ready, the
    reductions held their buffers beside the rest of the backward pass's: the
    70B model's step at 4 layers on 128 H100 needed 6.6 GiB of temporaries,
    4.9 when they wait (GSPMD FSDP's: 4.8). Quantized, the shards' chunks
    move together, and over several data axes the sum is taken inside each
    node first: over the secondary axes under hpZ, else over the last data
    axis (``quantized.hierarchy``).
    """
    if self.gradients is None:
      buckets = self.buckets([cotangent.size for cotangent in cotangents])
    else:
      buckets = [list(range(len(cotangents)))]
    shards: list[Any] = [None] * len(cotangents)
    previous: list[jax.Array] = []
    if len(buckets) > 1:
      cotangents = jax.lax.optimization_barrier(list(cotangents))
    for bucket in buckets:
      pieces = [cotangents[i] for i in bucket]
      if previous:
        pieces, _ = jax.lax.optimization_barrier((pieces, previous))
      previous = self._reduce_scatter_together(bucket, pieces)
      for i, shard in zip(bucket, previous, strict=True):
        shards[i] = shard
    return [
      shard.astype(transfer.grad) for transfer, shard in zip(self.transfers, shards, strict=True)
    ]

  def buckets(self, sizes: Sequence[int]) -> list[list[int]]:
    """The shards' indices in buckets of at most ``bucket_bytes`` reduced, largest first.

    Each shard's gradient (of ``sizes`` elements) joins the last bucket if it
    fits, else starts one.

    Example:
      >>> from zerojax._src.comm.group import Group, Transfer
      >>> transfers = [Transfer(0, 8, (1,), "float32", "float32", "float32")] * 3
      >>> Group(tuple(transfers), "data", (), None, None, bucket_bytes=64).buckets([4, 12, 8])
      [[1], [2, 0]]
    """
    bytes_ = [
      size * jnp.dtype(transfer.reduce).itemsize
      for size, transfer in zip(sizes, self.transfers, strict=True)
    ]
    buckets: list[list[int]] = []
    filled = 0
    for i in sorted(range(len(sizes)), key=lambda i: -bytes_[i]):
      if buckets and filled + bytes_[i] <= self.bucket_bytes:
        buckets[-1].append(i)
        filled += bytes_[i]
      else:
        buckets.append([i])
        filled = bytes_[i]
    return buckets

  def _reduce_scatter_together(
    self, indices: Sequence[int], cotangents: Sequence[jax.Array]
  ) -> list[jax.Array]:
    """The shards, in the reduce dtype, of the ``cotangents`` of ``indices``, issued at once."""
    count = jax.lax.axis_size(self.axis_name)
    transfers = [self.transfers[i] for i in indices]
    padded = [
      layout_lib.pad_to(cotangent.astype(t.reduce), t.axis, t.shard_shape[t.axis] * count)
      for t, cotangent in zip(transfers, cotangents, strict=True)
    ]
    return comm.reduce_scatter_together(
      padded,
      self.axis_name,
      [t.axis for t in transfers],
      self.gradients,
      self.secondary_axes or None,
    )
