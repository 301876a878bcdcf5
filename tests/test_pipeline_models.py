"""zerojax.pipeline on a model test_pipeline.py does not train, wherever the head and loss sit.

The model: an input projection, residual SiLU layers with biases (tensor-parallel on a
``model`` axis when the mesh has one), and a softmax cross-entropy head over 11 classes, whose
kernel stage 3 pads (11 columns do not divide over the data devices). Each test takes one
gradient (or a few) and compares it with ``jax.value_and_grad`` of the same layers scanned on
one device: wrapping changes memory, never numbers.
"""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax
import zerojax.flax.linen
from tests.helpers import ROUNDING, STAGES

LAYERS, WIDTH, CLASSES, BATCH = 4, 48, 11, 16
EXPLICIT, AUTO = AxisType.Explicit, AxisType.Auto
#: The layers' placement on a mesh with a ``model`` axis (their output columns split).
TENSOR_PARALLEL = {"w": P(None, None, "model"), "b": P(None, "model")}


def make_params(layers: int = LAYERS) -> dict:
  """The parameters, the layers stacked ``(layers, ...)`` as one device scans them."""
  rng = np.random.default_rng(3)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[-2]), jnp.float32)
  return {
    "embed": normal(12, WIDTH),
    "layers": {"w": normal(layers, WIDTH, WIDTH), "b": normal(layers, 1, WIDTH)[:, 0] * 0.1},
    "head": normal(WIDTH, CLASSES),
  }


def make_batch(rows: int = BATCH):
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.normal(size=(rows, 12)), jnp.float32)
  return x, jnp.asarray(rng.integers(0, CLASSES, size=(rows,)), jnp.int32)


def layer(h, w):
  return h + jax.nn.silu(h @ w["w"] + w["b"]), None


def head_loss(head, h, labels):
  logits = h @ zerojax.gather(head)
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def stage_fn(layers, h):
  return zerojax.scan(layer, h, layers)[0]


def flat_loss(params, x, labels):
  h, _ = jax.lax.scan(layer, x @ params["embed"], params["layers"])
  return head_loss(params["head"], h, labels)


def through_pipeline(stage, layers, h, head, head_params, labels, schedule: str, **options):
  """``head(head_params, stages(h), labels)``: the head after the pipeline ("gpipe") or in it."""
  if schedule == "gpipe":
    return head(head_params, zerojax.pipeline(stage, layers, h, **options), labels)
  return zerojax.pipeline(
    stage,
    layers,
    h,
    schedule=schedule,
    loss_fn=head,
    loss_params=head_params,
    targets=(labels,),
    **options,
  )


def pipelined_loss(schedule: str, microbatches: int = 2, head=head_loss, **options):
  """The loss through ``zerojax.pipeline``: the head after it (``"gpipe"``) or inside it."""

  def loss(params, x, labels):
    h = x @ zerojax.gather(params["embed"])
    return through_pipeline(
      stage_fn,
      params["layers"],
      h,
      head,
      params["head"],
      labels,
      schedule,
      microbatches=microbatches,
      **options,
    )

  return loss


@functools.cache
def expected(layers: int = LAYERS) -> tuple[float, dict]:
  """The loss and gradients of one device, on the whole batch."""
  params, batch = jax.device_put((make_params(layers), make_batch()), jax.devices()[0])
  return jax.jit(jax.value_and_grad(flat_loss))(params, *batch)


def make_mesh(shape: tuple[int, ...], kind: AxisType):
  names = ("stage", "data", "model")[: len(shape)]
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(names))


def placed(mesh, layers: int = LAYERS, virtual_stages: int = 1) -> dict:
  """The parameters on ``mesh``: the layers on ``stage`` (and ``model``), the rest replicated.

  With virtual stages, stage ``s`` holds chunks ``s, S + s, ...`` of the layers, in turn.
  """
  params = make_params(layers)
  stages = mesh.shape["stage"]
  tensor = "model" in mesh.axis_names

  def place(path, leaf):
    if path[0].key != "layers":
      return jax.device_put(leaf, NamedSharding(mesh, P()))
    leaf = chunked(leaf, stages, virtual_stages)
    spec = TENSOR_PARALLEL[path[-1].key] if tensor else P()
    return jax.device_put(leaf, NamedSharding(mesh, P("stage", *spec)))

  return jax.tree_util.tree_map_with_path(place, params)


def chunked(layers, stages: int, virtual_stages: int = 1):
  """A stack ``(layers, ...)`` as ``(stages, layers // stages, ...)``, each stage its chunks."""
  v, shape = virtual_stages, layers.shape[1:]
  return layers.reshape(v, stages, -1, *shape).swapaxes(0, 1).reshape(stages, -1, *shape)


