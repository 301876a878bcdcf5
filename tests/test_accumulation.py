"""Gradient accumulation over micro-batches inside a step, and across steps with MultiSteps."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from tests import models
from tests.helpers import ROUNDING, STAGES

N, MICROBATCHES = 8, 4


def loss_with_aux(params, x, y):
  return models.loss_fn(params, x, y), jnp.mean(x[:, 0])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_micro_batches_equal_one_step_on_the_whole_batch(stage, mesh):
  inner = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))
  tx = STAGES[stage](inner, mesh=mesh)
  params = tx.shard(models.make_params())
  state = tx.init(params)
  grad_fn = zerojax.value_and_grad(loss_with_aux, tx, has_aux=True, microbatches=MICROBATCHES)

  @jax.jit
  def step(params, state, x, y):
    (loss, aux), grads = grad_fn(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss, aux

  x, y = models.make_batch()
  losses = []
  for _ in range(3):
    params, state, loss, aux = step(params, state, x, y)
    losses.append(float(loss))
  expected = models.reference(inner, models.make_params(), (x, y), 3)
  chex.assert_trees_all_close(tx.gather(params), expected, **ROUNDING)
  assert losses[0] == pytest.approx(float(models.loss_fn(models.make_params(), x, y)), rel=1e-5)
  # One aux per call of the loss, in batch order: here the mean of one row each.
  chex.assert_shape(aux, (N * MICROBATCHES,))
  chex.assert_trees_all_equal(np.asarray(aux), np.asarray(x[:, 0]))


@pytest.mark.parametrize("stage", [2, 3])
def test_multi_steps_accumulator_is_sharded(stage, mesh):
  tx = STAGES[stage](optax.MultiSteps(optax.adam(1e-2), every_k_schedule=4), mesh=mesh)
  state = tx.init(tx.shard(models.make_params()))
  leaf = state.inner_state.acc_grads["layers"]["w"]  # the one leaf over min_shard_size
  assert leaf.sharding.spec == jax.P(None, "data")
  assert leaf.addressable_shards[0].data.size * N == leaf.size


def test_multi_steps_outside_keeps_a_full_accumulator_on_every_device(mesh):
  # What docs/precision.md warns of: wrapped the other way round, MultiSteps'
  # accumulator is a full-size gradient on every device, which zerojax cannot see.
  tx = optax.MultiSteps(zerojax.zero2(optax.adam(1e-2), mesh=mesh), every_k_schedule=4)
  params = zerojax.zero2(optax.adam(1e-2), mesh=mesh).shard(models.make_params())
  leaf = tx.init(params).acc_grads["layers"]["w"]
  assert leaf.addressable_shards[0].data.size == leaf.size


@pytest.mark.parametrize(
  "batch_rows, microbatches, match",
  [
    (32, 3, "times 3 micro-batches. Use a batch size that is a multiple of 24"),
    (32, 0, "microbatches must be a positive int"),
  ],
)
def test_micro_batch_errors(batch_rows, microbatches, match, mesh):
  tx = zerojax.zero2(optax.sgd(0.1), mesh=mesh)
  params = tx.shard(models.make_params())
  x, y = jnp.ones((batch_rows, 12)), jnp.ones((batch_rows, 13))
  with pytest.raises(ValueError, match=match):
    zerojax.value_and_grad(models.loss_fn, tx, microbatches=microbatches)(params, x, y)
