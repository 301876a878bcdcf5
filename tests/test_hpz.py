"""hpZ (``secondary_axis``): full sharding's numbers, with the backward pass's gathers in a node.

Every hpZ run is compared with the same run without hpZ over the same devices
(``axis_name=("node", "data")``, the parameters split over all 8), bit for
bit: hpZ changes where a weight's bytes travel, never what arrives, and the
gradients are reduce-scattered by the same collective. Each compiled step is
then read for where its collectives go: on a ``node=2 x data=4`` mesh, the
all-gathers across nodes happen in the forward pass only, each gathering a
device's secondary partition (a quarter of the layer), and the estimator
predicts those bytes per axis, and the memory the secondary partitions take.
"""

import dataclasses
import functools
import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax
from tests import models, multi_axis_model
from tests.helpers import STAGES, launch_code, rounding
from zerojax import estimate as estimate_cli

AXES = ("node", "data")
STEPS = 2
DOTS = jax.checkpoint_policies.dots_saveable


@dataclasses.dataclass(frozen=True)
class Setup:
  """One way to train the test model, with and without hpZ.

  Attributes:
    path: how the layers open their shards: ``"gather"`` (``zerojax.gather``
      in a ``jax.checkpoint``-ed scan body, ``zerojax.remat_policy``), or
      ``zerojax.scan``'s ``prefetch`` (1 or 0, with the dots saved).
    axis_type: the mesh's axis type.
    options: more options of ``zerojax.zero3``.
    microbatches: of ``zerojax.value_and_grad``.
    model_axis: a ``node=2 x data=2 x model=2`` mesh with the layers split
      Megatron-style over ``model`` (``tests/multi_axis_model.py``), instead of
      ``node=2 x data=4``.
    replica: a ``replica=2 x node=2 x data=2`` mesh, replicated over
      ``replica`` (hybrid sharding), instead of ``node=2 x data=4``.
  """

  path: str | int = "gather"
  axis_type: AxisType = AxisType.Explicit
  options: tuple[tuple[str, str], ...] = ()
  microbatches: int = 1
  model_axis: bool = False
  replica: bool = False


SETUPS = {
  "gather": Setup(),
  "scan, Auto axes, micro-batches, offloaded": Setup(
    path=1, axis_type=AxisType.Auto, microbatches=2, options=(("offload", "optimizer"),)
  ),
  "scan, prefetch=0, bf16, qwZ and qgZ, replicas": Setup(
    path=0,
    replica=True,
    options=(("precision", "bf16"), ("quantized_weights", "int8"), ("quantized_gradients", "int8")),
  ),
  "model axis": Setup(axis_type=AxisType.Auto, model_axis=True),
}


def loss_fn(path):
  """``tests.models``' loss, its layers opened the way ``path`` says."""

  def loss(params, x, y):
    top = zerojax.gather({k: v for k, v in params.items() if k != "layers"})
    layer = lambda h, w: (jnp.tanh(h @ w["w"] + w["b"]), None)
    if path == "gather":
      body = jax.checkpoint(lambda h, w: layer(h, zerojax.gather(w)), policy=zerojax.remat_policy)
      h, _ = jax.lax.scan(body, x @ top["embed"], params["layers"])
    else:
      h, _ = zerojax.scan(layer, x @ top["embed"], params["layers"], prefetch=path, policy=DOTS)
    out = (h @ top["head"]) * top["scale"] + jnp.sum(top["odd"]) * 0.01
    return jnp.mean((out - y) ** 2)

  return loss


def mesh_of(setup: Setup):
  shape, names = (2, 4), AXES
  if setup.model_axis or setup.replica:
    shape = (2, 2, 2)
    names = (*AXES, "model") if setup.model_axis else ("replica", *AXES)
  return jax.make_mesh(shape, names, axis_types=(setup.axis_type,) * len(names))


