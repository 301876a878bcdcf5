"""The model every benchmark trains: a pre-norm transformer stack with stacked, scanned layers.

Shared by the benchmark scripts (``setups.py`` trains it in each way they
compare). Nothing here runs a step or touches a device: ``abstract_params`` and
``abstract_batch`` describe the arrays as ``jax.ShapeDtypeStruct`` s, so a
script may compile a step for hardware it does not have.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax

#: The mesh axis the batch is split over and zerojax shards over.
AXIS = "data"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A pre-norm transformer stack with stacked (scanned) layer weights."""

  layers: int
  d_model: int
  heads: int
  vocab: int
  seq: int
  batch: int


#: Model shapes by name. Activation-heavy: long sequences, a large batch and few
#: layers, so activations dominate. Parameter-heavy: deep, a tiny batch of
#: short sequences, and a prime vocabulary (the head's sharded dimension pads
#: from 1021 to 1024), so parameters, gradients and optimizer state dominate.
PRESETS = {
  "activation-heavy": dict(layers=4, d_model=256, heads=4, vocab=1024, seq=64, batch=16),
  "parameter-heavy": dict(layers=12, d_model=256, heads=4, vocab=1021, seq=8, batch=8),
}


def add_model_flags(parser: argparse.ArgumentParser) -> None:
  """Adds the flags that ``model_config`` reads: a preset, and each shape to override it."""
  parser.add_argument("--preset", choices=PRESETS, default="activation-heavy")
  for name in ("layers", "d-model", "heads", "vocab", "seq"):
    parser.add_argument(f"--{name}", type=int, help="default: the preset's")
  parser.add_argument("--batch", type=int, help="global batch (sequences); default: the preset's")


def model_config(args: argparse.Namespace) -> ModelConfig:
  """The ``ModelConfig`` the flags describe: the preset, with any shape flag given instead."""
  given = {k: v for k, v in vars(args).items() if k in PRESETS[args.preset] and v is not None}
  return ModelConfig(**{**PRESETS[args.preset], **given})


def init_params(config: ModelConfig, key: jax.Array) -> dict[str, Any]:
  """Full fp32 parameters: embedding, ``layers`` stacked blocks, final norm, head."""
  d, f, n, v = config.d_model, 4 * config.d_model, config.layers, config.vocab
  keys = jax.random.split(key, 6)

  def normal(key, shape, fan_in):
    return jax.random.normal(key, shape, jnp.float32) / np.sqrt(fan_in)

  return {
    "embed": normal(keys[0], (v, d), 1.0) * 0.02,
    "layers": {
      "norm1": jnp.ones((n, d)),
      "qkv": normal(keys[1], (n, d, 3 * d), d),
      "out": normal(keys[2], (n, d, d), d),
      "norm2": jnp.ones((n, d)),
      "up": normal(keys[3], (n, d, f), d),
      "down": normal(keys[4], (n, f, d), f),
    },
    "norm": jnp.ones((d,)),
    "head": normal(keys[5], (d, v), d),
  }


def abstract_params(config: ModelConfig) -> Any:
  """The shapes and dtypes of ``init_params``'s parameters, as ``jax.ShapeDtypeStruct`` s."""
  return jax.eval_shape(functools.partial(init_params, config), jax.random.key(0))


def parameter_count(params: Any) -> int:
  """Ψ: the number of parameters in ``params`` (arrays or ``jax.ShapeDtypeStruct`` s)."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(params))


def model_parameter_count(config: ModelConfig) -> int:
  """Ψ of the model ``config`` describes, from shapes alone."""
  return parameter_count(abstract_params(config))


def make_batch(
  config: ModelConfig, mesh: jax.sharding.Mesh, axes: Any = AXIS
) -> tuple[jax.Array, jax.Array]:
  """The fixed random ``(tokens, targets)`` batch every step trains on, split over ``axes``."""
  tokens = jax.random.randint(jax.random.key(1), (config.batch, config.seq + 1), 0, config.vocab)
  return jax.device_put((tokens[:, :-1], tokens[:, 1:]), NamedSharding(mesh, P(axes)))


def abstract_batch(
  config: ModelConfig, mesh: jax.sharding.Mesh, axes: Any = AXIS
) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
  """``make_batch``'s ``(tokens, targets)`` as ``jax.ShapeDtypeStruct`` s with their sharding."""
  sharding = NamedSharding(mesh, P(axes))
  tokens = jax.ShapeDtypeStruct((config.batch, config.seq), jnp.int32, sharding=sharding)
  return tokens, tokens


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def _block(layer: dict[str, jax.Array], h: jax.Array, heads: int) -> jax.Array:
  """One causal self-attention + GELU MLP block on ``h`` of shape (batch, seq, d_model)."""
  b, s, d = h.shape
  q, k, v = jnp.split(_rms_norm(h, layer["norm1"]) @ layer["qkv"], 3, axis=-1)
  q, k, v = (t.reshape(b, s, heads, d // heads) for t in (q, k, v))
  # A Python float keeps the compute dtype (a NumPy scalar would promote bf16 to fp32).
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / float(np.sqrt(d // heads))
  scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
  attention = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
  h = h + attention.reshape(b, s, d) @ layer["out"]
  return h + jax.nn.gelu(_rms_norm(h, layer["norm2"]) @ layer["up"]) @ layer["down"]


#: How ``make_loss`` runs the layer stack, by name.
STACKS = {
  "scan": "zerojax.scan, each layer gathered one ahead",
  "scan, prefetch=0": "zerojax.scan gathering each layer in its own iteration",
  "gather": "jax.lax.scan under jax.checkpoint(policy=zerojax.remat_policy), the layer "
  "gathered with one zerojax.gather",
}


def make_loss(
  config: ModelConfig, activations: NamedSharding | None = None, stack: str = "scan"
) -> Callable:
  """The mean next-token cross-entropy ``loss(params, tokens, targets)``.

  The same code runs on full parameters (``zerojax.gather`` passes arrays
  through, ``zerojax.scan`` is ``jax.lax.scan``) and on zerojax shards, where
  each layer is gathered for its iteration and again in the backward pass.

  Args:
    config: the model's shape.
    activations: if given, the residual stream is constrained to this
      sharding before every layer and before the head (GSPMD setups only).
    stack: how the layers run, one of ``STACKS``.
  """

  def constrain(h):
    return h if activations is None else jax.lax.with_sharding_constraint(h, activations)

  def layer_step(h, layer):
    return _block(layer, constrain(h), config.heads), None

  def gathering(gather):
    step = lambda h, layer: layer_step(h, gather(layer))
    return lambda h, layers: jax.lax.scan(
      jax.checkpoint(step, policy=zerojax.remat_policy), h, layers
    )

  # Every value but the gathered weights saved, as the "gather" stack's zerojax.remat_policy does.
  scan = functools.partial(zerojax.scan, layer_step, policy="everything_saveable")
  run = {
    "scan": lambda h, layers: scan(h, layers),
    "scan, prefetch=0": lambda h, layers: scan(h, layers, prefetch=0),
    "gather": gathering(zerojax.gather),
  }[stack]

  def loss(params, tokens, targets):
    h = zerojax.gather(params["embed"])[tokens]
    h, _ = run(h, params["layers"])
    h = _rms_norm(constrain(h), zerojax.gather(params["norm"]))
    logits = (h @ zerojax.gather(params["head"])).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  return loss
