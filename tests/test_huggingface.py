"""HuggingFace's Flax GPT-2, a model nobody here wrote, trains under zerojax as under plain optax.

Built from a configuration (no download): odd widths (36, 4 heads of 9) and a prime vocabulary
(97), so stage 3 pads leaves; weight decay and clipping read every leaf. And end to end: its
weights saved by HuggingFace, loaded into a scanned zerojax model, trained, exported in
HuggingFace's layout and loaded back by transformers, with the same logits.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
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


# A model from elsewhere, end to end: HuggingFace's weights in, trained under zerojax with its
# layers scanned, and back out in HuggingFace's layout, which transformers loads.

LAYERS = 2


def from_huggingface(hf_params):
  """The zerojax model's parameters from HuggingFace's Flax GPT-2's: the blocks stacked into
  (layers, ...) leaves as ``zerojax.scan`` keeps them, kernels (in, out) as ``nn.Dense`` keeps
  them (HuggingFace's Flax ``Conv1D`` keeps (out, in))."""
  hf = hf_params["transformer"]
  blocks = [hf["h"][str(i)] for i in range(LAYERS)]
  stacked = jax.tree.map(lambda *layers: jnp.stack(layers), *blocks)
  stacked = jax.tree_util.tree_map_with_path(
    lambda path, x: x.swapaxes(1, 2) if path[-1].key == "kernel" else x, stacked
  )
  return {
    "wte": hf["wte"]["embedding"],
    "wpe": hf["wpe"]["embedding"],
    "blocks": stacked,
    "ln_f": hf["ln_f"],
  }


def to_huggingface(params):
  """The inverse of ``from_huggingface``: what HuggingFace's module is called with."""
  blocks = jax.tree_util.tree_map_with_path(
    lambda path, x: x.swapaxes(1, 2) if path[-1].key == "kernel" else x, params["blocks"]
  )
  layers = {str(i): jax.tree.map(lambda x, i=i: x[i], blocks) for i in range(LAYERS)}
  hf = {
    "wte": {"embedding": params["wte"]},
    "wpe": {"embedding": params["wpe"]},
    "h": layers,
    "ln_f": params["ln_f"],
  }
  return {"transformer": hf}


def flax_keys(name):
  """The leaves' names in HuggingFace's Flax files (``save_pretrained`` of a Flax model)."""
  if name.startswith("blocks."):
    names = [f"transformer.h.{i}.{name.removeprefix('blocks.')}" for i in range(LAYERS)]
    return zerojax.FileKey(names, transpose=(1, 0)) if name.endswith(".kernel") else names
  return {"wte": "transformer.wte.embedding", "wpe": "transformer.wpe.embedding"}.get(
    name, f"transformer.{name}"
  )


def torch_keys(name):
  """The leaves' names in HuggingFace's PyTorch files: ``.weight`` for kernels and scales, and
  GPT-2's ``Conv1D`` keeps (in, out), as the zerojax model does."""
  name = name.replace(".kernel", ".weight").replace(".scale", ".weight")
  if name.startswith("blocks."):
    return [f"transformer.h.{i}.{name.removeprefix('blocks.')}" for i in range(LAYERS)]
  return {"wte": "transformer.wte.weight", "wpe": "transformer.wpe.weight"}.get(
    name, f"transformer.{name}"
  )


@pytest.mark.parametrize(
  ("layout", "dtype"), [("flax", None), ("pt", jnp.bfloat16)], ids=["flax-f32", "pytorch-bf16"]
)
def test_huggingface_weights_in_trained_and_back_out(layout, dtype, tmp_path):
  """Exported in the compute dtype (bfloat16 under a bf16 policy), HuggingFace's model loaded
  from the files gives the zerojax model's logits, bit for bit."""
  model, tokens = model_and_batch()
  model.save_pretrained(tmp_path / "in", safe_serialization=True)  # HuggingFace's own writer
  mesh = jax.make_mesh((8,), ("data",))
  precision = None if dtype is None else "bf16"
  tx = zerojax.zero3(optimizer(), mesh=mesh, min_shard_size=1, precision=precision)
  like = jax.eval_shape(from_huggingface, model.params)
  params, state = zerojax.load_safetensors(tmp_path / "in", tx, like, keys=flax_keys, init=True)
  chex.assert_trees_all_equal(tx.gather(params), from_huggingface(model.params))

  loss = lambda params, tokens: next_token_loss(
    model, to_huggingface(zerojax.gather(params)), tokens
  )

  @jax.jit
  def step(params, state, tokens):
    value, grads = zerojax.value_and_grad(loss, tx)(params, tokens)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  for _ in range(STEPS):
    params, state, _ = step(params, state, tokens)
  keys, metadata = (flax_keys, {"format": "flax"}) if layout == "flax" else (torch_keys, None)
  zerojax.export_pretrained(tmp_path / "out", tx, params, keys=keys, dtype=dtype, metadata=metadata)
  model.config.save_pretrained(tmp_path / "out")
  # transformers reads it: Flax's names as its own, PyTorch's through its own conversion.
  loaded = transformers.FlaxGPT2LMHeadModel.from_pretrained(tmp_path / "out")

  # The zerojax model's logits, its parameters in the compute dtype.
  trained = jax.tree.map(lambda x: x if dtype is None else x.astype(dtype), tx.gather(params))
  expected = model(tokens, params=to_huggingface(trained)).logits
  assert not jnp.allclose(expected, model(tokens).logits)  # trained: not the weights it read
  assert loaded.params["transformer"]["wte"]["embedding"].dtype == (dtype or jnp.float32)
  np.testing.assert_array_equal(loaded(tokens).logits, expected)
