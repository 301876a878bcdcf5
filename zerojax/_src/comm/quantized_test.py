"""Block-wise quantization (ZeRO++'s qwZ and qgZ) alone: error bounds element by element
against the block's own scale, and the quantized collectives on 8 devices.

Through training steps, on every stage and mesh: tests/test_quantize.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from zerojax._src.comm import quantized as quantize

INT8, INT4 = quantize.Quantization(8, 256), quantize.Quantization(4, 256)


#: The largest code of each width, from the format's definition (levels -qmax..qmax).
QMAX = {8: 127, 4: 7}


def half_level(x, spec, batch_dims=0):
  """Each element's largest allowed error, computed from the input alone.

  The flattened array (each of its first ``batch_dims`` rows apart) is cut into
  blocks of ``spec.block_size`` elements, or one block of its own even-rounded
  size when smaller; an element may be off by its block's largest magnitude
  over ``2 * qmax``, plus two float32 roundings of a value that large (the
  level's and the product's).
  """
  x = np.asarray(x, np.float64)
  flat = x.reshape(*x.shape[:batch_dims], -1)
  size = flat.shape[-1]
  block = min(spec.block_size, size + size % 2)
  padded = np.pad(flat, [(0, 0)] * batch_dims + [(0, -size % block)])
  blockmax = np.max(np.abs(padded.reshape(*flat.shape[:-1], -1, block)), axis=-1)
  bound = blockmax / (2 * QMAX[spec.bits]) + blockmax * 2.0**-22
  return np.repeat(bound, block, axis=-1)[..., :size].reshape(x.shape)


def round_trip(x, spec, dtype=jnp.float32):
  blocks = quantize.quantize(x, spec)
  back = np.asarray(quantize.dequantize(blocks, spec, x.shape, dtype), np.float64)
  return blocks, back.reshape(-1)


@pytest.mark.parametrize("spec", [INT8, INT4, quantize.Quantization(8, 64)], ids=str)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("shape", [(1,), (255,), (256,), (3, 337)])
def test_round_trip_is_within_half_a_level_of_every_element(spec, dtype, shape):
  x = jnp.asarray(np.random.default_rng(0).normal(size=shape) * 3, dtype)
  blocks, back = round_trip(x, spec)
  exact = np.asarray(x, np.float64).reshape(-1)
  assert blocks.codes.dtype == (jnp.uint8 if spec.bits == 4 else jnp.int8)
  assert blocks.codes.nbytes + blocks.scales.nbytes == spec.moved_bytes(x.size)
  assert blocks.scales.dtype == jnp.float32
  # The bound comes from the input, not from the scales under test.
  assert np.all(np.abs(back - exact) <= half_level(exact, spec))
  # Dequantized to the input's dtype, only that dtype's rounding is added: the
  # float32 result, rounded to nearest.
  narrow = quantize.dequantize(blocks, spec, x.shape, dtype)
  assert narrow.dtype == dtype and narrow.shape == x.shape
  rounded = np.asarray(back.astype(np.float32).astype(dtype)).reshape(x.shape)
  np.testing.assert_array_equal(np.asarray(narrow).view(np.uint8), rounded.view(np.uint8))


def test_blocks_of_zeros_come_back_as_zeros():
  blocks, back = round_trip(jnp.zeros(300), INT8)
  assert np.all(back == 0) and np.all(np.asarray(blocks.scales) == 0)


def test_an_outlier_coarsens_only_its_own_block():
  x = np.random.default_rng(1).normal(size=1024).astype(np.float32)
  x[300] = 1e6  # in the second block
  _, back = round_trip(jnp.asarray(x), INT8)
  error = np.abs(back - x)
  assert error[300] == 0  # the block's largest magnitude is exact
  assert np.all(error[256:512] <= 1e6 / 127 / 2 * 1.00001)
  others = np.r_[0:256, 512:1024]
  assert np.all(error[others] <= half_level(np.delete(x, np.r_[256:512]), INT8))
  assert np.max(error[others]) < 0.02


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_a_non_finite_element_makes_its_block_non_finite_and_no_other(bad):
  x = np.ones(600, np.float32)
  x[10] = bad
  _, back = round_trip(jnp.asarray(x), INT8)
  assert np.all(np.isnan(back[:256]))
  assert np.all(back[256:] == 1.0)


def test_int4_codes_pack_two_to_a_byte_and_cover_every_level():
  x = jnp.arange(-7.0, 8.0)  # the 15 levels of a block whose scale is 7
  blocks, back = round_trip(x, quantize.Quantization(4, 16))
  assert blocks.codes.shape == (1, 8)
  np.testing.assert_array_equal(back, np.asarray(x))


# --------------------------------------------------------------------- collectives


def on_devices(fn, x, in_spec=None):
  """``fn`` on each of 8 devices' slice of ``x``; the results stacked along a new first axis."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  in_spec = P("data") if in_spec is None else in_spec
  per_device = lambda s: fn(s)[None]
  return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=in_spec, out_specs=P("data")))(x)