def unstaged(grads, virtual_stages: int = 1) -> dict:
  """The inverse of ``chunked``, on the host."""

  def unstage(a):
    a = np.asarray(a)
    v, stages = virtual_stages, a.shape[0]
    return a.reshape(stages, v, -1, *a.shape[2:]).swapaxes(0, 1).reshape(-1, *a.shape[2:])

  return {**grads, "layers": jax.tree.map(unstage, grads["layers"])}


def assert_matches_one_device(loss, grads, scale: float = 1.0, virtual_stages: int = 1):
  """``scale`` times one device's loss and gradients, of as many layers as ``grads`` has."""
  grads = unstaged(grads, virtual_stages)
  want_loss, want = expected(grads["layers"]["w"].shape[0])
  assert float(loss) == pytest.approx(scale * float(want_loss), rel=1e-5)
  chex.assert_trees_all_close(grads, jax.tree.map(lambda g: scale * g, want), **ROUNDING)


@pytest.mark.parametrize(
  "shape, kind, stage, schedule",
  [
    # Layers tensor-parallel on model, the head gathered after the pipeline: the gathered head
    # came back with a row of the wrong values (CPU ordering links, zerojax/_src/comm/ordering.py).
    ((2, 2, 2), AUTO, 3, "gpipe"),
    ((2, 2, 2), AUTO, 2, "1f1b"),
    ((2, 4), EXPLICIT, 3, "gpipe"),
  ],
)
def test_explicit_path_matches_one_device_wherever_the_head_is(shape, kind, stage, schedule):
  mesh = make_mesh(shape, kind)
  tx = STAGES[stage](optax.sgd(0.1), mesh=mesh, min_shard_size=256)
  with jax.set_mesh(mesh):
    params = tx.shard(placed(mesh))
    assert stage < 3 or params["head"].shape[-1] > CLASSES  # 11 classes padded over the data
    batch = jax.device_put(make_batch(), NamedSharding(mesh, P("data")))
    loss, grads = jax.jit(zerojax.value_and_grad(pipelined_loss(schedule), tx))(params, *batch)
    grads = tx.gather(grads)
  assert_matches_one_device(loss, grads)


def test_loss_scale_and_a_scaled_loss_reach_the_gradients_of_the_loss_inside():
  # The loss inside the pipeline runs its backward pass with a cotangent of 1, and scales the
  # gradients by the cotangent that arrives afterwards: here 3 (the loss is 3 x the pipeline's)
  # times the loss scale 8, which value_and_grad divides back out.
  mesh = make_mesh((2, 4), EXPLICIT)
  precision = zerojax.Precision(loss_scale=8.0)
  tx = zerojax.zero2(optax.sgd(0.1), mesh=mesh, min_shard_size=256, precision=precision)
  loss = pipelined_loss("1f1b")
  tripled = lambda params, x, labels: 3 * loss(params, x, labels)
  with jax.set_mesh(mesh):
    params = tx.shard(placed(mesh))
    state = tx.init(params)
    batch = jax.device_put(make_batch(), NamedSharding(mesh, P("data")))
    value, grads = jax.jit(zerojax.value_and_grad(tripled, tx))(params, *batch, opt_state=state)
    grads = tx.gather(grads)
  assert_matches_one_device(value, grads, scale=3.0)


def reduce_scatters(stage: int, microbatches: int) -> int:
  """Reduce-scatters per step of the 1F1B step at ``stage``'s default ``reduce=`` (unoptimised)."""
  mesh = make_mesh((2, 4), AUTO)
  tx = STAGES[stage](optax.sgd(0.1), mesh=mesh, min_shard_size=1)
  loss = pipelined_loss("1f1b", microbatches)
  with jax.set_mesh(mesh):
    params = tx.shard(placed(mesh))
    batch = jax.device_put(make_batch(), NamedSharding(mesh, P("data")))
    lowered = jax.jit(zerojax.value_and_grad(loss, tx)).lower(params, *batch)
  counts = zerojax.diagnostics.count_collectives(lowered.as_text(dialect="hlo"))
  return counts["reduce-scatter"].count


