"""``zerojax.scan``: gathers one layer ahead, reductions one layer behind, a collective per leaf.

Read from the optimized HLO (``zerojax.diagnostics.loop_collectives``), since on CPU the
collectives are synchronous and overlap cannot be timed.
"""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import zerojax
from tests.helpers import ROUNDING, rounding

LAYERS, D, F = 5, 40, 56
LEAVES_PER_LAYER = 6


def make_params(seed=0):
  rng = np.random.default_rng(seed)
  normal = lambda *shape, scale=1.0: jnp.asarray(
    rng.normal(size=shape) * scale / np.sqrt(shape[-2] if len(shape) > 2 else 1), jnp.float32
  )
  return {
    "embed": normal(12, D),
    "layers": {
      "w_in": normal(LAYERS, D, F),
      "b_in": normal(LAYERS, F, scale=0.1),
      "w_out": normal(LAYERS, F, D),
      "b_out": normal(LAYERS, D, scale=0.1),
      "scale": 1 + normal(LAYERS, D, scale=0.1),
      "shift": normal(LAYERS, D, scale=0.1),
    },
    "head": normal(D, 13),
  }


def make_batch(seed=1):
  rng = np.random.default_rng(seed)
  return (
    jnp.asarray(rng.normal(size=(32, 12)), jnp.float32),
    jnp.asarray(rng.normal(size=(32, 13)), jnp.float32),
  )


def loss_fn(params, x, y, prefetch):
  """The loss; ``prefetch`` is 0, 1, "defer" (1, each reduction one iteration late) or
  "default" (1, reductions deferred as ``zerojax.scan`` chooses)."""
  top = zerojax.gather({"embed": params["embed"], "head": params["head"]})

  def layer(h, w):
    normed = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)
    normed = normed * w["scale"] + w["shift"]
    return h + jnp.tanh(normed @ w["w_in"] + w["b_in"]) @ w["w_out"] + w["b_out"], jnp.mean(h)

  options = dict(prefetch=0 if prefetch == 0 else 1)
  if prefetch != "default":
    options["defer_reductions"] = prefetch == "defer"
  h, means = zerojax.scan(layer, x @ top["embed"], params["layers"], **options)
  return jnp.mean((h @ top["head"] - y) ** 2) + 1e-3 * jnp.sum(means)


def make_mesh(kind):
  if kind == "hybrid":
    return jax.make_mesh((2, 4), ("replica", "data"), (AxisType.Auto,) * 2)
  if kind == "tensor":
    return jax.make_mesh((4, 2), ("data", "model"), (AxisType.Auto,) * 2)
  if kind == "nodes":
    return jax.make_mesh((2, 4), ("node", "data"))
  types = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}[kind]
  return jax.make_mesh((8,), ("data",), (types,))


def transformation(stage, mesh_kind="explicit", **options):
  options.setdefault("min_shard_size", 1)
  if mesh_kind == "hybrid":
    options["replica_axis"] = "replica"
  if mesh_kind == "nodes":
    options["axis_name"] = ("node", "data")
  return getattr(zerojax, f"zero{stage}")(optax.adam(1e-2), mesh=make_mesh(mesh_kind), **options)


def step_fn(tx, prefetch, microbatches=1):
  def step(params, state, x, y):
    grad_fn = zerojax.value_and_grad(
      functools.partial(loss_fn, prefetch=prefetch), tx, microbatches=microbatches
    )
    loss, grads = grad_fn(params, x, y, opt_state=state)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  return jax.jit(step)


@functools.cache
def compiled(stage, prefetch, microbatches=1, **options):
  tx = transformation(stage, **options)
  full = make_params()
  state, params = tx.init(full), tx.shard(full)
  return step_fn(tx, prefetch, microbatches).lower(params, state, *make_batch()).compile()


def layer_loops(compiled_step):
  """The loops that gather or reduce (the layer loops; micro-batch loops hold them)."""
  return [loop for loop in zerojax.diagnostics.loop_collectives(compiled_step) if loop.gathers]


