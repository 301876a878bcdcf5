"""The character-level GPT that examples/train_lm.py trains: its modules and sampler.

A decoder-only transformer over bytes (pre-norm RMSNorm, causal multi-head
attention, ReLU MLP, learned positions, tied embeddings) written as Flax Linen
modules. Its layers run under ``zerojax.flax.linen.scan``, so their parameters are
stacked along a leading layer dimension (as ``nn.scan`` stacks them) and, under
ZeRO-3, each layer is gathered one layer ahead of its compute and again in the
backward pass: at most two layers are whole at once. With a pipeline schedule
they run as stages over the mesh's ``stage`` axis (``zerojax.flax.linen.pipeline``,
the same parameters). ``tensor_parallel_specs`` says how Megatron-style tensor
parallelism places the layers' weights, ``pipeline_specs`` how the stages do.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P

import zerojax
import zerojax.flax.linen

from . import configs
from .data import VOCAB

SAMPLE_PROMPT = "def "
SAMPLE_LENGTH = 240
SAMPLE_TEMPERATURE = 0.7


def rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


class Block(nn.Module):
  """One pre-norm transformer layer, in the ``(carry, _) -> (carry, None)`` form of a scan."""

  d_model: int
  n_heads: int
  residual_std: float

  @nn.compact
  def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
    d = self.d_model
    normal = nn.initializers.normal
    norm_attn = self.param("norm_attn", nn.initializers.ones, (d,))
    qkv = self.param("qkv", normal(0.02), (d, 3 * d))
    attn_out = self.param("attn_out", normal(self.residual_std), (d, d))
    norm_mlp = self.param("norm_mlp", nn.initializers.ones, (d,))
    mlp_in = self.param("mlp_in", normal(0.02), (d, 4 * d))
    mlp_out = self.param("mlp_out", normal(self.residual_std), (4 * d, d))
    batch, length, _ = x.shape
    heads = lambda t: t.reshape(batch, length, self.n_heads, d // self.n_heads)
    q, k, v = jnp.split(rms_norm(x, norm_attn) @ qkv, 3, axis=-1)
    attended = jax.nn.dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
    x = x + attended.reshape(batch, length, d) @ attn_out
    return x + jax.nn.relu(rms_norm(x, norm_mlp) @ mlp_in) @ mlp_out, None


class Tables(nn.Module):
  """The parameters outside the layers, returned whole: byte and position embeddings, final norm."""

  d_model: int
  seq_len: int

  @nn.compact
  def __call__(self) -> tuple[jax.Array, jax.Array, jax.Array]:
    normal = nn.initializers.normal
    return (
      self.param("embed", normal(0.02), (VOCAB, self.d_model)),  # tied: also the output layer
      self.param("pos", normal(0.01), (self.seq_len, self.d_model)),
      self.param("norm_out", nn.initializers.ones, (self.d_model,)),
    )


class GPT(nn.Module):
  """A decoder-only transformer over bytes; its layers run under ``zerojax.flax.linen.scan``.

  The tables gather their own parameters when they are called
  (``zerojax.flax.linen.gathered``); the layers arrive gathered, ``prefetch`` layers
  ahead of their compute (``zerojax.scan``). On full parameters (stage 0,
  evaluation) nothing is gathered.
  """

  d_model: int
  n_layers: int
  n_heads: int
  seq_len: int
  prefetch: int = 1
  schedule: str | None = None
  microbatches: int = 1

  @nn.compact
  def __call__(self, tokens: jax.Array, targets: jax.Array | None = None) -> jax.Array:
    """Next-byte logits, shape ``tokens.shape + (VOCAB,)``; with ``targets``, the mean loss.

    With a ``schedule`` the layers run as pipeline stages over the mesh's
    ``stage`` axis (``zerojax.flax.linen.pipeline``, with the same parameters):
    ``"gpipe"`` returns their output to the head; ``"1f1b"`` computes the loss
    in the last stage (so it needs ``targets``).
    """
    embed, pos, norm_out = zerojax.flax.linen.gathered(Tables)(self.d_model, self.seq_len)()
    # A one-hot matmul rather than a gather: its sharding follows the tokens' in
    # every view (a gather under explicit sharding must be told its output's).
    x = jax.nn.one_hot(tokens, VOCAB) @ embed + pos[: tokens.shape[1]]
    residual_std = 0.02 / math.sqrt(2 * self.n_layers)
    block = (self.d_model, self.n_heads, residual_std)
    if self.schedule is None:
      layers = zerojax.flax.linen.scan(Block, length=self.n_layers, prefetch=self.prefetch)
      x, _ = layers(*block, name="layers")(x, None)
    else:
      layers = zerojax.flax.linen.pipeline(
        Block,
        length=self.n_layers,
        microbatches=self.microbatches,
        schedule=self.schedule,
        prefetch=self.prefetch,
      )(*block, name="layers")
      if self.schedule != "gpipe":
        return layers(x, loss_fn=head_loss, loss_params=(embed, norm_out), targets=(targets,))
      x = layers(x)
    return (
      head_loss((embed, norm_out), x, targets) if targets is not None else head(embed, norm_out, x)
    )


def head(embed: jax.Array, norm_out: jax.Array, x: jax.Array) -> jax.Array:
  """Next-byte logits of the last layer's output (the embedding is tied)."""
  return rms_norm(x, norm_out) @ embed.T


