"""zerojax.pipeline: stages over a mesh axis, ZeRO inside each stage, against one device.

The model: an embedding, LAYERS residual MLP layers (Megatron-style on a
``model`` axis when the mesh has one) split into pipeline stages, and a head,
trained with SGD and momentum. Stage parameters are stacked ``(stages, layers per stage,
...)`` and placed on the ``stage`` axis; everything else is replicated over it.
Every run trains STEPS steps and must land where plain optax on one device
lands with the same layers stacked ``(layers, ...)``.
"""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax
import zerojax.flax.linen
import zerojax.flax.nnx
from tests.helpers import ROUNDING

LAYERS, WIDTH, HIDDEN, BATCH, MICROBATCHES, STEPS = 8, 16, 32, 16, 4, 20
MESHES = {
  "stage=2,data=4": ((2, 4), ("stage", "data")),
  "stage=2,data=2,model=2": ((2, 2, 2), ("stage", "data", "model")),
  "stage=4,data=2": ((4, 2), ("stage", "data")),
}
TENSOR_PARALLEL = {"w1": P(None, None, "model"), "b": P(None, "model"), "w2": P(None, "model")}


def make_params() -> dict:
  """The model's parameters, the layers stacked ``(LAYERS, ...)`` as one device runs them."""
  rng = np.random.default_rng(0)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[-2]), jnp.float32)
  return {
    "embed": normal(12, WIDTH),
    "layers": {
      "w1": normal(LAYERS, WIDTH, HIDDEN),
      "b": jnp.asarray(rng.normal(size=(LAYERS, HIDDEN)) * 0.1, jnp.float32),
      "w2": normal(LAYERS, HIDDEN, WIDTH) * 0.5,
    },
    "head": normal(WIDTH, 8),
  }


def make_batch():
  rng = np.random.default_rng(1)
  return (
    jnp.asarray(rng.normal(size=(BATCH, 12)), jnp.float32),
    jnp.asarray(rng.normal(size=(BATCH, 8)), jnp.float32),
  )


def layer(h, w):
  return h + jnp.tanh(h @ w["w1"] + w["b"]) @ w["w2"], None


def head_loss(head, h, y):
  return jnp.mean((h @ zerojax.gather(head) - y) ** 2)


def reference_loss(params, x, y):
  h, _ = jax.lax.scan(layer, x @ params["embed"], params["layers"])
  return head_loss(params["head"], h, y)


def optimizer():
  # Not Adam: its updates do not change when every gradient is scaled by the same factor.
  return optax.sgd(0.05, momentum=0.9)


def staged(params, stages: int) -> dict:
  """The layers restacked ``(stages, layers per stage, ...)``."""
  layers = jax.tree.map(lambda a: a.reshape(stages, -1, *a.shape[1:]), params["layers"])
  return {**params, "layers": layers}


def unstaged(params) -> dict:
  layers = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), params["layers"])
  return {**params, "layers": layers}


@functools.cache
def reference(precision: str) -> dict:
  """STEPS steps of plain optax on one device; bf16: mixed precision by hand (fp32 master)."""
  params, batch = jax.device_put((make_params(), make_batch()), jax.devices()[0])
  opt = optimizer()
  state = opt.init(params)
  compute = jnp.bfloat16 if precision == "bf16" else jnp.float32

  @jax.jit
  def step(params, state):
    low = jax.tree.map(lambda p: p.astype(compute), params)
    batch_low = jax.tree.map(lambda b: b.astype(compute), batch)
    grads = jax.grad(lambda p: reference_loss(p, *batch_low).astype(jnp.float32))(low)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for _ in range(STEPS):
    params, state = step(params, state)
  return params


def make_mesh(name: str, kind: AxisType):
  shape, names = MESHES[name]
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(names))


def placed_params(mesh) -> dict:
  """The parameters on ``mesh``: the layers on ``stage`` (and ``model``), the rest replicated."""
  params = staged(make_params(), mesh.shape["stage"])
  tensor = "model" in mesh.axis_names

  def place(path, leaf):
    if path[0].key != "layers":
      return jax.device_put(leaf, NamedSharding(mesh, P()))
    spec = TENSOR_PARALLEL[path[-1].key] if tensor else P()
    return jax.device_put(leaf, NamedSharding(mesh, P("stage", *spec)))

  return jax.tree_util.tree_map_with_path(place, params)