def _transformation(setup: Setup, hpz: bool):
  """``(mesh, tx, params)`` of ``setup``: the parameters full, placed on ``model`` if any."""
  mesh = mesh_of(setup)
  options = dict(setup.options, secondary_axis="data") if hpz else dict(setup.options)
  if setup.model_axis:
    params, min_shard_size = multi_axis_model.placed_params(mesh), multi_axis_model.MIN_SHARD_SIZE
  else:
    params, min_shard_size = models.make_params(), 16  # the biases and the odd leaf shard too
  if setup.replica:
    options["replica_axis"] = "replica"
  tx = zerojax.zero3(
    optax.adam(1e-2), mesh=mesh, axis_name=AXES, min_shard_size=min_shard_size, **options
  )
  return mesh, tx, params


@functools.cache
def trained(setup: Setup, hpz: bool):
  """``(losses, full parameters, compiled step)`` of ``STEPS`` steps of ``setup``."""
  mesh, tx, params = _transformation(setup, hpz)
  if setup.model_axis:
    loss, batch = multi_axis_model.loss_fn, multi_axis_model.make_batch()
  else:
    loss, batch = loss_fn(setup.path), models.make_batch()
  batch = jax.device_put(batch, NamedSharding(mesh, P(tx.batch_axes)))

  @jax.jit
  def step(params, state, *batch):
    value, grads = zerojax.value_and_grad(loss, tx, microbatches=setup.microbatches)(
      params, *batch, opt_state=state
    )
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  params = tx.shard(params)
  state = tx.init(params)
  compiled = step.lower(params, state, *batch).compile()
  losses = []
  for _ in range(STEPS):
    params, state, value = compiled(params, state, *batch)
    losses.append(value)
  return np.asarray(losses), jax.tree.map(np.asarray, tx.gather(params)), compiled


def by_axes(setup: Setup, hpz: bool) -> dict:
  """``{axes: {kind: (count, bytes)}}`` of the compiled step, for the collectives that move."""
  counted = zerojax.diagnostics.count_collectives_by_axes(trained(setup, hpz)[2], mesh_of(setup))
  return {
    axes: {kind: (c.count, c.bytes) for kind, c in kinds.items() if c.count}
    for axes, kinds in counted.items()
  }


@pytest.mark.parametrize("name", SETUPS)
def test_hpz_computes_what_full_sharding_computes(name):
  setup = SETUPS[name]
  (hpz_losses, hpz_params, _), (losses, params, _) = trained(setup, True), trained(setup, False)
  tolerance = rounding(dict(setup.options).get("precision"))
  chex.assert_trees_all_close(hpz_losses, losses, **tolerance)
  chex.assert_trees_all_close(hpz_params, params, **tolerance)
  assert np.isfinite(losses).all() and losses[-1] < losses[0]


@pytest.mark.parametrize("name", SETUPS)
def test_only_the_forward_pass_gathers_across_nodes(name):
  # Full sharding gathers every weight over ("node", "data"), in both passes. hpZ gathers
  # across nodes only each device's secondary partition, once per forward pass, and whole
  # weights, forward and backward, over "data" alone; the gradients leave over ("node",
  # "data"), as without hpZ.
  # Quantized (qgZ), the gradients leave in two all-to-alls, over "data" then over "node",
  # the same with hpZ as without.
  setup = SETUPS[name]
  hpz, full = by_axes(setup, True), by_axes(setup, False)
  assert "all-gather" not in hpz[AXES] and "all-gather" in full[AXES]
  for axes in (AXES, ("node",), ("data",)):
    for kind in ("reduce-scatter", "all-to-all"):
      assert hpz[axes].get(kind, (0, 0))[1] == full.get(axes, {}).get(kind, (0, 0))[1], kind
  reductions = {"all-to-all"} if dict(setup.options).get("quantized_gradients") else set()
  assert set(hpz[("node",)]) == set(hpz[("data",)]) == {"all-gather", *reductions}
  moved, whole = hpz[("node",)]["all-gather"][1], hpz[("data",)]["all-gather"][1]
  per_node = mesh_of(setup).shape["data"]
  assert moved * per_node <= whole  # each weight's secondary partition, in one pass only
  if not setup.model_axis:  # (where XLA gathers over model first, gathering twice as much)
    once = secondary_bytes(setup)
    # XLA may hoist out of the micro-batch loop the gathers that no micro-batch changes.
    assert once <= moved <= once * setup.microbatches, (moved, once)


