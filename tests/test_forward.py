"""``zerojax.forward``: evaluating and sampling on stored parameters, one layer whole at a time."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType

import zerojax
import zerojax.flax.linen
import zerojax.flax.nnx
from tests.helpers import ROUNDING, STAGES

MESH_TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}
D, LAYERS, VOCAB, BATCH, STEPS = 64, 6, 37, 16, 5  # 37: the head and embedding are padded


def mesh_of(types, count=8):
  return jax.make_mesh((count,), ("data",), (types,), devices=jax.devices()[:count])


def make_params(key):
  keys = jax.random.split(key, 4)
  normal = lambda k, shape, scale: jax.random.normal(k, shape) * scale
  return {
    "embed": normal(keys[0], (VOCAB, D), 1.0),
    "layers": {
      "q": normal(keys[1], (LAYERS, D, D), D**-0.5),
      "kv": normal(keys[2], (LAYERS, D, 2 * D), D**-0.5),
    },
    "head": normal(keys[3], (D, VOCAB), D**-0.5),
  }


def decode_step(params, tokens, cache, position):
  """One token per example through the stack, attending to the example's cache (its KV cache).

  ``cache`` is (batch, layers, steps, 2 * D): split over devices like the batch.
  """
  h = zerojax.gather(params["embed"])[tokens].astype(jnp.float32)  # the cache's dtype

  def layer(h, xs):
    w, layer_cache = xs
    q = h @ w["q"]
    kv = h @ w["kv"]
    layer_cache = layer_cache.at[:, position].set(kv)
    k, v = jnp.split(layer_cache, 2, axis=-1)
    seen = jnp.arange(layer_cache.shape[1]) <= position
    scores = jnp.where(seen, jnp.einsum("bd,btd->bt", q, k) / D**0.5, -jnp.inf)
    h = h + jnp.einsum("bt,btd->bd", jax.nn.softmax(scores, axis=-1), v)
    return h, layer_cache

  h, new_cache = zerojax.scan(layer, h, (params["layers"], jnp.moveaxis(cache, 1, 0)))
  logits = h @ zerojax.gather(params["head"])
  return logits, jnp.moveaxis(new_cache, 0, 1)


def sample(step, params, tokens):
  """Greedy decoding of ``STEPS`` tokens after ``tokens``, with ``step`` as ``decode_step``."""
  cache = jnp.zeros((tokens.shape[0], LAYERS, STEPS, 2 * D))
  out = []
  for position in range(STEPS):
    logits, cache = step(params, tokens, cache, jnp.full((tokens.shape[0],), position))
    tokens = jnp.argmax(logits, axis=-1)
    out.append(logits)
  return jnp.stack(out, axis=1)


def per_example_step(params, tokens, cache, position):
  # forward splits every batch argument, so the position is given per example.
  return decode_step(params, tokens, cache, position[0])


@pytest.mark.parametrize("types", MESH_TYPES.values(), ids=MESH_TYPES)
@pytest.mark.parametrize(
  ("stage", "precision"), [(1, "fp32"), (2, "fp32"), (3, "fp32"), (3, "bf16")]
)
def test_sampling_with_a_kv_cache_matches_the_gathered_model(stage, precision, types):
  tx = STAGES[stage](optax.sgd(0.1), mesh=mesh_of(types), precision=precision, min_shard_size=1)
  full = make_params(jax.random.key(0))
  params = tx.shard(full)
  tokens = jnp.arange(BATCH) % VOCAB
  step = jax.jit(zerojax.forward(per_example_step, tx))
  got = sample(step, params, tokens)
  # The reference: the whole model, in the compute dtype, on one program over the whole batch.
  compute = jax.tree.map(lambda x: x.astype(tx.precision.compute_dtype(x.dtype)), full)
  expected = sample(jax.jit(per_example_step), compute, tokens)
  tolerance = ROUNDING if precision == "fp32" else {"rtol": 2e-2, "atol": 2e-2}
  chex.assert_trees_all_close(got.astype(jnp.float32), expected.astype(jnp.float32), **tolerance)


def stack_logits(params, x):
  h = x @ zerojax.gather(params["embed"])
  layer = lambda h, w: (jnp.tanh(h @ w["q"]) @ w["kv"][:, :D], None)
  h, _ = zerojax.scan(layer, h, params["layers"])
  return h @ zerojax.gather(params["head"])


@pytest.mark.parametrize("types", MESH_TYPES.values(), ids=MESH_TYPES)
def test_evaluating_holds_a_layer_not_the_model(types):
  # Evaluating on tx.gather(params) makes the whole model on every device; forward gathers one
  # layer at a time (zerojax.scan's one ahead): its temporaries stay within a few layers.
  tx = zerojax.zero3(optax.sgd(0.1), mesh=mesh_of(types), min_shard_size=1)
  full = make_params(jax.random.key(1))
  params = tx.shard(full)
  x = jax.random.normal(jax.random.key(2), (BATCH, VOCAB))
  evaluate = jax.jit(zerojax.forward(stack_logits, tx))
  chex.assert_trees_all_close(evaluate(params, x), jax.jit(stack_logits)(full, x), **ROUNDING)
  layer_bytes = 4 * D * 3 * D
  model_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(full))
  with jax.set_mesh(tx.mesh):
    memory = evaluate.lower(params, x).compile().memory_analysis()
    whole = jax.jit(lambda p, x: stack_logits(tx.gather(p), x)).lower(params, x).compile()
  assert memory.temp_size_in_bytes <= 4 * layer_bytes < model_bytes
  assert whole.memory_analysis().temp_size_in_bytes >= model_bytes


class Block(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    return h + nn.Dense(D)(jnp.tanh(nn.Dense(2 * D)(h))), None


class Model(nn.Module):
  @nn.compact
  def __call__(self, x):
    dense = zerojax.flax.linen.gathered(nn.Dense)  # gathers its parameters when called
    h = dense(D)(x)
    h, _ = zerojax.flax.linen.scan(Block, length=LAYERS)()(h, None)  # one layer ahead
    return dense(VOCAB)(h)


@pytest.mark.parametrize("types", MESH_TYPES.values(), ids=MESH_TYPES)
@pytest.mark.parametrize("stage", [2, 3])
def test_a_linen_model_evaluates_on_stored_parameters(stage, types):
  model, x = Model(), jax.random.normal(jax.random.key(3), (BATCH, 13))
  full = model.init(jax.random.key(4), x)["params"]
  tx = STAGES[stage](optax.sgd(0.1), mesh=mesh_of(types), min_shard_size=1)
  logits = jax.jit(zerojax.forward(lambda p, x: model.apply({"params": p}, x), tx))
  got = logits(tx.shard(full), x)
  chex.assert_trees_all_close(got, jax.jit(model.apply)({"params": full}, x), **ROUNDING)


def test_a_scalar_output_says_to_return_per_example_values():
  tx = zerojax.zero3(optax.sgd(0.1), mesh=mesh_of(AxisType.Explicit))
  params = tx.shard({"w": jnp.ones((64, 64))})
  loss = lambda params, x: jnp.mean(x @ zerojax.gather(params)["w"])
  with pytest.raises(ValueError, match=r"returned a scalar at its output.*per-example values"):
    zerojax.forward(loss, tx)(params, jnp.ones((8, 64)))
  per_example = lambda params, x: jnp.mean(x @ zerojax.gather(params)["w"], axis=-1)
  assert float(np.mean(zerojax.forward(per_example, tx)(params, jnp.ones((8, 64))))) == 64.0


@pytest.mark.parametrize("types", MESH_TYPES.values(), ids=MESH_TYPES)
def test_a_result_is_indexed_as_the_docs_say(types):
  tx = zerojax.zero3(optax.sgd(0.1), mesh=mesh_of(types))
  params = tx.shard({"w": jnp.eye(64)})
  x = jnp.arange(16 * 64.0).reshape(16, 64)
  out = zerojax.forward(lambda params, x: x @ zerojax.gather(params)["w"], tx)(params, x)
  row = out.at[3].get(out_sharding=jax.NamedSharding(tx.mesh, jax.P()))
  np.testing.assert_array_equal(row, x[3])
  np.testing.assert_array_equal(np.asarray(out)[3], x[3])
  if types == AxisType.Explicit:  # typed as split over the batch axis: JAX asks where row 3 goes
    with pytest.raises(Exception, match=r"\.at\[\.\.\.\]\.get\(out_sharding=") as raised:
      out[3]
    assert type(raised.value).__name__ == "ShardingTypeError"
  else:
    np.testing.assert_array_equal(out[3], x[3])


class NnxModel(nnx.Module):
  def __init__(self, rngs):
    self.hidden = nnx.Linear(13, D, rngs=rngs)
    self.out = nnx.Linear(D, VOCAB, rngs=rngs)  # 37 columns: padded at stage 3

  def __call__(self, x):  # each submodule gathered where it is called
    gathered = zerojax.flax.nnx.gathered
    return gathered(self.out)(jnp.tanh(gathered(self.hidden)(x)))


@pytest.mark.parametrize("types", MESH_TYPES.values(), ids=MESH_TYPES)
@pytest.mark.parametrize("stage", [1, 3])
def test_an_nnx_model_evaluates_on_stored_parameters(stage, types):
  tx = STAGES[stage](optax.sgd(0.1), mesh=mesh_of(types), min_shard_size=1)
  model, x = NnxModel(nnx.Rngs(5)), jax.random.normal(jax.random.key(6), (BATCH, 13))
  expected = model(x)
  nnx.update(model, tx.shard(nnx.state(model, nnx.Param)))
  logits = zerojax.flax.nnx.forward(lambda model, x: model(x), tx, gather=False)(model, x)
  chex.assert_trees_all_close(logits, expected, **ROUNDING)


# Meshes with more axes than one data axis: replicas (hybrid sharding), hpZ's nodes, and a
# tensor-parallel axis the layout places the layers on.
MULTI_AXIS = {
  "hybrid": ((2, 4), ("replica", "data"), {"replica_axis": "replica"}),
  "hpz": ((2, 4), ("node", "data"), {"axis_name": ("node", "data"), "secondary_axis": "data"}),
  "tensor": (
    (4, 2),
    ("data", "model"),
    {
      "layout": {
        "w": jax.P(None, ("data", "model")),
        "layers": jax.P(None, "data", "model"),
        "b": None,
      }
    },
  ),
}


def small_init(key):
  keys = jax.random.split(key, 3)
  return {
    "w": jax.random.normal(keys[0], (13, 40)),
    "layers": jax.random.normal(keys[1], (3, 40, 40)) * 0.1,
    "b": jax.random.normal(keys[2], (40,)),
  }


def small_stack(params, x):
  h = x @ zerojax.gather(params["w"]) + zerojax.gather(params["b"])
  return zerojax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, params["layers"])[0]


@pytest.mark.parametrize("types", MESH_TYPES.values(), ids=MESH_TYPES)
@pytest.mark.parametrize("mesh_name", MULTI_AXIS)
def test_init_and_forward_on_meshes_of_several_axes(mesh_name, types):
  shape, axes, options = MULTI_AXIS[mesh_name]
  mesh = jax.make_mesh(shape, axes, (types,) * len(axes))
  tx = zerojax.zero3(optax.adam(1e-3), mesh=mesh, min_shard_size=1, **options)
  params, _ = tx.sharded_init(small_init)(jax.random.key(0))
  full = small_init(jax.random.key(0))
  chex.assert_trees_all_close(tx.gather(params), full, **ROUNDING)  # XLA may fold "* 0.1" in
  x = jax.random.normal(jax.random.key(1), (16, 13))
  with jax.set_mesh(mesh):
    got = jax.jit(zerojax.forward(small_stack, tx))(params, x)
  chex.assert_trees_all_close(got, jax.jit(small_stack)(full, x), **ROUNDING)