def pipelined_loss(schedule: str, reduce: str, microbatches: int = MICROBATCHES):
  """The loss as the model runs it: embedding, the pipeline, the head."""

  def stage_fn(w, h):
    return zerojax.scan(layer, h, w)[0]

  def loss(params, x, y):
    h = x @ zerojax.gather(params["embed"])
    options = dict(microbatches=microbatches, schedule=schedule.removesuffix("+head"))
    options["reduce"] = reduce
    if schedule == "gpipe":  # the head after the pipeline
      h = zerojax.pipeline(stage_fn, params["layers"], h, **options)
      return head_loss(params["head"], h, y)
    return zerojax.pipeline(
      stage_fn,
      params["layers"],
      h,
      loss_fn=head_loss,
      loss_params=params["head"],
      targets=(y,),
      **options,
    )

  return loss


@functools.cache
def trained(mesh_name, kind, stage, precision, path, schedule, reduce):
  """(full parameters after STEPS steps, the transformation, stored parameters and state)."""
  mesh = make_mesh(mesh_name, kind)
  tx = getattr(zerojax, f"zero{stage}")(
    optimizer(), mesh=mesh, min_shard_size=1, precision=precision
  )
  loss = pipelined_loss(schedule, reduce)
  x, y = jax.device_put(make_batch(), NamedSharding(mesh, P("data")))

  def step(params, state, x, y):
    if path == "explicit":
      _, grads = zerojax.value_and_grad(loss, tx)(params, x, y)
    else:
      grads = jax.grad(lambda p: loss(tx.unpad(p), x, y))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  with jax.set_mesh(mesh):
    placed = placed_params(mesh)
    state = tx.init(placed)
    params = tx.shard(placed)
    compiled = jax.jit(step).lower(params, state, x, y).compile()
    for _ in range(STEPS):
      params, state = compiled(params, state, x, y)
    return unstaged(tx.gather(tx.master_params(params, state))), tx, params, state


EXPLICIT, AUTO = AxisType.Explicit, AxisType.Auto
# (mesh, axis types, ZeRO stage, precision, path, schedule, reduce): every pair of values of any
# two of them in some case (each mesh with every stage, both precisions and, where JAX allows
# them, both axis types; each stage with every schedule and both paths; ...), in 16 cases where
# all combinations would be 360. The stage x data x model mesh is Auto only: zerojax's tensor
# parallelism wants the model axis Auto, and JAX refuses explicit data axes beside an auto model
# axis. Drop-in (plain jax.grad) runs on stage=2 x data=4, stage 3 on Auto axes (docs/guide.md).
# The schedules: gpipe with the head after the pipeline, "gpipe+head" with it inside, 1f1b.
CASES = [
  ("stage=2,data=4", EXPLICIT, 1, "fp32", "drop-in", "1f1b", "step"),
  ("stage=2,data=4", EXPLICIT, 2, "fp32", "drop-in", "gpipe", "step"),
  ("stage=2,data=4", EXPLICIT, 3, "fp32", "explicit", "1f1b", "step"),
  ("stage=2,data=4", EXPLICIT, 3, "bf16", "explicit", "gpipe+head", "microbatch"),
  ("stage=2,data=4", AUTO, 1, "fp32", "drop-in", "gpipe+head", "step"),
  ("stage=2,data=4", AUTO, 3, "fp32", "drop-in", "gpipe", "step"),
  ("stage=2,data=4", AUTO, 3, "bf16", "explicit", "gpipe", "microbatch"),
  ("stage=2,data=2,model=2", AUTO, 1, "fp32", "explicit", "gpipe", "step"),
  ("stage=2,data=2,model=2", AUTO, 1, "bf16", "explicit", "1f1b", "microbatch"),
  ("stage=2,data=2,model=2", AUTO, 2, "fp32", "explicit", "gpipe+head", "microbatch"),
  ("stage=2,data=2,model=2", AUTO, 2, "bf16", "explicit", "1f1b", "step"),
  ("stage=2,data=2,model=2", AUTO, 3, "bf16", "explicit", "gpipe", "step"),
  ("stage=4,data=2", EXPLICIT, 2, "bf16", "explicit", "gpipe", "step"),
  ("stage=4,data=2", AUTO, 1, "bf16", "explicit", "1f1b", "step"),
  ("stage=4,data=2", AUTO, 2, "fp32", "explicit", "gpipe+head", "microbatch"),
  ("stage=4,data=2", AUTO, 3, "bf16", "explicit", "gpipe", "step"),
]


