"""Layers as users write them: closing over the loss's values, under their own ``jax.checkpoint``.

The oracle is ``jax.lax.scan`` of the same layer on one device: the same numbers, and, for what
the backward pass keeps, temporaries within one opened layer of its own.
"""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.extend import core as jex

import zerojax
import zerojax.flax.linen
import zerojax.flax.nnx
from tests.helpers import AXIS_TYPES, ROUNDING, STAGES

S, D, LAYERS = 7, 16, 3  # odd sequence and a prime-ish stack: no shape lines up by luck
policies = jax.checkpoint_policies


def mesh_of(axis_type):
  return jax.make_mesh((8,), ("data",), axis_types=(AXIS_TYPES[axis_type],))


def attention_params(key):
  keys = jax.random.split(key, 3)
  return {
    "layers": {
      "qk": jax.random.normal(keys[0], (LAYERS, D, D)) * D**-0.5,
      "v": jax.random.normal(keys[1], (LAYERS, D, D)) * D**-0.5,
    },
    "temperature": jax.random.normal(keys[2], (D,)) * 0.1,
  }


def attention_stack(params, x, scan, gather):
  """A causal attention stack whose layer closes over what the loss built once.

  The layer reads a boolean mask, an integer position table, a rotary-like float table, a
  dropout key and a scalar computed from a parameter (so its gradient flows through the
  closure), none of them passed through ``xs``.
  """
  mask = jnp.tril(jnp.ones((S, S), bool))
  positions = jnp.arange(S, dtype=jnp.int32)
  angles = jnp.cos(positions[:, None] / (1.0 + jnp.arange(D)))
  key = jax.random.key(7)
  scale = 1.0 + jnp.tanh(jnp.sum(gather(params["temperature"])))

  def layer(h, xs):
    w, index = xs
    rotated = h * angles
    scores = jnp.einsum("bsd,btd->bst", rotated @ w["qk"], rotated) * scale
    scores = jnp.where(mask[None], scores, -1e9)
    keep = jax.random.bernoulli(jax.random.fold_in(key, index), 0.9, (S, D))
    h = h + jnp.einsum("bst,btd->bsd", jax.nn.softmax(scores, -1), h @ w["v"]) * keep
    return h + positions[None, :, None] * 1e-3, None

  return scan(layer, x, (params["layers"], jnp.arange(LAYERS)))[0]


def attention_loss(params, x, scan, gather):
  return jnp.mean(attention_stack(params, x, scan, gather) ** 2)


def batch(key, count=8):
  return jax.random.normal(key, (count, S, D))


@functools.cache
def attention_reference():
  params, x = attention_params(jax.random.key(0)), batch(jax.random.key(1))
  loss = functools.partial(attention_loss, scan=jax.lax.scan, gather=lambda p: p)
  return params, x, jax.jit(jax.value_and_grad(loss))(params, x)


@pytest.mark.parametrize("axis_type", ["explicit", "auto"])
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_layer_closing_over_the_losss_values_matches_one_device(axis_type, stage, prefetch):
  params, x, (loss, grads) = attention_reference()
  tx = STAGES[stage](optax.sgd(0.1), mesh=mesh_of(axis_type), min_shard_size=64)
  scan = functools.partial(zerojax.scan, prefetch=prefetch)
  loss_fn = functools.partial(attention_loss, scan=scan, gather=zerojax.gather)
  got_loss, got = jax.jit(zerojax.value_and_grad(loss_fn, tx))(tx.shard(params), x)
  chex.assert_trees_all_close(got_loss, loss, **ROUNDING)
  chex.assert_trees_all_close(tx.unpad(tx.gather(got)), grads, **ROUNDING)


@pytest.mark.parametrize("axis_type", ["explicit", "auto"])
def test_forward_runs_a_layer_closing_over_a_mask(axis_type):
  params, x, _ = attention_reference()
  tx = zerojax.zero3(optax.sgd(0.1), mesh=mesh_of(axis_type), min_shard_size=64)
  stack = functools.partial(attention_stack, scan=zerojax.scan, gather=zerojax.gather)
  got = jax.jit(zerojax.forward(stack, tx))(tx.shard(params), x)
  want = attention_stack(params, x, jax.lax.scan, lambda p: p)
  chex.assert_trees_all_close(got, want, **ROUNDING)


# What the backward pass keeps. An activation-heavy stack (many tokens, narrow weights), so that
# one layer's saved activations are several layers' weights and a policy that is ignored shows.
TOKENS, WIDTH, HIDDEN, DEPTH = 256, 32, 128, 12