def secondary_bytes(setup: Setup) -> int:
  """What one forward pass gathers across nodes: every shard's secondary partition."""
  mesh, tx, params = _transformation(setup, hpz=True)
  nodes = mesh.shape["node"]
  total = 0
  tree = tx.layout(params).tree()
  is_leaf = lambda x: isinstance(x, zerojax.LeafLayout)
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]:
    if leaf.dim is None:
      continue
    split = math.prod(mesh.shape[axis] for entry in leaf.spec for axis in _names(entry))
    layers = leaf.shape[0] if "layers" in jax.tree_util.keystr(path) else 1
    shard = math.prod(leaf.stored_shape) // split // layers  # of one layer, on one device
    itemsize = np.dtype(tx.precision.compute_dtype(leaf.dtype)).itemsize
    quantized = tx.quantized_weights
    total += layers * nodes * (quantized.moved_bytes(shard) if quantized else shard * itemsize)
  return total


def _names(entry) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


LAYERS, WIDTH = 4, 64  # a stack of MLP layers that shard without padding or replicated leaves


def mlp_step(mesh, **options):
  """``(tx, compiled step)`` of the MLP stack under ``zerojax.gather`` and the dots policy."""
  tx = zerojax.zero3(optax.adam(1e-2), mesh=mesh, axis_name=AXES, min_shard_size=16, **options)
  full = {
    "up": jax.ShapeDtypeStruct((LAYERS, WIDTH, 4 * WIDTH), jnp.float32),
    "down": jax.ShapeDtypeStruct((LAYERS, 4 * WIDTH, WIDTH), jnp.float32),
  }
  params = jax.eval_shape(tx.shard, full)
  params = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
    params,
    tx.param_shardings(full),
  )
  state = jax.eval_shape(tx.init, params)
  x = jax.ShapeDtypeStruct((64, WIDTH), jnp.float32, sharding=NamedSharding(mesh, P(AXES)))
  policy = zerojax.except_gathered(DOTS)

  def loss(params, x):
    block = lambda h, w: (h + jax.nn.gelu(h @ w["up"]) @ w["down"], None)
    body = jax.checkpoint(lambda h, w: block(h, zerojax.gather(w)), policy=policy)
    return jnp.mean(jax.lax.scan(body, x, params)[0] ** 2)

  def step(params, state, x):
    value, grads = zerojax.value_and_grad(loss, tx)(params, x)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, x).compile()
  return tx, compiled