@pytest.mark.parametrize(
  "options",
  [{}, {"precision": "bf16"}, {"quantized_weights": "int8", "quantized_gradients": "int8"}],
  ids=["fp32", "bf16", "int8"],
)
def test_prefetched_loops_compute_only_what_the_previous_iteration_gathered(options):
  loops = layer_loops(compiled(3, 1, **options))
  assert len(loops) == 2  # forward and backward
  for loop in loops:
    assert loop.waiting_gathers == 0, loop  # test 1: weights reach the dots through the carry
  # Each layer's gradient is reduced in its own iteration, after its matmuls; deferred, the
  # reduction is of the previous iteration's gradient and waits on nothing.
  assert loops[1].waiting_reductions > 0
  for loop in layer_loops(compiled(3, "defer", **options)):
    assert loop.waiting_gathers == loop.waiting_reductions == 0, loop  # test 2


@pytest.mark.parametrize(
  ("mesh_kind", "options"),
  [
    ("explicit", {}),
    ("nodes", {}),
    ("explicit", {"quantized_gradients": "int8"}),
    ("auto", {"quantized_gradients": "int8"}),
  ],
  ids=["one axis", "two nodes", "qgZ", "qgZ auto"],
)
def test_off_gpus_reductions_are_not_deferred_by_default(mesh_kind, options):
  # On GPUs zerojax.scan defers quantized reductions and those across nodes by default
  # (tests/test_nodes.py); elsewhere deferring costs a layer's gradient and XLA says nothing of
  # its pay, so each layer's gradient is reduced in its own iteration, as with
  # defer_reductions=False.
  _, backward = layer_loops(compiled(3, "default", mesh_kind=mesh_kind, **options))
  assert backward.waiting_reductions > 0, backward


@pytest.mark.parametrize("options", [{}, {"quantized_weights": "int8"}], ids=["fp32", "int8"])
def test_the_check_fails_on_a_serialised_scan(options):
  forward, backward = layer_loops(compiled(3, 0, **options))
  assert forward.waiting_gathers > 0 and backward.waiting_gathers > 0
  assert backward.waiting_reductions > 0


@pytest.mark.parametrize(
  "options",
  [{}, {"precision": "bf16"}, {"quantized_weights": "int8", "quantized_gradients": "int8"}],
  ids=["fp32", "bf16", "int8"],
)
def test_each_leaf_moves_in_collectives_of_its_own_without_a_byte_copy(options):
  # A weight moves as itself (quantized: its codes and its scales), so that no
  # layer-sized buffer is packed or cut apart; XLA's combiners merge them on
  # GPUs and TPUs (tests/test_accelerators.py). The backward pass gathers only
  # the weights its VJP reads (here not the biases and shift, which only add).
  # Quantized gradients are the exception off TPU: a layer's codes and scales, a
  # quarter of its bytes, move as one buffer (comm/quantized.py says why).
  forward, backward = layer_loops(compiled(3, 1, **options))
  parts = 2 if options.get("quantized_weights") else 1
  assert (forward.gathers, forward.reductions) == (LEAVES_PER_LAYER * parts, 0)
  assert 0 < backward.gathers < forward.gathers
  reductions = 1 if options.get("quantized_gradients") else LEAVES_PER_LAYER
  assert backward.reductions == reductions
  text = compiled(3, 1, **options).as_text()
  moved = re.findall(r"= (\w+)\[[^\]]*\][^=]*? (?:all-gather|reduce-scatter|all-to-all)\(", text)
  assert moved and "u8" not in moved, moved


def test_stage_2_gathers_nothing_and_defers_its_reductions_on_request():
  loops = zerojax.diagnostics.loop_collectives(compiled(2, "defer"))
  summary = [(loop.gathers, loop.reductions, loop.waiting_reductions) for loop in loops]
  assert summary == [(0, LEAVES_PER_LAYER, 0)]
  for prefetch in (0, 1):
    (loop,) = zerojax.diagnostics.loop_collectives(compiled(2, prefetch))
    assert loop.gathers == 0 and loop.reductions == LEAVES_PER_LAYER
    assert loop.waiting_reductions > 0


def test_micro_batches_prefetch_inside_each_micro_batch():
  loops = layer_loops(compiled(3, "defer", microbatches=2))
  # The micro-batch loop holds the layer loops, the gathers of the parameters
  # outside the layers, and the reductions the layer loops leave to the end.
  assert len(loops) == 3
  forward, backward = layer_loops(compiled(3, 1))
  layers = loops[:2]
  assert [(loop.gathers, loop.reductions) for loop in layers] == [
    (forward.gathers, 0),
    (backward.gathers, LEAVES_PER_LAYER),
  ]
  assert all(loop.waiting_gathers == loop.waiting_reductions == 0 for loop in layers)


