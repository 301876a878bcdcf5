"""Randomness on the explicit path: per-example keys split like the batch, per-device keys folded.

The oracle is one device: given the same per-example keys, the loss and the gradients of
``zerojax.value_and_grad`` on 8 devices are those of ``jax.value_and_grad`` on the whole batch.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import zerojax
from tests.helpers import ROUNDING

MESH_TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}
LAYERS, WIDTH, BATCH = 3, 16, 32


def _dropout(key, h):
  """Inverted dropout at rate 1/2, the mask drawn from ``key``."""
  return jnp.where(jax.random.bernoulli(key, 0.5, h.shape), 2 * h, 0)


def _layer(h, inputs):
  w, key = inputs
  return jnp.tanh(_dropout(key, h) @ w), None


def _example_loss(params, x, key):
  """One example through ``zerojax.scan``'s layers, each with its own key from ``key``."""
  h, _ = zerojax.scan(_layer, x, (params["layers"], jax.random.split(key, LAYERS)))
  return jnp.mean(h**2)


def per_example_loss(params, x, keys):
  return jnp.mean(jax.vmap(_example_loss, (None, 0, 0))(params, x, keys))


def device_loss(key, params, x):
  """One device's loss on its slice ``x``, with the dropout mask drawn from ``key``."""
  h = _dropout(key, x) @ zerojax.gather(params)["layers"][0]
  return jnp.mean(h**2)


def _setup(types):
  mesh = jax.make_mesh((8,), ("data",), (types,))
  tx = zerojax.zero3(optax.sgd(0.1), mesh=mesh, min_shard_size=1)
  params = {"layers": jax.random.normal(jax.random.key(1), (LAYERS, WIDTH, WIDTH)) / 4}
  x = jax.random.normal(jax.random.key(2), (BATCH, WIDTH))
  return tx, params, x


def _assert_same(tx, got, expected):
  (loss, grads), (expected_loss, expected_grads) = got, expected
  np.testing.assert_allclose(loss, expected_loss, **ROUNDING)
  np.testing.assert_allclose(tx.gather(grads)["layers"], expected_grads["layers"], **ROUNDING)


@pytest.mark.parametrize("types", MESH_TYPES.values(), ids=MESH_TYPES)
@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "raw"])
def test_per_example_keys_give_what_one_device_gives(types, make_key):
  tx, params, x = _setup(types)
  keys = jax.random.split(make_key(0), BATCH)  # one per example, split with the batch
  expected = jax.value_and_grad(per_example_loss)(params, x, keys)
  grad_fn = zerojax.value_and_grad(per_example_loss, tx, microbatches=2)
  _assert_same(tx, jax.jit(grad_fn)(tx.shard(params), x, keys), expected)


@pytest.mark.parametrize("types", MESH_TYPES.values(), ids=MESH_TYPES)
def test_per_device_keys_fold_in_the_device_index(types):
  tx, params, x = _setup(types)
  key = jax.random.key(0)

  def per_device(params, x):  # the docs' recipe: the key closed over, the device index folded in
    return device_loss(jax.random.fold_in(key, jax.lax.axis_index(tx.batch_axes)), params, x)

  def one_device(params, x):  # each device's slice, with the key that device folds
    slices = x.reshape(8, BATCH // 8, WIDTH)
    losses = [device_loss(jax.random.fold_in(key, i), params, s) for i, s in enumerate(slices)]
    return jnp.mean(jnp.stack(losses))

  expected = jax.value_and_grad(one_device)(params, x)
  _assert_same(tx, jax.jit(zerojax.value_and_grad(per_device, tx))(tx.shard(params), x), expected)