def test_the_estimator_predicts_the_bytes_per_axis_and_the_secondary_partitions():
  mesh = jax.make_mesh((2, 4), AXES)
  (_, hpz), (_, plain) = mlp_step(mesh, secondary_axis="data"), mlp_step(mesh)
  num_params = 2 * LAYERS * WIDTH * 4 * WIDTH
  sizes = dict(num_devices=8, stage=3, param_bytes=4, grad_bytes=4)
  estimate = zerojax.estimate_communication(num_params, secondary_devices=4, **sizes)
  counted = zerojax.diagnostics.count_collectives_by_axes(hpz, mesh)
  assert counted[("node",)]["all-gather"].bytes == estimate.weight_gathers
  assert counted[("data",)]["all-gather"].bytes == estimate.secondary_gathers
  assert counted[AXES]["reduce-scatter"].bytes == estimate.gradient_reductions
  # And without hpZ, every gather spans both axes: three times the model, as ZeRO-3 moves.
  estimate = zerojax.estimate_communication(num_params, **sizes)
  counted = zerojax.diagnostics.count_collectives_by_axes(plain, mesh)
  assert counted[AXES]["all-gather"].bytes == estimate.weight_gathers == 2 * num_params * 4
  # Memory: the same arguments (the parameters stored as without hpZ); the step's
  # temporaries hold the secondary partitions on top of those of one all-gather per weight
  # (hpZ's gathers move one collective a weight). Across nodes full sharding packs a layer's
  # weights into one all-gather by default, whose buffer adds at most a layer at the gather.
  _, unpacked = mlp_step(mesh, packed_gathers=False)
  secondary = zerojax.estimate_memory(num_params, secondary_devices=4, **sizes)
  hpz_memory, unpacked_memory = hpz.memory_analysis(), unpacked.memory_analysis()
  assert hpz_memory.argument_size_in_bytes == unpacked_memory.argument_size_in_bytes
  extra = hpz_memory.temp_size_in_bytes - unpacked_memory.temp_size_in_bytes
  assert extra == pytest.approx(secondary.secondary, rel=0.1), (extra, secondary.secondary)
  packing = plain.memory_analysis().temp_size_in_bytes - unpacked_memory.temp_size_in_bytes
  assert 0 <= packing <= num_params * 4 // LAYERS, packing


def test_parameters_are_split_over_every_data_axis_the_secondary_ones_first():
  mesh = jax.make_mesh((2, 4), AXES)
  tx = zerojax.zero3(optax.adam(1e-2), mesh=mesh, axis_name=AXES, secondary_axis="data")
  params = tx.shard({"w": jnp.ones((64, 64))})
  # Device (n, d) holds block 2d + n: a node's secondary partitions are contiguous quarters.
  assert params["w"].sharding.spec == P(None, ("data", "node"))
  assert (tx.secondary_axis, tx.data_axes, tx.batch_axes) == ("data", ("data", "node"), AXES)
  assert params["w"].sharding.shard_shape((64, 64)) == (64, 8)


@pytest.mark.parametrize(
  ("options", "message"),
  [
    (dict(secondary_axis="model"), "'model', which is not one of axis_name ('node', 'data')"),
    (dict(secondary_axis="rack"), "which the mesh does not have"),
    (dict(secondary_axis=("node", "data")), "names every data axis ('node', 'data')"),
    (dict(secondary_axis=("data", "data")), "one or more distinct mesh axes"),
    (dict(secondary_axis=()), "one or more distinct mesh axes"),
    (dict(axis_name="data", secondary_axis="data"), "names every data axis ('data',)"),
    (dict(axis_name="data", replica_axis="node", secondary_axis="node"), "not one of axis_name"),
  ],
)
def test_bad_secondary_axes_are_refused_with_the_fix(options, message):
  mesh = jax.make_mesh((2, 2, 2), (*AXES, "model"))
  options.setdefault("axis_name", AXES)
  with pytest.raises(ValueError, match=re.escape(message)):
    zerojax.zero3(optax.adam(1e-2), mesh=mesh, **options)


@pytest.mark.parametrize("stage", [1, 2])
def test_only_stage_3_takes_a_secondary_axis(stage):
  # Stages 1 and 2 gather no weights, so their factories have no such keyword.
  mesh = jax.make_mesh((2, 4), AXES)
  with pytest.raises(TypeError, match="unexpected keyword argument 'secondary_axis'"):
    STAGES[stage](optax.adam(1e-2), mesh=mesh, axis_name=AXES, secondary_axis="data")


