"""Quantized communication (ZeRO++): its options, bytes on the wire, and every stage and mesh.

The quantization's own error bounds (element by element against the block's
own scale) and its collectives: zerojax/_src/comm/quantized_test.py. Training
steps are checked against the same step unquantized: quantization changes the
numbers (by a bounded amount) and the bytes, nothing else.
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
  assert tx.quantized_gradients == zerojax.Quantization(8, 64)


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