def mlp(h, w):
  hidden = jax.ad_checkpoint.checkpoint_name(h @ w["up"], "hidden")
  return h + jnp.tanh(hidden) @ w["down"], None


USER_LAYERS = {
  "plain": mlp,
  "checkpoint": jax.checkpoint(mlp),
  "nothing_saveable": jax.checkpoint(mlp, policy=policies.nothing_saveable),
  "dots_saveable": jax.checkpoint(mlp, policy=policies.dots_saveable),
  "save_only_these_names": jax.checkpoint(mlp, policy=policies.save_only_these_names("hidden")),
  "save_any_names_but_these": jax.checkpoint(
    mlp, policy=policies.save_any_names_but_these("hidden")
  ),
  "remat of half the layer": lambda h, w: mlp(jax.checkpoint(lambda h: h * 2.0)(h) / 2.0, w),
}


#: One layer opened: its weights, and its activations and their gradients while it computes.
ONE_LAYER = (WIDTH * HIDDEN * 2 + TOKENS * HIDDEN * 2) * 4
#: What a plain layer keeps and one under ``jax.checkpoint`` does not: its hidden activations.
ACTIVATIONS = DEPTH * TOKENS * HIDDEN * 4


def mlp_params(key):
  up, down = jax.random.split(key)
  return {
    "up": jax.random.normal(up, (DEPTH, WIDTH, HIDDEN)) * WIDTH**-0.5,
    "down": jax.random.normal(down, (DEPTH, HIDDEN, WIDTH)) * HIDDEN**-0.5,
  }


def temporaries(compiled) -> int:
  return compiled.memory_analysis().temp_size_in_bytes


@functools.cache
def one_device(name):
  """``(loss, grads, temporaries)`` of ``jax.lax.scan`` of the layer on one device's batch."""
  params = jax.device_put(mlp_params(jax.random.key(0)), jax.devices()[0])
  x = jax.device_put(jax.random.normal(jax.random.key(1), (TOKENS, WIDTH)), jax.devices()[0])
  loss = lambda p, x: jnp.mean(jax.lax.scan(USER_LAYERS[name], x, p)[0] ** 2)
  step = jax.jit(jax.value_and_grad(loss)).lower(params, x).compile()
  return (*step(params, x), temporaries(step))


@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("name", list(USER_LAYERS))
def test_the_users_checkpoint_decides_what_the_backward_pass_keeps(name, prefetch):
  loss, grads, reference = one_device(name)
  mesh = mesh_of("explicit")
  tx = zerojax.zero3(optax.sgd(0.1), mesh=mesh)
  params = tx.shard(mlp_params(jax.random.key(0)))
  # Every device gets the one device's batch: the same per-device activations.
  x = jnp.tile(jax.random.normal(jax.random.key(1), (TOKENS, WIDTH)), (8, 1))
  layer = USER_LAYERS[name]
  loss_fn = lambda p, x: jnp.mean(zerojax.scan(layer, x, p, prefetch=prefetch)[0] ** 2)
  step = jax.jit(zerojax.value_and_grad(loss_fn, tx)).lower(params, x).compile()
  got_loss, got = step(params, x)
  chex.assert_trees_all_close(got_loss, loss, **ROUNDING)
  chex.assert_trees_all_close(tx.unpad(tx.gather(got)), grads, **ROUNDING)
  assert temporaries(step) <= reference + ONE_LAYER, (temporaries(step), reference)


def test_the_gathered_weights_are_not_kept_whatever_the_users_policy():
  """A parameter-heavy stack under ``everything_saveable``: its weights are gathered again."""
  width, depth = 256, 12
  layer = jax.checkpoint(
    lambda h, w: (jnp.tanh(h @ w.astype(jnp.bfloat16).astype(jnp.float32).T), None),
    policy=policies.everything_saveable,
  )
  tx = zerojax.zero3(optax.sgd(0.1), mesh=mesh_of("auto"))
  params = tx.shard(jnp.ones((depth, width, width)) * 0.01)
  loss_fn = lambda p, x: jnp.mean(zerojax.scan(layer, x, p)[0])
  step = jax.jit(zerojax.value_and_grad(loss_fn, tx)).lower(params, jnp.ones((8, width))).compile()
  layer_bytes = width * width * 4
  assert temporaries(step) < 4 * layer_bytes, temporaries(step) / layer_bytes


def test_zerojaxs_policy_on_a_layer_under_its_own_checkpoint_is_refused():
  tx = zerojax.zero3(optax.sgd(0.1), mesh=mesh_of("explicit"))
  params = tx.shard(mlp_params(jax.random.key(0)))
  layer = USER_LAYERS["checkpoint"]
  loss_fn = lambda p, x: jnp.mean(zerojax.scan(layer, x, p, policy="dots_saveable")[0])
  with pytest.raises(ValueError, match=r"its own jax.checkpoint.*not both"):
    zerojax.value_and_grad(loss_fn, tx)(params, jnp.ones((8, WIDTH)))