def test_a_secondary_axis_across_processes_is_warned_of_whatever_its_name():
  # Two processes of two CPU devices: axis "a" spans the processes, "b" stays inside each.
  code = (
    "import warnings, jax, optax, zerojax; zerojax.distributed.initialize(); "
    "mesh = jax.make_mesh((2, 2), ('a', 'b')); make = lambda axis: zerojax.zero3("
    "optax.sgd(0.1), mesh=mesh, axis_name=('a', 'b'), secondary_axis=axis); "
    "warnings.simplefilter('error'); make('b')\n"
    "try: make('a')\n"
    "except UserWarning as w: assert 'its devices are in more than one process' in str(w), w\n"
    "else: raise SystemExit('no warning')"
  )
  status, err = launch_code(code, devices_per_process=2)
  assert status == 0, err


def test_the_estimator_refuses_hpz_where_it_cannot_be():
  with pytest.raises(ValueError, match="stage 2 gathers none"):
    zerojax.estimate_memory(1e9, num_devices=8, stage=2, secondary_devices=4)
  for devices in (3, 8, 0):  # not dividing the data axes, or into one node
    with pytest.raises(ValueError, match=f"secondary_devices={devices} must divide num_devices"):
      zerojax.estimate_communication(1e9, num_devices=8, stage=3, secondary_devices=devices)
  with pytest.raises(ValueError, match="with pipeline_stages is not modelled"):
    zerojax.estimate_memory(1e9, num_devices=8, stage=3, secondary_devices=4, pipeline_stages=2)
  flags = ["--params", "1e9", "--devices", "8", "--secondary", "4", "--pipeline-stages", "2"]
  assert "hpZ is not estimated in pipeline stages" in estimate_cli.main(flags)


def test_the_command_line_compares_zero3_with_and_without_hpz():
  def rows(*flags):
    text = estimate_cli.main(
      ["--params", "7.5e9", "--devices", "8", "64", "--secondary", "8", *flags]
    )
    table = text.split("zero3 with hpZ, 8 devices per node")[1].splitlines()
    return {line.split()[0]: line.split()[1:] for line in table if line.strip()[:1].isdigit()}

  # 8 devices are one node: no hpZ. On 64, the secondary partitions (Ψ x 2 B / 8) double
  # what a device holds, and only the forward pass's gather of them and the gradients cross.
  plain = rows()
  assert plain["8"] == ["-"] * 6
  assert plain["64"] == ["1.88", "1.88", "45.00", "0.00", "16.88", "30.00"]
  # int8 (a byte and 4/256 of scale an element): zero3 and hpZ sum the gradients inside the
  # node first (1.016Ψ), and send the node's sums across (1.016Ψ / 8); hpZ's forward gather
  # across is int8 too, its gathers inside the node bf16.
  int8 = 7.5e9 * (1 + 4 / 256)
  quantized = rows("--quantized-weights", "int8", "--quantized-gradients", "int8")
  cells = (2 * int8 + int8 / 8, int8, int8 / 8 + int8 / 8, 2 * 2 * 7.5e9 + int8)
  assert quantized["64"] == ["1.88", "1.88", *(f"{moved / 1e9:.2f}" for moved in cells)]


def test_checkpoints_move_between_full_sharding_and_hpz(tmp_path):
  mesh = jax.make_mesh((2, 4), AXES)
  full = zerojax.zero3(optax.adam(1e-2), mesh=mesh, axis_name=AXES)
  hpz = zerojax.zero3(optax.adam(1e-2), mesh=mesh, axis_name=AXES, secondary_axis="data")
  params = full.shard(models.make_params())
  with zerojax.CheckpointManager(tmp_path, zerojax.train_state_spec(full, params)) as manager:
    manager.save(1, {"params": params, "opt_state": full.init(params)})
  with zerojax.CheckpointManager(tmp_path, zerojax.train_state_spec(hpz, params)) as manager:
    restored = manager.restore()["params"]
  assert restored["layers"]["w"].sharding.spec == P(None, ("data", "node"))
  chex.assert_trees_all_equal(hpz.gather(restored), full.gather(params))