def _id(case):
  mesh, kind, stage, precision, path, schedule, reduce = case
  return f"{mesh}-{kind.name.lower()}-zero{stage}-{precision}-{path}-{schedule}-{reduce}"


@pytest.mark.parametrize("case", CASES, ids=map(_id, CASES))
def test_trains_like_one_device(case):
  # fp32: the suite's tolerance for numbers that must not change (measured: 2e-7 at most);
  # bf16: within 5% of each leaf's movement, as mixed precision by hand (measured: 1.5%).
  full, precision = trained(*case)[0], case[3]
  if precision == "fp32":
    chex.assert_trees_all_close(full, reference("fp32"), **ROUNDING)
  else:
    for a, e, i in zip(
      *map(jax.tree.leaves, (full, reference("bf16"), make_params())), strict=True
    ):
      moved = float(np.max(np.abs(np.asarray(e) - np.asarray(i))))
      chex.assert_trees_all_close(a, e, rtol=0, atol=0.05 * moved)


@pytest.mark.parametrize(
  "kind, schedule, reduce", [(EXPLICIT, "1f1b", "microbatch"), (AUTO, "gpipe", "step")]
)
def test_hpz_inside_pipeline_stages_trains_like_one_device(kind, schedule, reduce):
  # ZeRO++'s hpZ in each stage: layers sharded over node x data, the backward gathers from
  # the copy split over data only; the numbers stay plain optax's.
  mesh = jax.make_mesh((2, 2, 2), ("stage", "node", "data"), axis_types=(kind,) * 3)
  tx = zerojax.zero3(
    optimizer(), mesh=mesh, axis_name=("node", "data"), secondary_axis="data", min_shard_size=1
  )
  loss = pipelined_loss(schedule, reduce)
  x, y = jax.device_put(make_batch(), NamedSharding(mesh, P(("node", "data"))))

  @jax.jit
  def step(params, state):
    _, grads = zerojax.value_and_grad(loss, tx)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  with jax.set_mesh(mesh):
    placed = placed_params(mesh)
    params, state = tx.shard(placed), tx.init(placed)
    for _ in range(STEPS):
      params, state = step(params, state)
    full = unstaged(tx.gather(params))
  chex.assert_trees_all_close(full, reference("fp32"), **ROUNDING)


def compiled_step(stage, schedule, reduce, microbatches, rows=BATCH):
  """The compiled explicit-path step on stage=2 x data=4 (explicit axes), not run."""
  mesh = make_mesh("stage=2,data=4", EXPLICIT)
  tx = getattr(zerojax, f"zero{stage}")(optimizer(), mesh=mesh, min_shard_size=1)
  loss = pipelined_loss(schedule, reduce, microbatches)
  batch = [jax.ShapeDtypeStruct((rows, *b.shape[1:]), b.dtype) for b in make_batch()]
  x, y = [
    jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=NamedSharding(mesh, P("data"))) for b in batch
  ]

  def step(params, state, x, y):
    _, grads = zerojax.value_and_grad(loss, tx)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  with jax.set_mesh(mesh):
    placed = placed_params(mesh)
    params, state = tx.shard(placed), jax.eval_shape(tx.init, placed)
    return jax.jit(step).lower(params, state, x, y).compile()


def test_reduce_step_reduce_scatters_stage_gradients_once_per_step():
  # Stage 3: with reduce="step" the count of reduce-scatters does not grow with the
  # micro-batches; with "microbatch" each micro-batch's backward pass reduces its layers.
  count = lambda *args: (
    zerojax.diagnostics.count_collectives(compiled_step(3, *args))["reduce-scatter"].count
  )
  once = count("1f1b", "step", 2)
  assert count("1f1b", "step", 4) == once
  per_microbatch = count("1f1b", "microbatch", 4)
  layers_per_stage = LAYERS // 2
  assert per_microbatch >= once + (4 - 1) * layers_per_stage


