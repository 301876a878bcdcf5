"""Initialising into shards: ``tx.sharded_init`` never makes the whole model on a device."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import zerojax
from tests.helpers import ROUNDING, STAGES, arrays

WIDTH, LAYERS, CLASSES = 512, 4, 11  # 11 classes: the head's kernel is padded at stage 3
MESH_TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}


class Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    for _ in range(LAYERS):
      x = nn.relu(nn.Dense(WIDTH)(x))
    return nn.Dense(CLASSES)(x)


def init_fn(key):
  return Mlp().init(key, jnp.ones((1, WIDTH)))["params"]


MODEL_BYTES = sum(
  x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(init_fn, jax.random.key(0)))
)


def mesh_of(count, types):
  return jax.make_mesh((count,), ("data",), (types,), devices=jax.devices()[:count])


@pytest.mark.parametrize("types", MESH_TYPES.values(), ids=MESH_TYPES)
@pytest.mark.parametrize(
  ("stage", "precision"), [(3, "fp32"), (3, "bf16"), (2, "bf16"), (1, "fp32")]
)
def test_sharded_init_gives_what_shard_and_init_give(stage, precision, types):
  tx = STAGES[stage](optax.adam(1e-3), mesh=mesh_of(8, types), precision=precision)
  key = jax.random.key(3)
  params, state = tx.sharded_init(init_fn)(key)
  full = init_fn(key)
  expected_state, expected_params = tx.init(full), tx.shard(full)  # init first: shard rounds
  assert jax.tree.structure(params) == jax.tree.structure(expected_params)
  chex.assert_trees_all_equal(arrays(params), arrays(expected_params), strict=True)
  # One program makes the values, split as stored, where init_fn ran op by op: XLA may round a
  # fused initialiser differently (by 1 ulp, in stage 2's master copy of the padded head).
  chex.assert_trees_all_close(state, expected_state, **ROUNDING)
  for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(expected_params), strict=True):
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
  # The state trains: one update on the initialised pair runs as on the other.
  grads = jax.tree.map(jnp.ones_like, tx.gather(params))
  updates, _ = jax.jit(tx.update)(grads, state, params)
  optax.apply_updates(params, updates)


def per_device_bytes(types, count):
  """``(outputs, temporaries)`` per device of stage 3's compiled init on ``count`` devices."""
  tx = zerojax.zero3(optax.adam(1e-3), mesh=mesh_of(count, types))
  memory = tx.sharded_init(init_fn).lower(jax.random.key(0)).compile().memory_analysis()
  return memory.output_size_in_bytes, memory.temp_size_in_bytes


@pytest.mark.parametrize("types", MESH_TYPES.values(), ids=MESH_TYPES)
def test_the_init_program_holds_shards_and_falls_as_one_over_n(types):
  measured = {count: per_device_bytes(types, count) for count in (2, 4, 8)}
  for count, (outputs, temporaries) in measured.items():
    # Parameters and Adam's two moments, 1/N each, and a working set of shards: never the
    # whole model (tx.shard(init_fn(key)) under jit holds it 4 times over on explicit axes).
    assert outputs == pytest.approx(3 * MODEL_BYTES / count, rel=0.02)
    assert temporaries <= 2 * MODEL_BYTES / count
  outputs, temporaries = np.array(list(measured.values())).T * [2, 4, 8]
  assert np.ptp(outputs) <= 0.02 * outputs.max() and np.ptp(temporaries) <= 0.1 * temporaries.max()
