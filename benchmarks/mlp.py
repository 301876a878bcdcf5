"""A stack of MLP blocks with stacked (scanned) weights: the accelerator benchmarks' second model.

Each layer is ``h + gelu(h @ up) @ down``, ``up`` of ``d x hidden`` and
``down`` of ``hidden x d``: with ``d = hidden = 4096`` and 16 layers, the
parameter-heavy model that issue 29 measured first; with ``hidden = 16384``
and 56 layers, the 7.5-billion-parameter model of the ZeRO paper's table. Like
``model.py`` it only describes arrays (``jax.ShapeDtypeStruct`` s) and steps,
so a script may compile for hardware it does not have.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from model import AXIS

import zerojax
import zerojax.flax.linen


@dataclasses.dataclass(frozen=True)
class MlpConfig:
  """The stack's shape and the global batch (``tokens`` rows of width ``d``)."""

  layers: int
  d: int
  hidden: int
  tokens: int

  @property
  def layer_bytes(self) -> int:
    """One layer's weights in float32: what a gather makes whole."""
    return 4 * 2 * self.d * self.hidden

  @property
  def parameters(self) -> int:
    return self.layers * 2 * self.d * self.hidden


def abstract_params(config: MlpConfig) -> dict[str, jax.ShapeDtypeStruct]:
  """The float32 parameters, ``up`` and ``down`` with a leading layer axis."""
  shape = (config.layers, config.d, config.hidden)
  return {
    "up": jax.ShapeDtypeStruct(shape, jnp.float32),
    "down": jax.ShapeDtypeStruct((config.layers, config.hidden, config.d), jnp.float32),
  }


def abstract_batch(config: MlpConfig, mesh) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
  """Inputs and targets, ``(tokens, d)`` each, split over ``data``."""
  sharding = NamedSharding(mesh, P(AXIS))
  rows = jax.ShapeDtypeStruct((config.tokens, config.d), jnp.float32, sharding=sharding)
  return rows, rows


def block(h: jax.Array, layer: dict[str, jax.Array], dtype: Any) -> jax.Array:
  """One layer in ``dtype`` (weights cast at use; a no-op when they arrive in it)."""
  up, down = layer["up"].astype(dtype), layer["down"].astype(dtype)
  return h + jax.nn.gelu(h @ up) @ down


#: How ``make_loss`` runs the layer stack, by name.
STACKS = {
  "scan": "zerojax.scan, each layer gathered one ahead",
  "scan, prefetch=0": "zerojax.scan gathering each layer in its own iteration",
  "scan, deferred reductions": "zerojax.scan, each layer's gradient reduced one iteration late",
  "gather": "jax.lax.scan under jax.checkpoint, the layer opened with zerojax.gather",
  "plain": "jax.lax.scan under jax.checkpoint on full (or GSPMD-sharded) weights",
}


def make_loss(
  stack: str, policy: Callable | None, dtype: Any, activations: NamedSharding | None = None
) -> Callable:
  """``loss(params, x, y)``: the mean squared error of the stack, its layers run as ``stack`` says.

  ``policy`` is the ``jax.checkpoint`` policy of every setup (composed with
  ``zerojax.except_gathered`` where zerojax gathers); ``activations``
  constrains the residual stream before each layer (GSPMD setups).
  """

  def layer(h, weights):
    if activations is not None:
      h = jax.lax.with_sharding_constraint(h, activations)
    return block(h, weights, dtype), None

  def run(h, layers):
    if stack == "scan":
      return zerojax.scan(layer, h, layers, policy=policy)
    if stack == "scan, prefetch=0":
      return zerojax.scan(layer, h, layers, prefetch=0, policy=policy)
    if stack == "scan, deferred reductions":
      return zerojax.scan(layer, h, layers, policy=policy, defer_reductions=True)
    if stack == "gather":
      opened = lambda h, weights: layer(h, zerojax.gather(weights))
      body = jax.checkpoint(opened, policy=zerojax.except_gathered(policy), prevent_cse=False)
      return jax.lax.scan(body, h, layers)
    return jax.lax.scan(jax.checkpoint(layer, policy=policy, prevent_cse=False), h, layers)

  def loss(params, x, y):
    h, _ = run(x.astype(dtype), params)
    return jnp.mean((h.astype(jnp.float32) - y) ** 2)

  return loss


class _Block(nn.Module):
  """The layer as a Linen module, for ``zerojax.flax.linen.scan``."""

  d: int
  hidden: int
  dtype: Any

  @nn.compact
  def __call__(self, h, _):
    up = nn.Dense(self.hidden, use_bias=False, dtype=self.dtype, name="up")
    down = nn.Dense(self.d, use_bias=False, dtype=self.dtype, name="down")
    return h + down(jax.nn.gelu(up(h))), None


def flax_model(config: MlpConfig, policy: Callable | None, dtype: Any) -> tuple[Any, Callable]:
  """The stack under ``zerojax.flax.linen.scan``: abstract parameters, ``loss(params, x, y)``."""
  layers = zerojax.flax.linen.scan(_Block, length=config.layers, policy=policy)(
    config.d, config.hidden, dtype
  )
  x = jax.ShapeDtypeStruct((8, config.d), jnp.float32)
  # The key is made inside: on a deviceless TPU no array may be made eagerly.
  init = lambda x: layers.init(jax.random.key(0), x, None)
  params = jax.eval_shape(init, x)["params"]

  def loss(params, x, y):
    h, _ = layers.apply({"params": params}, x.astype(dtype), None)
    return jnp.mean((h.astype(jnp.float32) - y) ** 2)

  return params, loss