def test_the_forward_pass_hands_the_last_layer_to_the_backward_pass():
  # prefetch=0 gathers each layer once per pass; prefetch=1 keeps the last one,
  # so it makes one layer's backward gathers fewer.
  gathers = {
    p: zerojax.diagnostics.count_collectives(compiled(3, p))["all-gather"].count for p in (0, 1)
  }
  _, backward = layer_loops(compiled(3, 1))
  assert gathers[0] - gathers[1] == backward.gathers > 0


@functools.cache
def jitted(stage, prefetch, mesh_kind, **options):
  """The transformation and its jitted step, built once for every test that trains with them."""
  tx = transformation(stage, mesh_kind, **options)
  return tx, step_fn(tx, prefetch)


@functools.cache
def train(stage, prefetch, steps, mesh_kind="explicit", **options):
  """The gathered parameters after ``steps`` steps, and the last loss (computed once per run)."""
  tx, step = jitted(stage, prefetch, mesh_kind, **options)
  full = make_params()
  state, params = tx.init(full), tx.shard(full)
  batch = make_batch()
  for _ in range(steps):
    params, state, loss = step(params, state, *batch)
  return tx.gather(tx.master_params(params, state)), float(loss)


# Test 4: prefetching moves the same arithmetic into other loops, so XLA may
# fuse (and round) a few operations differently: after 20 Adam steps the
# parameters agree to a few float32 ulps of their size (bit for bit at stage 2
# and under bf16, whose rounding hides the difference).
QUANTIZED = {"quantized_weights": "int8", "quantized_gradients": "int8"}
CONFIGS = [
  (1, "explicit", {}),
  (2, "explicit", {}),
  (2, "explicit", {"precision": "bf16"}),
  (3, "explicit", {}),
  (3, "explicit", {"precision": "bf16"}),
  (3, "explicit", {"precision": "fp16"}),
  (3, "hybrid", {"precision": "bf16"}),
  (3, "tensor", {}),
  (2, "hybrid", {}),
]


@pytest.mark.parametrize(("stage", "mesh_kind", "options"), CONFIGS, ids=str)
def test_prefetch_changes_no_number_beyond_rounding(stage, mesh_kind, options):
  # The prefetching loop is another program than prefetch=0's, which XLA may fuse
  # and round otherwise: after 20 steps the two agree to the rounding of their
  # compute dtype (docs/performance.md).
  serial = train(stage, 0, 20, mesh_kind, **options)
  prefetched = train(stage, 1, 20, mesh_kind, **options)
  chex.assert_trees_all_close(prefetched, serial, **rounding(options.get("precision")))


@pytest.mark.parametrize(("stage", "mesh_kind"), [(2, "hybrid"), (3, "explicit")], ids=str)
def test_deferred_reductions_change_no_number_beyond_rounding(stage, mesh_kind):
  serial = train(stage, 0, 20, mesh_kind)
  chex.assert_trees_all_close(train(stage, "defer", 20, mesh_kind), serial, **rounding(None))


def test_prefetch_changes_no_number_beyond_quantization():
  # Quantized, a one-ulp difference in a gradient can move it across a
  # rounding boundary of the int8 grid, and later steps carry that on: after
  # one step the runs agree to float tolerance, and after 20 their difference
  # is a small part of what quantization itself changes.
  for steps, tolerance in ((1, 1e-6), (20, None)):
    serial, _ = train(3, 0, steps, "auto", **QUANTIZED)
    prefetched, _ = train(3, 1, steps, "auto", **QUANTIZED)
    difference = max(np.max(np.abs(a - b)) for a, b in _pairs(prefetched, serial))
    if tolerance is None:
      unquantized, _ = train(3, 0, steps, "auto")
      tolerance = 0.1 * max(np.max(np.abs(a - b)) for a, b in _pairs(unquantized, serial))
    assert difference <= tolerance, (steps, difference, tolerance)


def _pairs(one, other):
  pairs = zip(jax.tree.leaves(one), jax.tree.leaves(other), strict=True)
  return [(np.asarray(a), np.asarray(b)) for a, b in pairs]