def test_quantized_all_gather_moves_each_devices_own_round_trip():
  x = jnp.asarray(np.random.default_rng(2).normal(size=(50, 8 * 3)), jnp.float32)
  gather = lambda s: quantize.all_gather(s, "data", 1, INT8, jnp.float32)
  gathered = on_devices(gather, x, P(None, "data"))  # each device gathers axis 1
  # Every device holds the same array: each device's piece as it quantized it
  # (to float32's rounding of the dequantizing product, which XLA may fuse).
  pieces = [round_trip(piece, INT8)[1].reshape(piece.shape) for piece in np.split(x, 8, axis=1)]
  # Each piece within half a level of its own blocks, from the input alone.
  bound = np.concatenate([half_level(piece, INT8) for piece in np.split(x, 8, axis=1)], axis=1)
  for device in np.asarray(gathered):
    np.testing.assert_array_equal(device, gathered[0])
    np.testing.assert_allclose(device, np.concatenate(pieces, axis=1), rtol=1e-6)
    assert np.all(np.abs(device - np.asarray(x, np.float64)) <= bound)


@pytest.mark.parametrize("spec", [INT8, INT4], ids=str)
def test_quantized_reduce_scatter_is_a_sum_within_one_half_level_per_device(spec):
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(8, 16, 40)), jnp.float32)  # one (16, 40) array per device
  scatter = lambda s: quantize.reduce_scatter(s[0], "data", 0, spec, jnp.float32)
  summed = np.concatenate(np.asarray(on_devices(scatter, x)))  # device i: rows 2i, 2i + 1
  exact = np.sum(np.asarray(x, np.float64), axis=0)
  # Each device's chunk is quantized once, by its sender: the errors add up.
  # A sender's (16, 40) array is 8 chunks of 80 elements, one per receiver,
  # each one block (80 < 256): the bound is the sum of their half levels.
  chunks = np.asarray(x, np.float64).reshape(8, 8, 80)  # (sender, receiver, chunk)
  bound = np.sum(half_level(chunks, spec, batch_dims=2), axis=0).reshape(16, 40)
  assert np.all(np.abs(summed - exact) <= bound * (1 + 1e-4))


# ------------------------------------------------------------- hierarchical (two rounds)

NODES, PER_NODE = 2, 4


def on_nodes(fn, x, axis_name):
  """``fn`` on each device of a node=2 x data=4 mesh, device ``(n, d)`` given ``x[4n + d]``.

  The results come back in the order of ``axis_name``'s devices, so that row
  ``i`` is what device ``i`` of a reduction over ``axis_name`` owns.
  """
  mesh = jax.make_mesh((NODES, PER_NODE), ("node", "data"), axis_types=(AxisType.Auto,) * 2)
  per_device = lambda s: fn(s[0])[None]
  mapped = jax.shard_map(
    per_device, mesh=mesh, in_specs=P(("node", "data")), out_specs=P(axis_name)
  )
  return np.asarray(jax.jit(mapped)(x))


def two_round_bound(x, spec):
  """Each element's largest allowed error after the two rounds, from the input alone.

  ``x[4n + d]`` is device ``(n, d)``'s array, cut along axis 0 into 8
  chunks, one per owner. Round 1: each device sends each chunk, quantized on
  its own, to the device of its node that has the owner's ``data``
  coordinate: off by half a level of the chunk's block, for each of the 8
  senders (as in one round). Round 2: that device sends its node's sum of the
  chunk, quantized on its own again, to the owner: off by half a level of
  that sum's block, whose largest magnitude is at most the exact sum's plus
  the first round's error, for each of the 2 nodes.
  """
  chunks = np.asarray(x, np.float64).reshape(NODES, PER_NODE, 8, -1)  # (node, data, chunk, .)
  first = half_level(chunks, spec, batch_dims=3)  # each sender's chunk
  node_first = np.sum(first, axis=1)  # (node, chunk, .)
  partial = np.sum(chunks, axis=1)  # each node's exact sum of each chunk
  second = half_level(np.abs(partial) + node_first, spec, batch_dims=2)
  return np.sum(node_first + second, axis=0)  # (chunk, .)


