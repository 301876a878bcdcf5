"""Multi-axis meshes: hybrid sharding (replica x data) and tensor parallelism (data x model).

The model is ``tests/multi_axis_model.py``'s Megatron-style scanned MLP stack.
Exactness is measured against plain single-device optax, with the error plain
GSPMD makes on the same mesh as the yardstick: Adam turns the last bits of
rounding in the reductions' order into visible differences for parameters whose
gradients are tiny.
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
from tests.helpers import arrays, assert_placed, unpadded
from tests.multi_axis_model import (
  MESHES,
  MIN_SHARD_SIZE,
  WIDTH,
  batch_on,
  loss_fn,
  make_batch,
  make_mesh,
  make_params,
  make_tx,
  optimizer,
  placed_params,
)

STEPS = 2


def max_error(tree, reference) -> float:
  return max(
    float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(reference), strict=True)
  )


@functools.cache
def single_device():
  """STEPS steps of plain optax on one device."""
  params, batch = jax.device_put((make_params(), make_batch()), jax.devices()[0])
  opt = optimizer()
  state = opt.init(params)
  step = jax.jit(lambda p, s: _plain_step(opt, p, s, batch))
  for _ in range(STEPS):
    params, state = step(params, state)
  return params


def _plain_step(opt, params, state, batch):
  updates, state = opt.update(jax.grad(loss_fn)(params, *batch), state, params)
  return optax.apply_updates(params, updates), state


@functools.cache
def gspmd_error(mesh_name: str) -> float:
  """How far plain GSPMD (no zerojax) lands from one device, on the same mesh."""
  mesh = make_mesh(mesh_name)
  params, batch, opt = placed_params(mesh), batch_on(mesh), optimizer()
  state = opt.init(params)
  step = jax.jit(lambda p, s: _plain_step(opt, p, s, batch))
  for _ in range(STEPS):
    params, state = step(params, state)
  return max_error(params, single_device())


@functools.cache
def trained(mesh_name: str, stage: int, path: str):
  """(full parameters after STEPS steps, stored parameters, state, tx)."""
  mesh = make_mesh(mesh_name)
  tx = make_tx(stage, mesh)
  placed = placed_params(mesh)
  state = tx.init(placed)
  params = tx.shard(placed)
  batch = batch_on(mesh)

  def step(params, state, x, y):
    if path == "explicit":
      _, grads = zerojax.value_and_grad(loss_fn, tx)(params, x, y)
    else:
      grads = jax.grad(lambda p, x, y: loss_fn(tx.unpad(p), x, y))(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(step)
  for _ in range(STEPS):
    params, state = step(params, state, *batch)
  return tx.gather(params), params, state, tx


# Every stage on both paths, but for the drop-in path at stage 2: given whole gradients, stage
# 2 stores what stage 1 stores, and its step compiles to stage 1's program.
PATHS_AND_STAGES = [*(("explicit", stage) for stage in (1, 2, 3)), ("drop-in", 1), ("drop-in", 3)]


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("path, stage", PATHS_AND_STAGES)
def test_matches_single_device_within_gspmd_error(mesh_name, stage, path):
  full = trained(mesh_name, stage, path)[0]
  assert max_error(full, single_device()) <= 1.5 * gspmd_error(mesh_name) + 1e-6


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_stage3_splits_every_leaf_over_the_data_axes_and_keeps_tensor_parallelism(mesh_name):
  _, params, state, tx = trained(mesh_name, 3, "explicit")
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    names = {n for entry in x.sharding.spec if entry for n in np.atleast_1d(entry)}
    assert "data" in names, jax.tree_util.keystr(path)
    assert "replica" not in names
  if "model" in tx.mesh.axis_names:
    layers = params["layers"]
    assert layers["w1"].sharding.spec == P(None, "data", "model")
    assert layers["w2"].sharding.spec == P(None, "model", "data")
    # The bias's only non-leading dimension is on `model`: the data axis joins it.
    assert layers["b"].sharding.spec == P(None, ("model", "data"))
    # Adam's moments mirror the parameters, tensor-parallel axis included.
    mu = state.inner_state[0].mu["layers"]
    assert jax.tree.map(lambda m: m.sharding.spec, mu) == jax.tree.map(
      lambda p: p.sharding.spec, arrays(layers)
    )


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_persistent_bytes_follow_the_formula(mesh_name, stage):
  # N is the data-axes size under hybrid sharding, data x model under tensor
  # parallelism (every leaf of this model but the head and the odd leaf is on
  # `model` too); Adam keeps two fp32 moments, K = 8.
  _, params, state, tx = trained(mesh_name, stage, "explicit")
  mesh = tx.mesh
  per_device = lambda tree: sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))
  model = mesh.shape.get("model", 1)
  full = make_params()
  split = lambda leaf, n: leaf.nbytes / n
  tensor_parallel = lambda path, leaf: path[0].key == "layers"

  def bytes_for(tree_divisor):
    return sum(
      split(leaf, tree_divisor * (model if tensor_parallel(path, leaf) else 1))
      for path, leaf in jax.tree_util.tree_flatten_with_path(full)[0]
    )

  n = tx.num_shards
  params_ideal = bytes_for(n if stage == 3 else 1)
  state_ideal = 2 * bytes_for(n)
  assert per_device(params) == pytest.approx(params_ideal, rel=0.10)
  assert per_device(state.inner_state) == pytest.approx(state_ideal, rel=0.10)


def test_tx_reports_its_axes():
  tx = make_tx(3, make_mesh("both"))
  assert (tx.data_axes, tx.replica_axes, tx.batch_axes) == (
    ("data",),
    ("replica",),
    ("replica", "data"),
  )
  assert (tx.num_shards, tx.num_replicas) == (2, 2)


def test_data_axes_may_be_a_tuple_of_axes():
  # Sharding over both axes of an (x, y) mesh is sharding over 8.
  mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
  tx = zerojax.zero3(optimizer(), mesh=mesh, axis_name=("x", "y"), min_shard_size=MIN_SHARD_SIZE)
  params = tx.shard(make_params())
  assert params["layers"]["w1"].sharding.spec == P(None, ("x", "y"))
  state = tx.init(params)
  batch = jax.device_put(make_batch(), NamedSharding(mesh, P(("x", "y"))))
  _, grads = jax.jit(zerojax.value_and_grad(loss_fn, tx))(params, *batch)
  updates, _ = tx.update(grads, state, params)
  reference = jax.grad(loss_fn)(make_params(), *make_batch())
  np.testing.assert_allclose(tx.gather(grads)["odd"], reference["odd"], rtol=1e-5, atol=1e-6)
  assert updates["head"].sharding.spec == params["head"].sharding.spec


class TestErrors:
  def test_replica_axis_equal_to_axis_name(self):
    with pytest.raises(ValueError, match="must name different axes"):
      zerojax.zero2(optimizer(), mesh=make_mesh("hsdp"), axis_name="data", replica_axis="data")

  def test_axis_not_in_the_mesh(self):
    with pytest.raises(ValueError, match=r"mesh has no axis 'replicas'.*replica_axis="):
      zerojax.zero2(optimizer(), mesh=make_mesh("hsdp"), replica_axis="replicas")

  def test_batch_must_divide_by_replicas_times_data(self):
    mesh = make_mesh("hsdp")
    tx = make_tx(2, mesh)
    params = tx.shard(make_params())
    x, y = jnp.ones((12, WIDTH)), jnp.ones((12, 13))
    with pytest.raises(ValueError, match=r"must divide by the 8 devices .*2 replicas x 4 shards"):
      zerojax.value_and_grad(loss_fn, tx)(params, x, y)

  def test_params_placed_on_a_replica_axis(self):
    mesh = make_mesh("hsdp")
    tx = make_tx(3, mesh)
    params = make_params()
    params["head"] = jax.device_put(params["head"], NamedSharding(mesh, P("replica")))
    with pytest.raises(ValueError, match="placed on the replica axes \\['replica'\\]"):
      tx.shard(params)

  def test_data_axis_where_the_stage_cannot_keep_it(self):
    # Placed on the data axis along another dimension than the plan's: an
    # error that says how to choose it, not a silent move.
    mesh = make_mesh("tensor")
    tx = make_tx(3, mesh)
    params = make_params()
    params["layers"]["w1"] = jax.device_put(
      params["layers"]["w1"], NamedSharding(mesh, P(None, None, "data"))
    )
    with pytest.raises(ValueError, match=r"on dimension 2 .* layout shards dimension 1"):
      tx.shard(params)


def test_estimator_takes_replicas_and_tensor_parallelism():
  # Replicas add devices, not bytes per device; tensor parallelism divides them.
  plain = zerojax.estimate_memory(7.5e9, num_devices=8, stage=3)
  both = zerojax.estimate_memory(7.5e9, num_devices=8, stage=3, replicas=2, tensor_parallel=4)
  assert both.total == pytest.approx(plain.total / 4)
  from zerojax.estimate import main

  text = main(["--params", "7.5e9", "--devices", "8", "--replicas", "2", "--tensor-parallel", "4"])
  assert "       8       64" in text


def test_checkpoints_move_between_mesh_shapes(tmp_path):
  # (2, 4) hybrid -> (8,) -> (4, 2) tensor parallel, bit for bit in the
  # logical values; the last hop also changes the stage.
  _, params, opt_state, tx = trained("hsdp", 3, "explicit")
  state = {"params": params, "opt_state": opt_state, "step": jnp.int32(STEPS)}
  spec = state_spec(tx)
  expected = unpadded(state, spec.logical)
  flat = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  for hop, (mesh, stage) in enumerate([(flat, 3), (make_mesh("tensor"), 2)]):
    with zerojax.CheckpointManager(tmp_path / str(hop), spec) as checkpoints:
      checkpoints.save(STEPS, state)
    spec = state_spec(make_tx(stage, mesh))
    with zerojax.CheckpointManager(tmp_path / str(hop), spec) as checkpoints:
      state = checkpoints.restore()
    assert_placed(state, spec)
    chex.assert_trees_all_equal(unpadded(state, spec.logical), expected, strict=True)
  # Restored onto the tensor-parallel mesh, the weights are on `model` again.
  assert state["params"]["layers"]["w1"].sharding.spec == P(None, None, "model")


def state_spec(tx):
  """The training state's spec on ``tx``'s mesh, parameters placed as that mesh places them."""
  structs = jax.tree.map(
    lambda p, x: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=x.sharding),
    make_params(),
    placed_params(tx.mesh),
  )
  return zerojax.train_state_spec(tx, structs, step=jnp.int32(0))


@pytest.mark.parametrize("reduce", ["fp32", "fp16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hybrid_sharding_sends_only_the_gradient_shard_across_replicas(stage, reduce):
  # Read from the compiled step: gathers and reduce-scatters stay inside the
  # data groups; what crosses replicas is one all-reduce of the gradient
  # shard (plus the loss and a few replicated scalars), Ψ/N, not the model,
  # and in the reduce dtype like the reduce-scatter: half of it in fp16.
  # (fp16 rather than bf16: XLA:CPU widens some bf16 collectives to fp32.)
  mesh = make_mesh("hsdp")
  tx = make_tx(stage, mesh, precision=zerojax.Precision(reduce=reduce))
  params = tx.shard(make_params())
  state = tx.init(params)

  def step(params, state, x, y):
    _, grads = zerojax.value_and_grad(loss_fn, tx)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  compiled = jax.jit(step).lower(params, state, *batch_on(mesh)).compile()
  by_axes = zerojax.diagnostics.count_collectives_by_axes(compiled, mesh)
  model_bytes = sum(x.nbytes for x in jax.tree.leaves(make_params()))
  across = {axes: kinds for axes, kinds in by_axes.items() if "replica" in axes}
  moved = {
    (axes, kind): c.bytes for axes, kinds in across.items() for kind, c in kinds.items() if c.bytes
  }
  assert set(kind for _, kind in moved) <= {"all-reduce"}, moved
  width = np.dtype(tx.precision.reduce_dtype(np.float32)).itemsize / 4
  assert sum(moved.values()) <= 1.15 * width * model_bytes / tx.num_shards
  inside = sum(c.bytes for c in by_axes[("data",)].values())
  assert inside >= model_bytes  # the model's gathers and reduce-scatters: inside the groups