def test_prefetch_trains_like_plain_optax():
  full, batch = make_params(), make_batch()
  reference = optax.adam(1e-2)
  state = reference.init(full)
  grad = jax.jit(jax.grad(lambda p, x, y: loss_fn(p, x, y, 1)))
  params = full
  for _ in range(3):
    updates, state = reference.update(grad(params, *batch), state, params)
    params = optax.apply_updates(params, updates)
  trained, _ = train(3, 1, 3)
  chex.assert_trees_all_close(trained, params, **ROUNDING)


def test_temporaries_grow_by_at_most_two_layers():
  # Test 5, on layers big enough to dominate the temporaries.
  memory = {p: compiled(3, p).memory_analysis().temp_size_in_bytes for p in (0, 1)}
  layer_bytes = 4 * (2 * D * F + F + 3 * D)
  assert memory[1] <= memory[0] + 2 * layer_bytes, (memory, layer_bytes)


def test_outside_value_and_grad_it_is_a_plain_scan():
  params, (x, y) = make_params(), make_batch()
  assert float(loss_fn(params, x, y, 1)) == float(loss_fn(params, x, y, 0))


@pytest.mark.parametrize(
  ("call", "message"),
  [
    (lambda: zerojax.scan(lambda c, x: (c, x), 0.0, jnp.ones(3), prefetch=2), "0 or 1"),
  ],
)
def test_bad_arguments(call, message):
  with pytest.raises(ValueError, match=message):
    call()


def _temporaries_of_a_casting_stack(layers, prefetch, policy):
  """Temporaries of a stage-3 step whose layer casts and transposes its weight (1 MiB)."""
  tx = zerojax.zero3(optax.sgd(0.1), mesh=make_mesh("explicit"))
  params = tx.shard({"w": jnp.full((layers, 512, 512), 0.01)})

  def loss(params, x):
    layer = lambda h, w: (jnp.tanh(h @ w.T.astype(jnp.bfloat16)).astype(jnp.float32), None)
    return jnp.mean(zerojax.scan(layer, x, params["w"], prefetch=prefetch, policy=policy)[0])

  grad_fn = jax.jit(zerojax.value_and_grad(loss, tx))
  compiled = grad_fn.lower(params, jnp.ones((16, 512))).compile()
  return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize(
  ("prefetch", "policy"),
  [(1, None), (1, jax.checkpoint_policies.everything_saveable), (0, None)],
  ids=["prefetch-default", "prefetch-everything", "serial-default"],
)
def test_nothing_computed_from_the_weights_alone_is_saved_per_layer(prefetch, policy):
  # A bf16 copy of each layer's transposed weight would be 0.5 MiB per layer; the
  # activations a layer saves are 16 x 512 floats (32 KiB at most).
  grow = _temporaries_of_a_casting_stack(8, prefetch, policy)
  grow -= _temporaries_of_a_casting_stack(4, prefetch, policy)
  assert grow < 4 * 2**17, grow  # under a quarter of a bf16 weight per layer


def test_bf16_reductions_fill_a_bf16_gradient_stack_with_the_same_numbers():
  # Issue 54 item 6: reduced in bfloat16, the backward loop fills the stacked gradients
  # in bfloat16 (half a float32 stack, as GSPMD FSDP keeps its own) and casts them to
  # float32 after the loop; the cast widens, so the gradients are prefetch=0's.
  precision = zerojax.Precision(params="float32", compute="bfloat16", reduce="bfloat16")
  tx = transformation(3, precision=precision)
  params, batch = tx.shard(make_params()), make_batch()
  grad_fn = lambda prefetch: jax.jit(
    zerojax.value_and_grad(functools.partial(loss_fn, prefetch=prefetch), tx)
  )
  text = grad_fn(1).lower(params, *batch).as_text()
  for shape in ((LAYERS, D // 8, F), (LAYERS, F // 8, D)):  # w_in's and w_out's shards
    assert f"tensor<{'x'.join(map(str, shape))}xbf16>" in text, shape
  (_, prefetched), (_, serial) = grad_fn(1)(params, *batch), grad_fn(0)(params, *batch)
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(prefetched))
  chex.assert_trees_all_close(prefetched, serial, **rounding("bf16"))