def test_default_reduce_is_once_per_step_at_stage_2_and_per_micro_batch_at_stage_3():
  assert reduce_scatters(2, 4) == reduce_scatters(2, 2)
  assert reduce_scatters(3, 4) > reduce_scatters(3, 2)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_bf16_micro_batch_gradients_are_summed_in_the_reduce_dtype(schedule):
  # Every number below is a power of two, so that bf16 computes each micro-batch's gradient
  # exactly: one micro-batch contributes 1 to a weight's gradient, three contribute 2**-8
  # each. Summed in float32 (the reduce dtype) that is 1 + 3 * 2**-8; summed in bfloat16, whose
  # spacing at 1 is 2**-7, it rounds to 1 or 1 + 2**-6.
  mesh = make_mesh((2, 4), EXPLICIT)
  tx = zerojax.zero2(optax.sgd(0.1), mesh=mesh, min_shard_size=1, precision="bf16")
  scale = lambda w, h: (h * w[0], None)
  stage_fn = lambda w, h: zerojax.scan(scale, h, w)[0]
  mean = lambda _, h: jnp.mean(h.astype(jnp.float32))
  options = dict(microbatches=4, schedule=schedule, reduce="step")

  def loss(w, x):
    if schedule == "gpipe":
      return mean(None, zerojax.pipeline(stage_fn, w, x, **options))
    return zerojax.pipeline(stage_fn, w, x, loss_fn=mean, **options)

  rows = jnp.asarray([1.0, 2.0**-8, 2.0**-8, 2.0**-8] * 4)  # row i: micro-batch i % 4
  x = jnp.broadcast_to(rows[:, None], (16, 8)).astype(jnp.bfloat16)
  w = jnp.ones((2, 1, 1, 8), jnp.float32)
  with jax.set_mesh(mesh):
    stored = tx.shard(jax.device_put(w, NamedSharding(mesh, P("stage"))))
    _, grads = jax.jit(zerojax.value_and_grad(loss, tx))(
      stored, jax.device_put(x, NamedSharding(mesh, P("data")))
    )
    grads = tx.gather(grads)
  # d mean(x * w0 * w1) / d w = mean over rows of x / 8 columns, for either stage's weight.
  np.testing.assert_array_equal(np.asarray(grads), np.full(w.shape, (1 + 3 * 2.0**-8) / 4 / 8))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_forward_only_timetable_counts_only_forward_slots(schedule):
  # GPipe's first half, when the head follows the pipeline: its bubble is (S-1)/(M+S-1) too.
  table = zerojax.pipeline_timetable(schedule, stages=4, microbatches=8, backward=False)
  assert (table.backward < 0).all()
  assert table.bubble() == pytest.approx(3 / 11)


@pytest.mark.parametrize(
  "kind, stage, schedule", [(EXPLICIT, 1, "1f1b"), (EXPLICIT, 2, "gpipe"), (AUTO, 2, "1f1b")]
)
def test_drop_in_path_runs_without_a_mesh_in_context(kind, stage, schedule):
  # Placed with NamedSharding, stepped outside jax.set_mesh: the mesh is the arrays'.
  mesh = make_mesh((2, 4), kind)
  tx = STAGES[stage](optax.sgd(0.1), mesh=mesh, min_shard_size=256)
  with jax.set_mesh(mesh):
    params = tx.shard(placed(mesh))
  batch = jax.device_put(make_batch(), NamedSharding(mesh, P("data")))
  loss = pipelined_loss(schedule)
  value, grads = jax.jit(jax.value_and_grad(lambda p, *b: loss(tx.unpad(p), *b)))(params, *batch)
  assert_matches_one_device(value, grads)


@pytest.mark.parametrize(
  "kind, stage, schedule, jit, microbatches",
  [
    (EXPLICIT, 2, "1f1b", True, 2),
    (EXPLICIT, 3, "gpipe", True, 2),
    (AUTO, 2, "1f1b", False, 1),
    (EXPLICIT, 3, "gpipe", False, 2),
  ],
)
def test_value_and_grad_accumulates_and_runs_outside_jit(kind, stage, schedule, jit, microbatches):
  # value_and_grad's own micro-batches around the pipeline's, and value_and_grad called
  # op by op (outside jax.jit), where its shard_map runs eagerly around the pipeline's.
  mesh = make_mesh((2, 4), kind)
  tx = STAGES[stage](optax.sgd(0.1), mesh=mesh, min_shard_size=256)
  grad_fn = zerojax.value_and_grad(pipelined_loss(schedule), tx, microbatches=microbatches)
  with jax.set_mesh(mesh):
    params = tx.shard(placed(mesh))
    batch = jax.device_put(make_batch(), NamedSharding(mesh, P("data")))
    loss, grads = (jax.jit(grad_fn) if jit else grad_fn)(params, *batch)
    grads = tx.gather(grads)
  assert_matches_one_device(loss, grads)


