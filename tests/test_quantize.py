"""Quantized communication (ZeRO++): error bounds, bytes on the wire, and every stage and mesh.

Error bounds are checked element by element against the block's own scale.
Training steps are checked against the same step unquantized: quantization
changes the numbers (by a bounded amount) and the bytes, nothing else.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax
from tests import multi_axis_model as meshes
from tests.helpers import unpadded
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


def test_options_are_checked():
  mesh = jax.make_mesh((8,), ("data",))
  with pytest.raises(TypeError, match="unexpected keyword argument 'quantized_weights'"):
    zerojax.zero2(optax.sgd(0.1), mesh=mesh, quantized_weights="int8")  # pyright: ignore
  with pytest.raises(ValueError, match=r"quantized_gradients='fp8' is not a format"):
    zerojax.zero1(optax.sgd(0.1), mesh=mesh, quantized_gradients="fp8")
  for bad in (3, -4, 0, "256", 256.0, True):
    with pytest.raises(ValueError, match="quantization_block_size must be a positive even"):
      zerojax.zero3(optax.sgd(0.1), mesh=mesh, quantization_block_size=bad)
  tx = zerojax.zero1(
    optax.sgd(0.1), mesh=mesh, quantized_gradients="int8", quantization_block_size=np.int64(64)
  )
  assert tx.quantized_gradients == quantize.Quantization(8, 64)


# --------------------------------------------------------------------- collectives


def on_devices(fn, x, in_spec=None):
  """``fn`` on each of 8 devices' slice of ``x``; the results stacked along a new first axis."""
  mesh = make_mesh("single")
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


# --------------------------------------------------------------------- training steps

OPTIONS = {
  "int8 gradients": dict(quantized_gradients="int8"),
  "int8 weights": dict(quantized_weights="int8"),
  "int8 both": dict(quantized_weights="int8", quantized_gradients="int8"),
  "int4 both": dict(quantized_weights="int4", quantized_gradients="int4"),
}
# Relative L2 error of the gradient, against the same step unquantized. Measured
# on hybrid sharding (gradients quantized twice: inside the data group, then
# across replicas): 0.012-0.018 with 8 bits, 0.23-0.34 with 4 (half a level of
# 4 bits is 1/14 of a block's largest magnitude).
# The loss moves only with quantized weights: 0.2% with 8 bits, 2% with 4.
TOLERANCE = {"int8": 0.025, "int4": 0.4}
LOSS_TOLERANCE = {"int8": 0.01, "int4": 0.05}


def make_mesh(name):
  """test_meshes' meshes, and "single": 8 devices on one data axis."""
  if name == "single":
    return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  return meshes.make_mesh(name)


def grad_step(tx, microbatches=1):
  return jax.jit(zerojax.value_and_grad(meshes.loss_fn, tx, microbatches=microbatches))


def train_step(tx):
  @jax.jit
  def step(params, state, x, y):
    _, grads = zerojax.value_and_grad(meshes.loss_fn, tx)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


@functools.cache
def gradients(mesh_name, stage, option, microbatches=1, precision=None):
  """(loss, full gradients on the host, tx) of one step on test_meshes' model."""
  mesh = make_mesh(mesh_name)
  tx = meshes.make_tx(stage, mesh, precision=precision, **OPTIONS.get(option, {}))
  params = tx.shard(meshes.placed_params(mesh))
  state = tx.init(meshes.placed_params(mesh)) if precision else None
  step = grad_step(tx, microbatches)
  loss, grads = step(params, *meshes.batch_on(mesh), opt_state=state)
  return float(loss), jax.tree.map(np.asarray, tx.gather(grads)), tx


def relative_error(grads, reference):
  a, b = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)]) for t in (grads, reference))
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


CASES = [(1, "int8 gradients"), (2, "int8 gradients")] + [(3, o) for o in OPTIONS]


@pytest.mark.parametrize("stage,option", CASES)
def test_every_stage_is_close_to_its_unquantized_step(stage, option):
  loss, grads, _ = gradients("hsdp", stage, option)
  loss0, grads0, _ = gradients("hsdp", stage, None)
  error = relative_error(grads, grads0)
  bits = option.split()[0]
  assert 0 < error < TOLERANCE[bits], error
  assert abs(loss - loss0) < LOSS_TOLERANCE[bits] * abs(loss0)


