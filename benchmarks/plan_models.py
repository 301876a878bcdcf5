"""Programs for ``benchmarks/plan.py``: the seeds' transformers as ``zerojax.planning.Program`` s.

The pieces are ``transformer.py`` 's, as ``transformer.per_example_loss``
strings them for zerojax: the embedding and head open their parameters with
``zerojax.gather``, the layer is ``transformer.layer`` (bfloat16 compute,
its activations named with ``transformer.NAMES`` so ``remat="names"``
applies). Defined at the top level so the planner's workers import them
(``"plan_models:SEVEN_B"``); ``init`` builds zeros, since the planner only
reads its shapes.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
import transformer

import zerojax


def _init(config: transformer.Config, key: jax.Array) -> dict[str, Any]:
  del key
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), transformer.abstract_params(config))


def _embed(params: dict[str, Any], batch: dict[str, jax.Array]) -> jax.Array:
  return zerojax.gather(params["embed"]).astype(jnp.bfloat16)[batch["tokens"][:, :-1]]


def _layer(config: transformer.Config, h: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
  return transformer.layer(config, h, w)


def _head(params: dict[str, Any], h: jax.Array, batch: dict[str, jax.Array]) -> jax.Array:
  outer = zerojax.gather({"norm": params["norm"], "head": params["head"]})
  normed = transformer.rms_norm(h, outer["norm"])
  logits = (normed @ outer["head"].astype(jnp.bfloat16)).astype(jnp.float32)
  targets = batch["tokens"][:, 1:]
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def _batch(config: transformer.Config, examples: int) -> dict[str, jax.ShapeDtypeStruct]:
  return {"tokens": jax.ShapeDtypeStruct((examples, config.seq_len + 1), jnp.int32)}


def program(size: str) -> zerojax.planning.Program:
  """``transformer.CONFIGS[size]`` as a program: AdamW, bfloat16 compute, named activations."""
  config = transformer.CONFIGS[size]
  return zerojax.planning.Program(
    init=functools.partial(_init, config),
    embed=_embed,
    layer=functools.partial(_layer, config),
    head=_head,
    batch=functools.partial(_batch, config),
    optimizer=optax.adamw(1e-4),
    precision="bf16",
    names=transformer.NAMES,
    tokens_per_example=config.seq_len,
    name=f"transformer {size}",
  )


#: The seeds' 7.5B transformer (30 layers, d 4096, 2048-token sequences).
SEVEN_B = program("7.5B")
#: Llama-2-70B's shape (80 layers, d 8192, grouped-query attention, MLP 28672).
SEVENTY_B = program("70B")
#: The programs ``benchmarks/plan.py`` plans, by the name its ``--model`` takes.
PROGRAMS = {"7.5B": "SEVEN_B", "70B": "SEVENTY_B"}