@pytest.mark.parametrize("shape, kind", [((2, 4), EXPLICIT), ((2, 2, 2), AUTO)])
def test_a_loss_fn_that_sums_is_warned_about(shape, kind):
  # Its loss and gradients would come out 1/(micro-batches x data devices) of the true ones.
  def summed(head, h, labels):
    logits = h @ zerojax.gather(head)
    return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, labels))

  mesh = make_mesh(shape, kind)
  tx = zerojax.zero3(optax.sgd(0.1), mesh=mesh, min_shard_size=256)
  grad_fn = zerojax.value_and_grad(pipelined_loss("1f1b", head=summed), tx)
  with jax.set_mesh(mesh):
    params = tx.shard(placed(mesh))
    batch = jax.device_put(make_batch(), NamedSharding(mesh, P("data")))
    with pytest.warns(UserWarning, match="zerojax.pipeline: loss_fn's loss looks like a sum"):
      jax.eval_shape(grad_fn, params, *batch)


@pytest.mark.parametrize("shape, kind", [((2, 4), EXPLICIT), ((2, 2, 2), AUTO)])
def test_per_stage_code_runs_in_stage_fn_under_value_and_grad(shape, kind):
  # docs/pipeline.md: code that must run per stage goes in stage_fn, which runs manual over the
  # stage axis (a shard_map of one's own does not lower inside value_and_grad). Here stage s
  # scales its output by 1 + s / 2.
  def per_stage(layers, h):
    return stage_fn(layers, h) * (1 + jax.lax.axis_index("stage") / 2)

  def flat(params, x, labels):
    h = x @ params["embed"]
    for s in range(2):
      block = jax.tree.map(lambda a, s=s: a[2 * s : 2 * s + 2], params["layers"])
      h = stage_fn(block, h) * (1 + s / 2)
    return head_loss(params["head"], h, labels)

  def loss(params, x, labels):
    h = zerojax.pipeline(
      per_stage, params["layers"], x @ zerojax.gather(params["embed"]), microbatches=2
    )
    return head_loss(params["head"], h, labels)

  mesh = make_mesh(shape, kind)
  tx = zerojax.zero3(optax.sgd(0.1), mesh=mesh, min_shard_size=256)
  with jax.set_mesh(mesh):
    params = tx.shard(placed(mesh))
    batch = jax.device_put(make_batch(), NamedSharding(mesh, P("data")))
    value, grads = jax.jit(zerojax.value_and_grad(loss, tx))(params, *batch)
    grads = unstaged(tx.gather(grads))
  one = jax.device_put((make_params(), make_batch()), jax.devices()[0])
  want_value, want = jax.jit(jax.value_and_grad(flat))(one[0], *one[1])
  assert float(value) == pytest.approx(float(want_value), rel=1e-5)
  chex.assert_trees_all_close(grads, want, **ROUNDING)


KEEP = 0.75  # dropout's keep probability


def dropout_stage(layers, h, key):
  """A stage (or chunk) whose layers drop a quarter of each layer's update, layer ``i`` of
  the stage with key ``i``, as docs/pipeline.md does."""

  def body(h, inputs):
    w, i = inputs
    keep = jax.random.bernoulli(jax.random.fold_in(key, i), KEEP, h.shape)
    return h + jnp.where(keep, jax.nn.silu(h @ w["w"] + w["b"]), 0.0) / KEEP, None

  count = jax.tree.leaves(layers)[0].shape[0]  # a Shard's value keeps its layer axis whole
  return zerojax.scan(body, h, (layers, jnp.arange(count)))[0]


def dropout_reference(params, x, labels, key, slices: int, microbatches: int, chunks: int = 2):
  """The mean loss over ``slices`` devices' rows and their micro-batches, one at a time.

  Micro-batch ``m`` of a device's slice is its rows ``i % microbatches == m``; the layers, in
  order, are ``chunks`` virtual stages, and virtual stage ``c`` draws with
  ``fold_in(fold_in(key, m), c)``, as docs/pipeline.md says.
  """
  losses, n = [], params["layers"]["w"].shape[0] // chunks
  for rows in jnp.split(jnp.arange(x.shape[0]), slices):
    for m in range(microbatches):
      h = x[rows[m::microbatches]] @ params["embed"]
      for c in range(chunks):
        block = jax.tree.map(lambda a, c=c: a[c * n : (c + 1) * n], params["layers"])
        h = dropout_stage(block, h, jax.random.fold_in(jax.random.fold_in(key, m), c))
      losses.append(head_loss(params["head"], h, labels[rows[m::microbatches]]))
  return jnp.mean(jnp.stack(losses))


