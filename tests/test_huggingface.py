"""HuggingFace's Flax GPT-2, a model nobody here wrote, trains under zerojax as under plain optax.

Built from a configuration (no download): odd widths (36, 4 heads of 9) and a prime vocabulary
(97), so stage 3 pads leaves; weight decay and clipping read every leaf.
"""

import chex
import jax
import optax
import pytest
import transformers
from jax.sharding import AxisType

import zerojax
from tests.helpers import ROUNDING, STAGES

STEPS = 3


def model_and_batch():
  config = transformers.GPT2Config(vocab_size=97, n_positions=16, n_embd=36, n_layer=2, n_head=4)
  model = transformers.FlaxGPT2LMHeadModel(config, seed=0)
  tokens = jax.random.randint(jax.random.key(1), (16, 12), 0, config.vocab_size)
  return model, tokens


def optimizer():
  # eps well above rounding: the key projection's bias gets a gradient of exactly zero in
  # exact arithmetic (softmax ignores a score added to a whole row), so of rounding only, which
  # Adam with a tiny eps would blow up to full-size steps in any two programs alike.
  adamw = optax.adamw(1e-2, eps=1e-4, weight_decay=0.1)
  return optax.chain(optax.clip_by_global_norm(0.5), adamw)


def next_token_loss(model, params, tokens):
  logits = model(tokens[:, :-1], params=params).logits
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@pytest.mark.parametrize(
  ("stage", "types"),
  [(1, AxisType.Explicit), (2, AxisType.Explicit), (3, AxisType.Explicit), (3, AxisType.Auto)],
  ids=["1", "2", "3", "3-auto"],
)
def test_flax_gpt2_trains_like_plain_optax(stage, types):
  model, tokens = model_and_batch()
  mesh = jax.make_mesh((8,), ("data",), (types,))
  tx = STAGES[stage](optimizer(), mesh=mesh, min_shard_size=1)
  loss = lambda params, tokens: next_token_loss(model, zerojax.gather(params), tokens)

  @jax.jit
  def step(params, state, tokens):
    value, grads = zerojax.value_and_grad(loss, tx)(params, tokens)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  @jax.jit
  def plain_step(params, state, tokens):
    value, grads = jax.value_and_grad(lambda p: next_token_loss(model, p, tokens))(params)
    updates, state = optimizer().update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  stored, state = tx.shard(model.params), tx.init(model.params)
  plain, plain_state = model.params, optimizer().init(model.params)
  for _ in range(STEPS):
    stored, state, value = step(stored, state, tokens)
    plain, plain_state, expected = plain_step(plain, plain_state, tokens)
    assert float(value) == pytest.approx(float(expected), rel=1e-5)
  chex.assert_trees_all_close(tx.gather(stored), plain, **ROUNDING)