@pytest.mark.parametrize("stage", [1, 3])
def test_complex_leaves_move_unquantized(stage):
  # A block's codes and scale are real: quantizing a complex leaf would drop
  # its imaginary part, so complex leaves keep the exact collectives.
  mesh = make_mesh("single")
  rng = np.random.default_rng(5)
  z = jnp.asarray(rng.normal(size=(4, 64)) + 1j * rng.normal(size=(4, 64)), jnp.complex64)
  x = jnp.asarray(rng.normal(size=(8, 4)), jnp.complex64)
  loss_fn = lambda p, x: jnp.mean(jnp.abs(x @ zerojax.gather(p)["z"]) ** 2)
  both = dict(quantized_gradients="int8", **({"quantized_weights": "int8"} if stage == 3 else {}))
  grads = []
  for options in ({}, both):
    tx = getattr(zerojax, f"zero{stage}")(optax.sgd(0.1), mesh=mesh, min_shard_size=1, **options)
    _, g = jax.jit(zerojax.value_and_grad(loss_fn, tx))(tx.shard({"z": z}), x)
    grads.append(tx.gather(g)["z"])
  np.testing.assert_array_equal(grads[1], grads[0])
  np.testing.assert_allclose(grads[0], jax.grad(loss_fn)({"z": z}, x)["z"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mesh_name", ["tensor", "both"])
def test_tensor_parallel_meshes_quantize_too(mesh_name):
  _, grads, _ = gradients(mesh_name, 3, "int8 both")
  _, grads0, _ = gradients(mesh_name, 3, None)
  assert 0 < relative_error(grads, grads0) < TOLERANCE["int8"]


@pytest.mark.parametrize("stage", [2, 3])
def test_accumulation_and_mixed_precision_compose(stage):
  for microbatches, precision in ((2, None), (1, "bf16")):
    _, grads, _ = gradients("hsdp", stage, "int8 gradients", microbatches, precision)
    _, grads0, _ = gradients("hsdp", stage, None, microbatches, precision)
    assert 0 < relative_error(grads, grads0) < TOLERANCE["int8"]


def collective_bytes(mesh_name, stage, option):
  mesh = make_mesh(mesh_name)
  tx = meshes.make_tx(stage, mesh, **OPTIONS.get(option, {}))
  params = tx.shard(meshes.placed_params(mesh))
  compiled = grad_step(tx).lower(params, *meshes.batch_on(mesh)).compile()
  return zerojax.diagnostics.count_collectives(compiled), compiled, tx


def test_stage3_moves_at_most_030x_the_fp32_bytes():
  # Read from the compiled HLO of a stage-3 step over scanned, rematerialized
  # layers, loop trip counts multiplied out (8 shards, one axis).
  model_bytes = sum(x.nbytes for x in jax.tree.leaves(meshes.make_params()))
  plain = collective_bytes("single", 3, None)[0]
  both = collective_bytes("single", 3, "int8 both")[0]
  weights_only = collective_bytes("single", 3, "int8 weights")[0]
  assert plain["all-gather"].bytes >= 1.9 * model_bytes  # forward, and again in backward
  assert weights_only["all-gather"].bytes <= 0.30 * plain["all-gather"].bytes
  assert both["reduce-scatter"].bytes == 0
  assert both["all-to-all"].bytes <= 0.30 * plain["reduce-scatter"].bytes
  total = lambda counts: sum(c.bytes for c in counts.values())
  assert total(both) <= 0.30 * total(plain)
  assert total(both) <= 0.30 * 3 * model_bytes


def test_hybrid_sharding_quantizes_the_cross_replica_reduction():
  _, compiled, tx = collective_bytes("hsdp", 3, "int8 both")
  by_axes = zerojax.diagnostics.count_collectives_by_axes(compiled, tx.mesh)
  across = {kind: c.bytes for kind, c in by_axes[("replica",)].items() if c.bytes}
  shard_bytes = sum(x.nbytes for x in jax.tree.leaves(meshes.make_params())) / tx.num_shards
  # An all-to-all and an all-gather of int8 codes, each about a quarter of the shard.
  assert set(across) <= {"all-to-all", "all-gather", "all-reduce"}, across
  assert sum(across.values()) <= 0.6 * shard_bytes
  assert not any(
    c.bytes > shard_bytes
    for axes, kinds in by_axes.items()
    if "replica" in axes
    for c in kinds.values()
  )


def test_checkpoints_hold_no_quantization_state(tmp_path):
  # A run trained with quantization resumes without it (and back): the state
  # is the same pytree, stored the same way.
  mesh = make_mesh("hsdp")
  quantized = meshes.make_tx(3, mesh, **OPTIONS["int8 both"])
  plain = meshes.make_tx(3, mesh)
  placed = meshes.placed_params(mesh)
  params, opt_state = train_step(quantized)(
    quantized.shard(placed), quantized.init(placed), *meshes.batch_on(mesh)
  )
  state = {"params": params, "opt_state": opt_state}
  spec = lambda tx: zerojax.train_state_spec(tx, placed)
  with zerojax.CheckpointManager(tmp_path, spec(quantized)) as manager:
    manager.save(1, state, force=True)
  with zerojax.CheckpointManager(tmp_path, spec(plain)) as manager:
    restored = manager.restore()
  chex.assert_trees_all_equal(
    unpadded(restored, spec(plain).logical), unpadded(state, spec(quantized).logical), strict=True
  )


def test_the_drop_in_path_is_unchanged_by_quantization():
  # Quantization applies to the collectives value_and_grad places; a drop-in
  # step's are the compiler's, so it computes what it computed before.
  mesh = make_mesh("single")
  placed = meshes.placed_params(mesh)
  batch = jax.device_put(meshes.make_batch(), NamedSharding(mesh, P("data")))

  def drop_in_grads(tx):
    loss = lambda p, x, y: meshes.loss_fn(tx.unpad(p), x, y)
    return jax.tree.map(np.asarray, jax.jit(jax.grad(loss))(tx.shard(placed), *batch))

  plain, quantized = (meshes.make_tx(3, mesh, **o) for o in ({}, OPTIONS["int8 both"]))
  chex.assert_trees_all_equal(drop_in_grads(quantized), drop_in_grads(plain), strict=True)