@pytest.mark.parametrize(
  "shape, kind, stage, schedule",
  [
    ((2, 4), EXPLICIT, 3, "1f1b"),
    ((2, 2, 2), AUTO, 3, "gpipe"),
    ((2, 2, 2), AUTO, 2, "1f1b"),
    ((2, 4), EXPLICIT, 3, "interleaved"),
    ((2, 2, 2), AUTO, 2, "interleaved"),
  ],
)
def test_dropout_inside_the_stages_draws_per_micro_batch_and_stage(shape, kind, stage, schedule):
  # The key is an argument of the jitted step, closed over by the loss: each micro-batch and
  # virtual stage draws its own masks, the same in the backward pass as in the forward pass.
  mesh = make_mesh(shape, kind)
  tx = STAGES[stage](optax.sgd(0.1), mesh=mesh, min_shard_size=256)
  chunks = 2 if schedule == "interleaved" else 1  # per stage: virtual stage k S + s on stage s
  options = dict(microbatches=2, virtual_stages=chunks if chunks > 1 else None)

  def step(params, x, labels, key):
    def loss(params, x, labels):
      h = x @ zerojax.gather(params["embed"])
      return through_pipeline(
        dropout_stage,
        params["layers"],
        h,
        head_loss,
        params["head"],
        labels,
        schedule,
        key=key,
        **options,
      )

    return zerojax.value_and_grad(loss, tx)(params, x, labels)

  key = jax.random.key(7)
  with jax.set_mesh(mesh):
    params = tx.shard(placed(mesh, virtual_stages=chunks))
    batch = jax.device_put(make_batch(), NamedSharding(mesh, P("data")))
    value, grads = jax.jit(step)(params, *batch, key)
    grads = unstaged(tx.gather(grads), virtual_stages=chunks)
  one = jax.device_put((make_params(), make_batch(), key), jax.devices()[0])
  reference = functools.partial(
    dropout_reference, slices=mesh.shape["data"], microbatches=2, chunks=2 * chunks
  )
  want_value, want = jax.jit(jax.value_and_grad(reference))(one[0], *one[1], one[2])
  assert float(value) == pytest.approx(float(want_value), rel=1e-5)
  chex.assert_trees_all_close(grads, want, **ROUNDING)
  assert float(value) != pytest.approx(float(expected()[0]), rel=1e-3)  # the masks drop


@pytest.mark.parametrize("kind", [EXPLICIT, AUTO], ids=["explicit", "auto"])
def test_the_chunks_of_a_stage_draw_their_own_masks(kind):
  # Each layer adds its weights where its mask keeps: a weight's gradient counts the rows its
  # mask kept. Virtual stages s and S + s run on stage s, and must not draw the same masks.
  mesh = make_mesh((2, 4), kind)
  stages, chunks, microbatches = 2, 2, 2

  def chunk(w, h, key):
    def body(h, inputs):
      w, i = inputs
      keep = jax.random.bernoulli(jax.random.fold_in(key, i), 0.5, h.shape)
      return h + jnp.where(keep, w, 0), None

    return jax.lax.scan(body, h, (w, jnp.arange(w.shape[0])))[0]

  def loss(w, h, key):
    options = dict(schedule="interleaved", virtual_stages=chunks, key=key)
    mean = lambda _, h: jnp.mean(h)
    return zerojax.pipeline(chunk, w, h, microbatches=microbatches, loss_fn=mean, **options)

  w = jnp.zeros((stages, chunks * LAYERS, WIDTH))
  with jax.set_mesh(mesh):
    w = jax.device_put(w, NamedSharding(mesh, P("stage")))
    kept = jax.jit(jax.grad(loss))(w, jnp.zeros((BATCH, WIDTH)), jax.random.key(3))
  kept = np.asarray(kept).reshape(stages, chunks, LAYERS, WIDTH)
  for s in range(stages):
    assert not np.array_equal(kept[s, 0], kept[s, 1]), f"virtual stages {s} and {s + stages}"


def row_dropout_layers(layers, h, first=0):
  """Dropout with a key per row, carried in the activations (uint32): layer ``first + i``
  folds ``first + i`` into each row's key."""

  def body(h, inputs):
    w, i = inputs
    draw = lambda key: jax.random.bernoulli(jax.random.fold_in(key, i), KEEP, (WIDTH,))
    keep = jax.vmap(draw)(h["keys"])
    update = jnp.where(keep, jax.nn.silu(h["h"] @ w["w"] + w["b"]), 0.0) / KEEP
    return {"h": h["h"] + update, "keys": h["keys"]}, None

  count = jax.tree.leaves(layers)[0].shape[0]
  return zerojax.scan(body, h, (layers, first + jnp.arange(count)))[0]


