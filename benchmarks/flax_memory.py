"""Stage-3 temporaries of Flax layer stacks, written each way docs/flax.md discusses.

Linen: an 8-layer transformer of width 256 (about 16.8 MB of float32
parameters, one layer 1/8 of it), trained with ``zerojax.zero3(optax.sgd(...))``.
NNX: docs/flax.md's ``Deep`` model (8 residual layers of width 256, 2.2 MB),
trained with ``zerojax.zero3(optax.adamw(...))`` on a batch of 64, with
``zerojax.flax.nnx.value_and_grad(..., gather=False)`` and the default ``gather=True``. For
each, on 8 forced CPU devices, the compiled train step's
``memory_analysis().temp_size_in_bytes`` per device. Nothing runs but the
compiler, so the numbers are exact and repeatable.

Run::

  python benchmarks/flax_memory.py
"""

from __future__ import annotations

import argparse
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import report
import setups
from flax import nnx

import zerojax
import zerojax.flax.linen
import zerojax.flax.nnx

WIDTH, LAYERS, BATCH, SEQ, VOCAB = 256, 8, 16, 8, 13


class Block(nn.Module):
  """Pre-norm single-head attention and MLP, in ``nn.scan``'s ``(carry, x)`` form."""

  @nn.compact
  def __call__(self, h, _):
    q, k, v = jnp.split(nn.Dense(3 * WIDTH, use_bias=False)(nn.RMSNorm()(h)), 3, axis=-1)
    attention = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k) / np.sqrt(WIDTH))
    h = h + nn.Dense(WIDTH, use_bias=False)(attention @ v)
    return h + nn.Dense(WIDTH)(nn.relu(nn.Dense(2 * WIDTH)(nn.RMSNorm()(h)))), None


class Head(nn.Module):
  @nn.compact
  def __call__(self, h):
    return nn.Dense(VOCAB)(nn.RMSNorm()(h))


def scanned(body) -> type[nn.Module]:
  """``nn.scan`` of ``body`` over stacked parameters."""
  return nn.scan(body, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS)


#: The layer stacks measured, by how docs/flax.md names them.
STACKS = {
  "`zerojax.flax.linen.scan(Block, length=n)`": lambda: zerojax.flax.linen.scan(
    Block, length=LAYERS
  ),
  "`zerojax.flax.linen.scan(Block, length=n, prefetch=0)`": lambda: zerojax.flax.linen.scan(
    Block, length=LAYERS, prefetch=0
  ),
  "`nn.scan` of `remat_gathered(Block)`": lambda: scanned(
    zerojax.flax.linen.remat_gathered(Block, prevent_cse=False)
  ),
  "`nn.scan` of `gathered(Block)`, no checkpoint": lambda: scanned(
    zerojax.flax.linen.gathered(Block)
  ),
  "`nn.scan` of `gathered(nn.remat(Block, policy=zerojax.remat_policy))`": lambda: scanned(
    zerojax.flax.linen.gathered(nn.remat(Block, policy=zerojax.remat_policy, prevent_cse=False))
  ),
  "`nn.scan` of `nn.remat(gathered(Block))` (Flax's default policy)": lambda: scanned(
    nn.remat(zerojax.flax.linen.gathered(Block), prevent_cse=False)
  ),
}


def model(stack) -> nn.Module:
  """The transformer with its layers run by ``stack``."""

  class Transformer(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = zerojax.flax.linen.gathered(nn.Embed)(VOCAB, WIDTH)(x)
      h, _ = stack()(name="layers")(h, None)
      return zerojax.flax.linen.gathered(Head)()(h)

  return Transformer()


def temporaries(stack, mesh) -> tuple[float, float]:
  """The compiled step's temporaries, and the model's bytes (both per device, in bytes)."""
  transformer = model(stack)
  tokens = jnp.zeros((BATCH, SEQ), jnp.int32)
  params = jax.jit(transformer.init)(jax.random.key(0), tokens)["params"]
  tx = zerojax.zero3(optax.sgd(0.1), mesh=mesh, min_shard_size=64)
  placed, state = tx.shard(params), tx.init(tx.shard(params))

  def loss_fn(params, x, y):
    logits = transformer.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def step(params, state, x, y):
    _, grads = zerojax.value_and_grad(loss_fn, tx)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  compiled = jax.jit(step).lower(placed, state, tokens, tokens).compile()
  model_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  return compiled.memory_analysis().temp_size_in_bytes, model_bytes


class NnxBlock(nnx.Module):
  def __init__(self, width, rngs):
    self.norm = nnx.RMSNorm(width, rngs=rngs)
    self.linear = nnx.Linear(width, width, rngs=rngs)

  def __call__(self, h):
    return h + nnx.relu(self.linear(self.norm(h)))


class Deep(nnx.Module):
  """docs/flax.md's NNX model: its layers run under ``zerojax.flax.nnx.scan``."""

  def __init__(self, width, layers, rngs):
    self.inp = nnx.Linear(64, width, rngs=rngs)
    self.layers = nnx.vmap(NnxBlock, in_axes=(None, 0))(width, rngs.split(layers))
    self.out = nnx.Linear(width, 10, rngs=rngs)

  def __call__(self, x):
    h = zerojax.flax.nnx.gathered(self.inp)(x)
    h, _ = zerojax.flax.nnx.scan(lambda block, h, _: (block(h), None), self.layers, h)
    return zerojax.flax.nnx.gathered(self.out)(h)


def nnx_temporaries(gather: bool, mesh) -> float:
  """The NNX step's temporaries, per device, in bytes."""
  tx = zerojax.zero3(optax.adamw(1e-3), mesh=mesh)
  with jax.set_mesh(mesh):
    model = Deep(WIDTH, LAYERS, nnx.Rngs(0))
    nnx.update(model, tx.shard(nnx.state(model, nnx.Param)))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  def loss_fn(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

  @nnx.jit
  def step(model, optimizer, x, y):
    loss, grads = zerojax.flax.nnx.value_and_grad(loss_fn, tx, gather=gather)(model, x, y)
    optimizer.update(model, grads)
    return loss

  x, y = jnp.zeros((64, 64)), jnp.zeros((64,), jnp.int32)
  return step.lower(model, optimizer, x, y).compile().memory_analysis().temp_size_in_bytes


def main(argv: list[str] | None = None) -> list[dict]:
  """Prints the tables of temporaries."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.parse_args(sys.argv[1:] if argv is None else argv)
  mesh = setups.flat_mesh(setups.use_devices(8))
  rows = []
  for name, stack in STACKS.items():
    temp, model_bytes = temporaries(stack, mesh)
    layer = model_bytes / LAYERS
    rows.append({"stack": name, "temp": temp / 1e6, "layers": temp / layer})
  columns = {"stack": ("layer stack", "s"), "temp": ("temporaries MB", ".1f")}
  print(f"model {model_bytes / 1e6:.1f} MB, one layer {layer / 1e6:.2f} MB, per device:")
  print(report.table(rows, columns | {"layers": ("in layers", ".1f")}))
  nnx_rows = [
    {
      "stack": f"`zerojax.flax.nnx.value_and_grad(..., gather={gather})`",
      "temp": nnx_temporaries(gather, mesh) / 1e6,
    }
    for gather in (False, True)
  ]
  print("\nNNX, docs/flax.md's Deep(256, 8), per device:")
  print(report.table(nnx_rows, columns))
  return rows + nnx_rows


if __name__ == "__main__":
  main()