@pytest.mark.parametrize("spec", [INT8, INT4], ids=str)
@pytest.mark.parametrize("axis_name", [("node", "data"), ("data", "node")], ids=str)
def test_hierarchical_reduce_scatter_is_a_sum_within_two_rounds_of_half_levels(spec, axis_name):
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.normal(size=(8, 16, 40)) * rng.uniform(0.1, 10, size=(8, 1, 1)), jnp.float32)
  inner = ("data",) if axis_name[0] == "data" else None  # hpZ's order names its inner axis
  scatter = lambda s: quantize.reduce_scatter(s, axis_name, 0, spec, jnp.float32, inner)
  summed = on_nodes(scatter, x, axis_name).reshape(8, -1)  # row c: chunk c, summed
  exact = np.sum(np.asarray(x, np.float64), axis=0).reshape(8, -1)
  bound = two_round_bound(x, spec)
  assert np.all(np.abs(summed - exact) <= bound * (1 + 1e-4))


def test_hierarchical_reduce_scatter_sends_a_nodes_share_across_nodes():
  mesh = jax.make_mesh((NODES, PER_NODE), ("node", "data"))
  spec = P(("node", "data"))
  x = jax.ShapeDtypeStruct((8 * 64, 1024), jnp.float32, sharding=jax.NamedSharding(mesh, spec))
  scatter = lambda s: quantize.reduce_scatter(s, ("node", "data"), 0, INT8, jnp.float32)
  mapped = jax.shard_map(scatter, mesh=mesh, in_specs=spec, out_specs=spec)
  compiled = jax.jit(mapped).lower(x).compile()
  moved = zerojax_counts(compiled, mesh)
  local = INT8.moved_bytes(64 * 1024)  # one device's array, quantized
  # Inside the node, all of it (its chunks for the node's 4 devices); across, a quarter.
  assert moved[("data",)] == local
  assert moved[("node",)] == local // PER_NODE
  assert ("node", "data") not in moved


def zerojax_counts(compiled, mesh):
  from zerojax._src.diagnostics import hlo

  counted = hlo.count_collectives_by_axes(compiled, mesh)
  return {axes: kinds["all-to-all"].bytes for axes, kinds in counted.items()}


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_a_non_finite_element_survives_both_rounds(bad):
  x = np.ones((8, 16, 40), np.float32)
  x[5, 3, 7] = bad  # sender (1, 1); row 3 is in chunk 1, owned by device (0, 1)
  scatter = lambda s: quantize.reduce_scatter(s, ("node", "data"), 0, INT8, jnp.float32)
  summed = on_nodes(scatter, x, ("node", "data")).reshape(NODES, PER_NODE, -1)
  assert np.isnan(summed[0, 1]).any()
  # Each chunk is its own block in both rounds: every other device's sum is finite.
  assert np.isfinite(np.delete(summed.reshape(8, -1), 1, axis=0)).all()


def test_codes_and_scales_moved_apart_give_the_same_sums(monkeypatch):
  # TPUs move each array's codes and scales in all-to-alls of their own, other platforms as
  # one buffer of bytes: the same blocks arrive either way, so the same sums.
  x = jnp.asarray(np.random.default_rng(6).normal(size=(8, 16, 40)), jnp.float32)

  def both(s):
    sums = quantize.reduce_scatter_together(
      [s, s[:8] * 3], ("node", "data"), [0, 0], INT4, [jnp.float32] * 2
    )
    return jnp.concatenate([summed.ravel() for summed in sums])

  together = on_nodes(both, x, ("node", "data"))
  monkeypatch.setattr(quantize, "_exchanged_together", quantize._exchanged_apart)
  apart = on_nodes(both, x, ("node", "data"))
  np.testing.assert_array_equal(apart, together)