def row_dropout_stage(layers, h):
  return row_dropout_layers(layers, h, jax.lax.axis_index("stage") * (LAYERS // 2))


def row_dropout_loss(schedule: str, pipelined: bool = True):
  """The loss of the row-dropout model, through the pipeline or scanned on one device."""
  head = lambda head, h, labels: head_loss(head, h["h"], labels)

  def loss(params, x, labels, keys):
    h = {"h": x @ zerojax.gather(params["embed"]), "keys": keys}
    if not pipelined:
      return head(params["head"], row_dropout_layers(params["layers"], h), labels)
    return through_pipeline(
      row_dropout_stage,
      params["layers"],
      h,
      head,
      params["head"],
      labels,
      schedule,
      microbatches=2,
    )

  return loss


@pytest.mark.parametrize(
  "shape, kind, stage, schedule, path",
  [
    ((2, 4), EXPLICIT, 2, "1f1b", "explicit"),
    ((2, 2, 2), AUTO, 3, "gpipe", "explicit"),
    ((2, 4), EXPLICIT, 1, "gpipe", "drop-in"),
  ],
)
def test_keys_carried_in_the_activations_pass_from_stage_to_stage(
  shape, kind, stage, schedule, path
):
  # One raw uint32 key per row beside the activations: the masks follow the rows, so the
  # pipeline computes the scanned model's loss exactly; only the float leaves are
  # differentiated.
  keys = jax.random.key_data(jax.random.split(jax.random.key(5), BATCH))
  mesh = make_mesh(shape, kind)
  tx = STAGES[stage](optax.sgd(0.1), mesh=mesh, min_shard_size=256)
  loss = row_dropout_loss(schedule)
  with jax.set_mesh(mesh):
    params = tx.shard(placed(mesh))
    batch = jax.device_put((*make_batch(), keys), NamedSharding(mesh, P("data")))
    if path == "explicit":
      value, grads = jax.jit(zerojax.value_and_grad(loss, tx))(params, *batch)
      grads = tx.gather(grads)
    else:
      drop_in = jax.value_and_grad(lambda p, *b: loss(tx.unpad(p), *b))
      value, grads = jax.jit(drop_in)(params, *batch)
  one = jax.device_put((make_params(), (*make_batch(), keys)), jax.devices()[0])
  want_value, want = jax.jit(jax.value_and_grad(row_dropout_loss(schedule, False)))(one[0], *one[1])
  assert float(value) == pytest.approx(float(want_value), rel=1e-5)
  chex.assert_trees_all_close(unstaged(grads), want, **ROUNDING)


class _DropoutBlock(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    update = nn.Dropout(1 - KEEP, deterministic=False)(jax.nn.silu(nn.Dense(WIDTH)(h)))
    return h + update, None


class _ReferenceLayers(zerojax.flax.linen.scan(_DropoutBlock, length=LAYERS)):
  """The stack on one device, drawing as ``zerojax.flax.linen.pipeline`` does on ``slices`` devices.

  Its one key is ``make_rng("dropout")`` of a module at the pipeline's path, so the same key;
  layer ``i`` of stage ``s`` runs micro-batch ``m`` with it folded with ``m``, ``s``, ``i``.
  """

  slices: int = 1

  def __call__(self, h, xs=None):
    if self.is_initializing():
      return super().__call__(h, xs)
    key, params, out = self.make_rng("dropout"), self.variables["params"], h
    block = _DropoutBlock(parent=None)
    for rows in jnp.split(jnp.arange(h.shape[0]), self.slices):
      for m in range(2):
        hm = h[rows[m::2]]
        for layer in range(LAYERS):
          s, i = divmod(layer, LAYERS // 2)
          k = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, m), s), i)
          p = jax.tree.map(lambda a, layer=layer: a[layer], params)
          hm = block.apply({"params": p}, hm, None, rngs={"dropout": k})[0]
        out = out.at[rows[m::2]].set(hm)
    return out, None


class _Kernel(nn.Module):
  @nn.compact
  def __call__(self):
    return self.param("kernel", nn.initializers.lecun_normal(), (WIDTH, CLASSES))


class _DropoutModel(nn.Module):
  schedule: str
  slices: int = 0  # 0: pipelined; else the reference for that many data devices

  @nn.compact
  def __call__(self, x, labels):
    h = zerojax.flax.linen.gathered(nn.Dense)(WIDTH, name="embed")(x)
    kernel = zerojax.flax.linen.gathered(_Kernel)(name="head")()
    loss_fn = lambda kernel, h, labels: jnp.mean(
      optax.softmax_cross_entropy_with_integer_labels(h @ kernel, labels)
    )
    if self.slices:
      return loss_fn(kernel, _ReferenceLayers(slices=self.slices, name="layers")(h)[0], labels)
    layers = zerojax.flax.linen.pipeline(
      _DropoutBlock, length=LAYERS, microbatches=2, schedule=self.schedule
    )(name="layers")
    if self.schedule == "gpipe":
      return loss_fn(kernel, layers(h), labels)
    return layers(h, loss_fn=loss_fn, loss_params=kernel, targets=(labels,))


@pytest.mark.parametrize(
  "shape, kind, stage, schedule", [((2, 4), EXPLICIT, 3, "1f1b"), ((2, 2, 2), AUTO, 2, "gpipe")]
)
def test_linen_pipeline_hands_the_rngs_of_apply_to_its_blocks(shape, kind, stage, schedule):
  x, labels = make_batch()
  rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
  params = _DropoutModel(schedule).init(rngs, x, labels)["params"]
  mesh = make_mesh(shape, kind)
  apply = lambda params, x, labels, slices=0: _DropoutModel(schedule, slices).apply(
    {"params": params}, x, labels, rngs={"dropout": jax.random.key(2)}
  )
  want_value, want = jax.jit(jax.value_and_grad(apply), static_argnums=3)(
    params, x, labels, mesh.shape["data"]
  )
  tx = STAGES[stage](optax.sgd(0.1), mesh=mesh, min_shard_size=256)
  on_stages = lambda path, a: jax.device_put(
    a, NamedSharding(mesh, P("stage") if path[0].key == "layers" else P())
  )
  with jax.set_mesh(mesh):
    stored = tx.shard(jax.tree_util.tree_map_with_path(on_stages, params))
    batch = jax.device_put((x, labels), NamedSharding(mesh, P("data")))
    value, grads = jax.jit(zerojax.value_and_grad(apply, tx))(stored, *batch)
    grads = tx.gather(grads)
  assert float(value) == pytest.approx(float(want_value), rel=1e-5)
  chex.assert_trees_all_close(grads, want, **ROUNDING)


@pytest.mark.parametrize(
  "shape, kind, stage, reduce, layers, microbatches",
  [
    ((2, 4), EXPLICIT, 3, None, 4, 2),
    ((2, 2, 2), AUTO, 2, None, 4, 4),
    ((4, 2), AUTO, 1, None, 8, 4),
    ((4, 2), EXPLICIT, 3, "step", 8, 4),
  ],
)
def test_interleaved_schedule_matches_one_device(shape, kind, stage, reduce, layers, microbatches):
  # Two chunks per stage: virtual stage k S + s on stage s, the activations coming round from
  # the last stage to the first between chunks; ZeRO inside as in the other schedules.
  mesh = make_mesh(shape, kind)
  tx = STAGES[stage](optax.sgd(0.1), mesh=mesh, min_shard_size=256)
  options = dict(microbatches=microbatches, virtual_stages=2, reduce=reduce)
  with jax.set_mesh(mesh):
    params = tx.shard(placed(mesh, layers, virtual_stages=2))
    batch = jax.device_put(make_batch(), NamedSharding(mesh, P("data")))
    loss, grads = jax.jit(zerojax.value_and_grad(pipelined_loss("interleaved", **options), tx))(
      params, *batch
    )
    grads = tx.gather(grads)
  assert_matches_one_device(loss, grads, virtual_stages=2)


@pytest.mark.parametrize("stages, microbatches, chunks", [(2, 4, 2), (4, 8, 2), (4, 4, 3)])
def test_interleaved_timetable_runs_every_chunk_in_order_with_a_smaller_bubble(
  stages, microbatches, chunks
):
  table = zerojax.pipeline_timetable(
    "interleaved", stages=stages, microbatches=microbatches, virtual_stages=chunks
  )
  assert table.bubble() == pytest.approx((stages - 1) / (chunks * microbatches + stages - 1))
  plain = zerojax.pipeline_timetable("1f1b", stages=stages, microbatches=microbatches)
  assert table.bubble() < plain.bubble()
  # Micro-batch m reaches virtual stage j = k S + s one tick after j - 1 at the earliest, and
  # leaves it backward after j + 1; the last one's backward pass follows its forward pass.
  ticks = {}
  for name, (runs, chunk) in {
    "forward": (table.forward, table.forward_chunk),
    "backward": (table.backward, table.backward_chunk),
  }.items():
    for t, s in np.argwhere(runs >= 0):
      assert (name, runs[t, s], chunk[t, s] * stages + s) not in ticks  # each exactly once
      ticks[name, runs[t, s], chunk[t, s] * stages + s] = t
  last = chunks * stages - 1
  for m in range(microbatches):
    forward = [ticks["forward", m, j] for j in range(last + 1)]
    backward = [ticks["backward", m, j] for j in range(last + 1)]
    assert np.all(np.diff(forward) >= 1) and np.all(np.diff(backward) <= -1)
    assert backward[-1] >= forward[-1]
  one = zerojax.pipeline_timetable(
    "interleaved", stages=stages, microbatches=microbatches, virtual_stages=1
  )
  np.testing.assert_array_equal(one.forward, plain.forward)
  np.testing.assert_array_equal(one.backward, plain.backward)


def closing_loss(schedule: str | None, **options):
  """The loss of a model whose stages and head close over values the loss made.

  A boolean mask (lower-triangular: each feature mixes only the features before it), an
  integer table (the features' order reversed), a random key (one dropout mask for every
  layer) and a float scalar computed from a parameter (so its gradient flows through the
  closures); none of them is passed to the pipeline.
  ``schedule=None`` scans the layers on one device.
  """

  def loss(params, x, labels):
    embed = zerojax.gather(params["embed"])
    mask = jnp.tril(jnp.ones((WIDTH, WIDTH), bool))
    order = jnp.arange(WIDTH, dtype=jnp.int32)[::-1]
    scale = 1 + jnp.tanh(jnp.mean(embed))
    key = jax.random.key(5)

    def layer(h, w):
      mixed = (h @ jnp.where(mask, w["w"], 0.0))[:, order]
      keep = jax.random.bernoulli(key, KEEP, (WIDTH,))
      return h + jnp.where(keep, jax.nn.silu(mixed * scale + w["b"]), 0.0), None

    head = lambda head, h, labels: head_loss(head, h * scale, labels)
    stage = lambda layers, h: zerojax.scan(layer, h, layers)[0]
    h = x @ embed
    if schedule is None:
      return head(params["head"], jax.lax.scan(layer, h, params["layers"])[0], labels)
    return through_pipeline(
      stage, params["layers"], h, head, params["head"], labels, schedule, **options
    )

  return loss


@pytest.mark.parametrize(
  "kind, stage, schedule, path",
  [
    (EXPLICIT, 3, "gpipe", "explicit"),
    (AUTO, 2, "gpipe", "explicit"),
    (EXPLICIT, 2, "1f1b", "explicit"),
    (AUTO, 3, "1f1b", "explicit"),
    (EXPLICIT, 3, "interleaved", "explicit"),
    (AUTO, 1, "interleaved", "explicit"),
    (EXPLICIT, 1, "1f1b", "drop-in"),
    (AUTO, 2, "gpipe", "drop-in"),
  ],
)
def test_stages_and_head_closing_over_the_loss_s_values_match_one_device(
  kind, stage, schedule, path
):
  # docs/pipeline.md: stage_fn and loss_fn may close over masks, tables and scalars the loss
  # computed; they reach the stages as operands, and a float one gets its gradient from every
  # micro-batch and stage.
  mesh = make_mesh((2, 4), kind)
  tx = STAGES[stage](optax.sgd(0.1), mesh=mesh, min_shard_size=256)
  chunks = 2 if schedule == "interleaved" else 1
  options = dict(microbatches=2, virtual_stages=chunks if chunks > 1 else None)
  loss = closing_loss(schedule, **options)
  with jax.set_mesh(mesh):
    params = tx.shard(placed(mesh, virtual_stages=chunks))
    batch = jax.device_put(make_batch(), NamedSharding(mesh, P("data")))
    if path == "explicit":
      value, grads = jax.jit(zerojax.value_and_grad(loss, tx))(params, *batch)
      grads = tx.gather(grads)
    else:
      drop_in = jax.value_and_grad(lambda p, *b: loss(tx.unpad(p), *b))
      value, grads = jax.jit(drop_in)(params, *batch)
  grads = unstaged(grads, virtual_stages=chunks)
  one = jax.device_put((make_params(), make_batch()), jax.devices()[0])
  want_value, want = jax.jit(jax.value_and_grad(closing_loss(None)))(one[0], *one[1])
  assert float(value) == pytest.approx(float(want_value), rel=1e-5)
  chex.assert_trees_all_close(grads, want, **ROUNDING)