def head_loss(tables: tuple[jax.Array, jax.Array], x: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean next-byte cross-entropy, in nats, computed in fp32 whatever the compute dtype."""
  logits = head(*tables, x).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_model(
  preset: configs.Preset,
  seq_len: int,
  prefetch: int = 1,
  schedule: str | None = None,
  microbatches: int = 1,
) -> GPT:
  """The GPT of ``preset``'s size, for windows of ``seq_len`` bytes (pipelined with a schedule)."""
  return GPT(
    preset.d_model, preset.n_layers, preset.n_heads, seq_len, prefetch, schedule, microbatches
  )


def init_params(model: GPT, seed: int) -> dict[str, Any]:
  """GPT-2 style initialisation, as host arrays (placing host arrays needs no compilation)."""
  tokens = np.zeros((1, model.seq_len), np.int32)
  return jax.device_get(jax.jit(model.init)(jax.random.key(seed), tokens)["params"])


def loss_fn(params: dict[str, Any], x: jax.Array, y: jax.Array, model: GPT) -> jax.Array:
  """Mean next-byte cross-entropy, in nats, computed in fp32 whatever the compute dtype."""
  return model.apply({"params": params}, x, y)


def example_losses(params: dict[str, Any], x: jax.Array, y: jax.Array, model: GPT) -> jax.Array:
  """Each window's mean next-byte cross-entropy (shape ``x.shape[:1]``), for evaluating."""
  logits = model.apply({"params": params}, x).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(axis=1)


def sample(
  run: Any, params: Any, model: GPT, key: jax.Array, rows: int = 1, prompt: str = SAMPLE_PROMPT
) -> str:
  """Continues ``prompt`` by ``SAMPLE_LENGTH`` bytes, sampled at ``SAMPLE_TEMPERATURE``.

  ``run`` runs the sampler on the parameters as they are stored (the
  ``forward`` of ``stages.Setup``): ``rows`` continuations at once, split over
  the devices like a batch, row ``r`` drawn from ``fold_in(key, r)``. Returns
  the first, the same whatever ``rows`` is, on every process (each must call it).
  """
  start = len(prompt.encode())
  seq_len = model.seq_len
  buffer = np.zeros(max(seq_len, start + SAMPLE_LENGTH), np.int32)
  buffer[:start] = np.frombuffer(prompt.encode(), np.uint8)

  def generate(params, buffers, keys):  # each device's rows
    def next_byte(i, carry):
      buffers, keys = carry
      end = start + i
      first = jnp.maximum(end - seq_len, 0)
      windows = jax.lax.dynamic_slice_in_dim(buffers, first, seq_len, axis=1)
      logits = model.apply({"params": params}, windows)[:, end - first - 1]
      keys, subkeys = jnp.moveaxis(jax.vmap(jax.random.split)(keys), 1, 0)
      tokens = jax.vmap(jax.random.categorical)(subkeys, logits / SAMPLE_TEMPERATURE)
      return buffers.at[:, end].set(tokens), keys

    return jax.lax.fori_loop(0, SAMPLE_LENGTH, next_byte, (buffers, keys))[0]

  keys = jax.vmap(lambda row: jax.random.fold_in(key, row))(jnp.arange(rows))
  rows_out = jax.jit(run(generate))(params, np.tile(buffer, (rows, 1)), keys)
  # In a multi-process run each process holds only its devices' rows: every process gets all.
  out = np.asarray(multihost_utils.process_allgather(rows_out, tiled=True))
  return out[0, : start + SAMPLE_LENGTH].astype(np.uint8).tobytes().decode("utf-8", "replace")


def pipeline_specs(specs: dict[str, Any], axis: str = "stage") -> dict[str, Any]:
  """``specs`` with the stacked layers' leading dimension on ``axis``: a stage's layers each."""
  on_stages = lambda path, spec: P(axis, *spec[1:]) if path[0].key == "layers" else spec
  return jax.tree_util.tree_map_with_path(on_stages, specs, is_leaf=lambda x: isinstance(x, P))


def tensor_parallel_specs(params: dict[str, Any], axis: str = "model") -> dict[str, Any]:
  """Megatron-style placements over ``axis`` for every parameter (``P()``: replicated).

  Attention's fused ``qkv`` and the MLP's ``mlp_in`` are column-parallel (their
  output dimension split), ``attn_out`` and ``mlp_out`` row-parallel (their
  input dimension split), so each block needs one all-reduce of activations
  forward and one backward per pair; the leading dimension of the stacked
  layers stays whole. Norms and the embeddings stay replicated.
  """
  column, row = P(None, None, axis), P(None, axis, None)
  split = {"qkv": column, "attn_out": row, "mlp_in": column, "mlp_out": row}
  in_layers = lambda path: path[0].key == "layers" and path[-1].key in split
  return jax.tree_util.tree_map_with_path(
    lambda path, _: split[path[-1].key] if in_layers(path) else P(), params
  )