def test_1f1b_holds_fewer_micro_batches_than_gpipe():
  # The same micro-batch size, twice the micro-batches: GPipe keeps every micro-batch's
  # activations until its backward pass, 1F1B at most 2S - 1 = 3 of them here.
  temporaries = lambda schedule, m: (
    compiled_step(3, schedule, "step", m, rows=4 * 2 * m).memory_analysis().temp_size_in_bytes
  )
  gpipe = temporaries("gpipe+head", 8) - temporaries("gpipe+head", 4)
  one_f_one_b = temporaries("1f1b", 8) - temporaries("1f1b", 4)
  assert gpipe > 0
  assert one_f_one_b < 0.25 * gpipe


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages, microbatches", [(2, 4), (4, 8), (4, 2)])
def test_timetable_bubble_and_micro_batches_held(schedule, stages, microbatches):
  t = zerojax.pipeline_timetable(schedule, stages=stages, microbatches=microbatches)
  assert t.bubble() == pytest.approx((stages - 1) / (microbatches + stages - 1))
  held = microbatches if schedule == "gpipe" else min(2 * stages - 1, microbatches)
  assert t.in_flight == held
  # Every micro-batch runs forward and backward once on every stage, in order.
  for table in (t.forward, t.backward):
    assert sorted(table[table >= 0].tolist()) == sorted(list(range(microbatches)) * stages)
  for m in range(microbatches):
    forward = [int(np.argwhere(t.forward[:, s] == m)[0, 0]) for s in range(stages)]
    backward = [int(np.argwhere(t.backward[:, s] == m)[0, 0]) for s in range(stages)]
    assert np.all(np.diff(forward) >= 1) and np.all(np.diff(backward) <= -1)
    assert backward[-1] >= forward[-1]


def test_layout_keeps_the_stage_and_layer_dimensions_whole():
  mesh = make_mesh("stage=2,data=4", AUTO)
  tx = zerojax.zero3(optimizer(), mesh=mesh)
  w = jax.device_put(jnp.ones((2, 4, 64, 64)), NamedSharding(mesh, P("stage")))
  assert tx.layout({"w": w}).tree()["w"].spec == ("stage", None, "data", None)


