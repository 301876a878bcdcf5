"""Loss terms over the whole batch train under ``zerojax.value_and_grad`` as on one device.

``zerojax.value_and_grad`` runs the loss once per device on its slice of the batch, so a term
that is not a mean of per-example terms is computed on each slice: a mixture-of-experts balance
term (the square of a batch mean), or a contrastive loss whose negatives are the batch's other
rows. Written as docs/guide.md says, with the whole batch's values taken over ``tx.batch_axes``
(``jax.lax.pmean``, ``jax.lax.all_gather``), zero3 on 8 devices trains as plain optax on one
device does; written as for one device, it measurably does not.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from tests.helpers import ROUNDING

BATCH, FEATURES, WIDTH, STEPS = 64, 32, 32, 5


def balanced_mixture(params, x, y, *, batch_axes=None):
  """Squared error of a soft mixture of experts, plus a balance term on the mean routing."""
  params = zerojax.gather(params)
  routing = jax.nn.softmax(x @ params["router"])  # per example: a probability per expert
  prediction = jnp.sum(routing * (x @ params["out"]), axis=-1)
  load = jnp.mean(routing, axis=0)  # this slice's share of each expert
  if batch_axes:
    load = jax.lax.pmean(load, batch_axes)  # the whole batch's
  balance = WIDTH * jnp.sum(load**2)  # 1 when the experts share evenly
  return jnp.mean((prediction - y) ** 2) + balance


def in_batch_negatives(params, x, y, *, batch_axes=None):
  """Contrastive: each row's query against every row's key, its own key the positive."""
  del y
  params = zerojax.gather(params)
  queries, keys = x @ params["router"], jnp.tanh(x @ params["out"])
  first = 0
  if batch_axes:
    keys = jax.lax.all_gather(keys, batch_axes, axis=0, tiled=True)  # the whole batch's
    first = jax.lax.axis_index(batch_axes) * x.shape[0]  # this slice's first row in it
  labels = first + jnp.arange(x.shape[0])
  return optax.softmax_cross_entropy_with_integer_labels(queries @ keys.T, labels).mean()


def make_params() -> dict[str, jax.Array]:
  keys = jax.random.split(jax.random.key(0), 2)
  return {
    "router": jax.random.normal(keys[0], (FEATURES, WIDTH)) * 0.5,
    "out": jax.random.normal(keys[1], (FEATURES, WIDTH)) * FEATURES**-0.5,
  }


def train(loss_fn, tx, params, value_and_grad):
  """``STEPS`` steps on one batch: the final parameters and every step's loss."""
  state = tx.init(params)
  keys = jax.random.split(jax.random.key(1), 2)
  x, y = jax.random.normal(keys[0], (BATCH, FEATURES)), jax.random.normal(keys[1], (BATCH,))

  @jax.jit
  def step(params, state):
    loss, grads = value_and_grad(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  for _ in range(STEPS):
    params, state, loss = step(params, state)
    losses.append(loss)
  return params, np.array(losses)


@pytest.mark.parametrize("loss_fn", [balanced_mixture, in_batch_negatives])
def test_a_whole_batch_term_trains_as_on_one_device_when_taken_over_the_batch_axes(loss_fn, mesh):
  inner = optax.adam(1e-1)
  expected_params, expected_losses = train(loss_fn, inner, make_params(), jax.value_and_grad)
  tx = zerojax.zero3(inner, mesh=mesh)
  value_and_grad = lambda loss_fn: zerojax.value_and_grad(loss_fn, tx)
  whole_batch = lambda params, x, y: loss_fn(params, x, y, batch_axes=tx.batch_axes)
  params, losses = train(whole_batch, tx, tx.shard(make_params()), value_and_grad)
  chex.assert_trees_all_close(tx.gather(params), expected_params, **ROUNDING)
  chex.assert_trees_all_close(losses, expected_losses, **ROUNDING)

  # As for one device: each device's term is that of its own 8 rows, not of the batch's 64.
  params, losses = train(loss_fn, tx, tx.shard(make_params()), value_and_grad)
  assert np.abs(losses[0] - expected_losses[0]) > 0.1, (losses, expected_losses)
  difference = jax.tree.map(lambda a, b: np.max(np.abs(a - b)), tx.gather(params), expected_params)
  assert max(jax.tree.leaves(difference)) > 1e-2, difference