def assert_keeps(kept: int, *, rematerialised: bool) -> None:
  """``kept`` temporaries are those of the one-device stack under ``jax.checkpoint``, or not."""
  reference = one_device("checkpoint")[2]
  if rematerialised:
    assert kept <= reference + ONE_LAYER, (kept, reference)
  else:
    assert kept >= reference + ACTIVATIONS / 2, (kept, reference)


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    hidden = nn.Dense(HIDDEN, use_bias=False)(h)
    return h + nn.Dense(WIDTH, use_bias=False)(jnp.tanh(hidden)), None


@pytest.mark.parametrize(
  "remat, policy", [("none", None), ("nn.remat", None), ("none", "everything_saveable")]
)
def test_linen_blocks_keep_what_nn_remat_or_the_policy_says(remat, policy):
  block = nn.remat(LinenBlock) if remat == "nn.remat" else LinenBlock
  layers = zerojax.flax.linen.scan(block, length=DEPTH, policy=policy)()
  x = jnp.tile(jax.random.normal(jax.random.key(1), (TOKENS, WIDTH)), (8, 1))
  params = layers.init(jax.random.key(0), x[:TOKENS], None)["params"]
  tx = zerojax.zero3(optax.sgd(0.1), mesh=mesh_of("auto"))
  loss_fn = lambda p, x: jnp.mean(layers.apply({"params": p}, x, None)[0] ** 2)
  step = jax.jit(zerojax.value_and_grad(loss_fn, tx)).lower(tx.shard(params), x).compile()
  # By default, and under nn.remat, a block keeps its input only; asked to, every value.
  assert_keeps(temporaries(step), rematerialised=policy is None)


class NnxBlock(nnx.Module):
  def __init__(self, rngs):
    self.up = nnx.Linear(WIDTH, HIDDEN, use_bias=False, rngs=rngs)
    self.down = nnx.Linear(HIDDEN, WIDTH, use_bias=False, rngs=rngs)

  def __call__(self, h):
    return h + self.down(jnp.tanh(self.up(h)))


def test_nnx_blocks_under_nnx_remat_keep_only_their_inputs():
  mesh = mesh_of("explicit")
  tx = zerojax.zero3(optax.sgd(0.1), mesh=mesh)
  x = jnp.tile(jax.random.normal(jax.random.key(1), (TOKENS, WIDTH)), (8, 1))

  def kept(step, policy=None):
    layers = nnx.vmap(NnxBlock, in_axes=0, out_axes=0)(nnx.Rngs(0).split(DEPTH))
    nnx.update(layers, tx.shard(nnx.state(layers, nnx.Param)))
    scan = lambda layers, x: zerojax.flax.nnx.scan(step, layers, x, policy=policy)[0]
    loss_fn = lambda layers, x: jnp.mean(scan(layers, x) ** 2)
    value_and_grad = zerojax.flax.nnx.value_and_grad(loss_fn, tx, gather=False)
    with jax.set_mesh(mesh):
      return temporaries(nnx.jit(value_and_grad).lower(layers, x).compile())

  # nnx.jit's program holds more than jax.jit's (the module's state goes in and out), so the
  # saving is measured against the same program keeping every value.
  step = lambda block, h, _: (block(h), None)
  assert kept(step, "everything_saveable") - kept(nnx.remat(step)) >= ACTIVATIONS / 2


class MaskedBlock(nn.Module):
  """A Linen block reading a causal mask it is given, made in the loss: a closure of the scan."""

  mask: jax.Array

  @nn.compact
  def __call__(self, h, _):
    scores = jnp.einsum("bsd,btd->bst", nn.Dense(D, use_bias=False)(h), h)
    return h + jax.nn.softmax(jnp.where(self.mask, scores, -1e9), -1) @ h, None


