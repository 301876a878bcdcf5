"""An Equinox model trains under zerojax as under plain optax (its parameters stored as Stored)."""

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AxisType

import zerojax
from tests.helpers import ROUNDING, STAGES

MESH_TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}


def model_and_batch():
  model = eqx.nn.MLP(13, 37, 64, 2, key=jax.random.key(0))  # 37 outputs: padded at stage 3
  x = jax.random.normal(jax.random.key(1), (16, 13))
  return model, x, jnp.zeros((16, 37))


def mse(params, static, x, y):
  return jnp.mean((jax.vmap(eqx.combine(params, static))(x) - y) ** 2)


@pytest.mark.parametrize("types", MESH_TYPES.values(), ids=MESH_TYPES)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_an_equinox_model_trains_like_plain_optax(stage, types):
  model, x, y = model_and_batch()
  params, static = eqx.partition(model, eqx.is_array)
  mesh = jax.make_mesh((8,), ("data",), (types,))
  tx = STAGES[stage](optax.sgd(0.1, momentum=0.9), mesh=mesh, min_shard_size=1)
  loss = lambda params, x, y: mse(zerojax.gather(params), static, x, y)

  @jax.jit
  def step(params, state):
    value, grads = zerojax.value_and_grad(loss, tx)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  stored, state = tx.shard(params), tx.init(params)
  plain, plain_state = params, optax.sgd(0.1, momentum=0.9).init(params)
  for _ in range(3):
    stored, state, value = step(stored, state)
    expected, grads = jax.value_and_grad(mse)(plain, static, x, y)
    updates, plain_state = optax.sgd(0.1, momentum=0.9).update(grads, plain_state, plain)
    plain = optax.apply_updates(plain, updates)
    assert float(value) == pytest.approx(float(expected), rel=1e-5)
  chex.assert_trees_all_close(tx.gather(stored), plain, **ROUNDING)