class _Block(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    return h + jnp.tanh(nn.Dense(HIDDEN)(h)) @ self.param(
      "out", nn.initializers.lecun_normal(), (HIDDEN, WIDTH)
    ), None


class _Head(nn.Module):
  @nn.compact
  def __call__(self):
    return self.param("kernel", nn.initializers.lecun_normal(), (WIDTH, 8))


class _LinenModel(nn.Module):
  pipelined: bool

  @nn.compact
  def __call__(self, x, y):
    h = zerojax.flax.linen.gathered(nn.Dense)(WIDTH, name="embed")(x)
    head = zerojax.flax.linen.gathered(_Head)(name="head")()
    if not self.pipelined:
      h, _ = zerojax.flax.linen.scan(_Block, length=LAYERS)(name="layers")(h, None)
      return jnp.mean((h @ head - y) ** 2)
    layers = zerojax.flax.linen.pipeline(
      _Block, length=LAYERS, microbatches=MICROBATCHES, schedule="1f1b", reduce="microbatch"
    )(name="layers")
    loss_fn = lambda kernel, h, y: jnp.mean((h @ kernel - y) ** 2)
    return layers(h, loss_fn=loss_fn, loss_params=head, targets=(y,))


def _on_stages(tree, mesh):
  """``tree`` placed on ``mesh``: stacked layers on the stage axis, the rest replicated."""
  place = lambda path, x: jax.device_put(
    x, NamedSharding(mesh, P("stage") if path[0].key == "layers" else P())
  )
  return jax.tree_util.tree_map_with_path(place, tree)


def test_linen_pipeline_computes_the_scanned_model_s_loss_and_gradients():
  # zero3, 1f1b with the head inside, the shards handed to each stage's zerojax.scan.
  x, y = make_batch()
  params = _LinenModel(False).init(jax.random.key(0), x, y)["params"]
  loss_fn = lambda params, x, y, pipelined: _LinenModel(pipelined).apply({"params": params}, x, y)
  expected = jax.jit(jax.value_and_grad(loss_fn), static_argnums=3)(params, x, y, False)
  mesh = make_mesh("stage=2,data=4", EXPLICIT)
  tx = zerojax.zero3(optimizer(), mesh=mesh, min_shard_size=1)
  with jax.set_mesh(mesh):
    stored = tx.shard(_on_stages(params, mesh))
    batch = jax.device_put((x, y), NamedSharding(mesh, P("data")))
    grad_fn = zerojax.value_and_grad(lambda p, x, y: loss_fn(p, x, y, True), tx)
    loss, grads = jax.jit(grad_fn)(stored, *batch)
  assert float(loss) == pytest.approx(float(expected[0]), rel=1e-6)
  chex.assert_trees_all_close(tx.gather(grads), expected[1], **ROUNDING)


def test_nnx_pipeline_computes_the_stack_s_loss_and_gradients():
  # zero2 on Auto axes, GPipe with the head after the pipeline, under
  # zerojax.flax.nnx.value_and_grad.
  class Model(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Linear(12, WIDTH, rngs=rngs)
      self.layers = nnx.vmap(lambda r: nnx.Linear(WIDTH, WIDTH, rngs=r))(rngs.split(LAYERS))
      self.head = nnx.Linear(WIDTH, 8, rngs=rngs)

    def __call__(self, x, pipelined):
      h = zerojax.flax.nnx.gathered(self.embed)(x)
      step = lambda layer, h: jnp.tanh(layer(h))
      if pipelined:
        h = zerojax.flax.nnx.pipeline(step, self.layers, h, microbatches=MICROBATCHES)
      else:
        h = zerojax.flax.nnx.scan(lambda layer, h, _: (step(layer, h), None), self.layers, h)[0]
      return zerojax.flax.nnx.gathered(self.head)(h)

  def loss_fn(model, x, y, pipelined=False):
    return jnp.mean((model(x, pipelined) - y) ** 2)

  x, y = make_batch()
  model = Model(nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  expected_loss, expected = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), x, y))(
    params
  )
  mesh = make_mesh("stage=2,data=4", AUTO)
  tx = zerojax.zero2(optimizer(), mesh=mesh, min_shard_size=1)
  with jax.set_mesh(mesh):
    nnx.update(model, tx.shard(_on_stages(nnx.state(model, nnx.Param), mesh)))
    batch = jax.device_put((x, y), NamedSharding(mesh, P("data")))
    grad_fn = zerojax.flax.nnx.value_and_grad(
      lambda m, x, y: loss_fn(m, x, y, pipelined=True), tx, gather=False
    )
    loss, grads = nnx.jit(grad_fn)(model, *batch)
  assert float(loss) == pytest.approx(float(expected_loss), rel=1e-6)
  chex.assert_trees_all_close(
    jax.tree.leaves(tx.gather(grads)), jax.tree.leaves(expected), **ROUNDING
  )


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_device_stores_a_stage_s_share_as_the_estimator_says(stage):
  # The estimate counts every parameter as a pipelined layer's; the embedding and the head,
  # replicated over the stages, are 4% of this model. SGD with momentum: K = 4 bytes.
  case = next(c for c in CASES if c[:3] == ("stage=2,data=4", EXPLICIT, stage))
  _, _, params, state = trained(*case)  # the exactness test's run
  per_device = lambda tree: sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))
  count = sum(x.size for x in jax.tree.leaves(make_params()))
  estimate = zerojax.estimate_memory(
    count,
    num_devices=4,
    stage=stage,
    pipeline_stages=2,
    param_bytes=4,
    grad_bytes=4,
    state_bytes=4,
  )
  assert per_device(params) == pytest.approx(estimate.params, rel=0.10)
  assert per_device(state.inner_state) == pytest.approx(estimate.optimizer_state, rel=0.10)