@pytest.mark.parametrize("axis_type", ["explicit", "auto"])
def test_flax_scans_run_layers_closing_over_the_losss_values(axis_type):
  x = batch(jax.random.key(1))
  causal = lambda: jnp.tril(jnp.ones((S, S), bool))
  linen = lambda mask: zerojax.flax.linen.scan(MaskedBlock, length=LAYERS)(mask)
  linen_params = linen(causal()).init(jax.random.key(0), x, None)["params"]
  linen_loss = lambda p, x: jnp.mean(linen(causal()).apply({"params": p}, x, None)[0] ** 2)

  layers = nnx.vmap(lambda rngs: nnx.Linear(D, D, use_bias=False, rngs=rngs))(
    nnx.Rngs(0).split(LAYERS)
  )

  def nnx_loss(layers, x):
    mask = causal()

    def step(layer, h, _):
      scores = jnp.einsum("bsd,btd->bst", layer(h), h)
      return h + jax.nn.softmax(jnp.where(mask, scores, -1e9), -1) @ h, None

    return jnp.mean(zerojax.flax.nnx.scan(step, layers, x)[0] ** 2)

  mesh = mesh_of(axis_type)
  tx = zerojax.zero3(optax.sgd(0.1), mesh=mesh, min_shard_size=64)
  want = jax.value_and_grad(linen_loss)(linen_params, x)  # outside: jax.lax.scan
  got = jax.jit(zerojax.value_and_grad(linen_loss, tx))(tx.shard(linen_params), x)
  chex.assert_trees_all_close((got[0], tx.unpad(tx.gather(got[1]))), want, **ROUNDING)

  want = nnx.value_and_grad(nnx_loss)(layers, x)
  want = (want[0], nnx.to_pure_dict(nnx.state(want[1], nnx.Param)))
  nnx.update(layers, tx.shard(nnx.state(layers, nnx.Param)))
  value_and_grad = zerojax.flax.nnx.value_and_grad(nnx_loss, tx, gather=False)
  with jax.set_mesh(mesh):
    loss, grads = nnx.jit(value_and_grad)(layers, x)
  grads = nnx.to_pure_dict(tx.unpad(tx.gather(nnx.state(grads, nnx.Param))))
  chex.assert_trees_all_close((loss, grads), want, **ROUNDING)


# What the backward pass keeps of each layer, read from the step's program: an attention layer as
# benchmarks/transformer.py's, in bfloat16 with a float32 softmax. Its derivative reads exp's
# output, the bfloat16 cast of the probabilities and, for a maximum that stop_gradient drops,
# nothing; its causal mask is made from constants. jax.lax.scan keeps each once per layer, or
# not at all; the weights are bfloat16 already, so the one device keeps no cast of them either.
HEADS, HEAD_DIM, SEQUENCE = 4, 8, 64


def bf16_attention(h, w):
  split = lambda x: x.reshape(*x.shape[:-1], HEADS, HEAD_DIM)
  q, k, v = (split(h @ w[name]) for name in ("q", "k", "v"))
  attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  return h + attended.reshape(h.shape) @ w["o"], None


def kept_per_layer(jaxpr) -> float:
  """The bytes the forward loop of a step's program stacks per layer: its residuals (and ys)."""
  loops = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "scan" and not eqn.params["reverse"]]
  inner = [kept_per_layer(sub) for eqn in jaxpr.eqns for sub in jex.jaxprs_in_params(eqn.params)]
  stacked = lambda eqn: [v.aval for v in eqn.outvars if v.aval.shape[:1] == (eqn.params["length"],)]
  here = [sum(a.size * a.dtype.itemsize for a in stacked(e)) / e.params["length"] for e in loops]
  return max([0, *here, *inner])


@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("policy", ["everything_saveable", "dots_saveable", "nothing_saveable"])
def test_each_layer_keeps_what_jax_lax_scan_keeps(policy, prefetch):
  width = HEADS * HEAD_DIM
  keys = jax.random.split(jax.random.key(0), 4)
  params = {
    name: (jax.random.normal(key, (LAYERS, width, width)) * width**-0.5).astype(jnp.bfloat16)
    for name, key in zip("qkvo", keys, strict=True)
  }
  x = jax.random.normal(jax.random.key(1), (1, SEQUENCE, width), jnp.bfloat16)
  mean = lambda h: jnp.mean(h.astype(jnp.float32) ** 2)
  layer = jax.checkpoint(bf16_attention, policy=getattr(policies, policy))
  loss = lambda p, x: mean(jax.lax.scan(layer, x, p)[0])
  one_device = jax.jit(jax.value_and_grad(loss)).trace(params, x)

  tx = zerojax.zero3(optax.sgd(0.1), mesh=mesh_of("explicit"))
  scan = functools.partial(zerojax.scan, prefetch=prefetch, policy=policy)
  loss_fn = lambda p, x: mean(scan(bf16_attention, x, p)[0])
  step = jax.jit(zerojax.value_and_grad(loss_fn, tx)).trace(
    tx.shard(params), jnp.tile(x, (8, 1, 1))
  )
  kept, want = kept_per_layer(step.jaxpr.jaxpr), kept_per_layer(one_device.jaxpr.jaxpr)
  assert kept <= want, (kept, want)
