"""A tiny model for the planner's tests: a token embedding, four MLP layers, a softmax head.

The layer closes over a module-level table and names its hidden activation,
so every ``Setup.remat`` applies; 31 is prime, so no mesh axis divides it.
"""

import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name

import zerojax

VOCAB, D, HIDDEN, LAYERS, SEQUENCE = 31, 64, 256, 4, 16
SCALE = jnp.linspace(0.5, 1.5, D)  # closed over by every layer


def init(key):
  keys = jax.random.split(key, 4)
  normal = lambda k, *shape: jax.random.normal(k, shape) / shape[-2] ** 0.5
  return {
    "embedding": normal(keys[0], VOCAB, D),
    "layers": {
      "up": normal(keys[1], LAYERS, D, HIDDEN),
      "down": normal(keys[2], LAYERS, HIDDEN, D),
    },
    "out": normal(keys[3], D, VOCAB),
  }


def embed(params, batch):
  return zerojax.gather(params["embedding"])[batch["tokens"]]


def layer(h, w):
  hidden = checkpoint_name(jax.nn.gelu((h * SCALE) @ w["up"]), "hidden")
  return h + hidden @ w["down"]


def head(params, h, batch):
  logits = h @ zerojax.gather(params["out"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def batch(examples):
  tokens = jax.ShapeDtypeStruct((examples, SEQUENCE), jnp.int32)
  return {"tokens": tokens, "targets": tokens}


TINY = zerojax.planning.Program(
  init=init,
  embed=embed,
  layer=layer,
  head=head,
  batch=batch,
  optimizer=optax.adamw(1e-3),
  names=("hidden",),
  tokens_per_example=SEQUENCE,
  name="tiny",
)
