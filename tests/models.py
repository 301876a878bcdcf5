"""A small model with awkward leaves, and the reference training loop."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import zerojax

BATCH = 32


def make_params(seed: int = 0) -> dict:
  """Leaves chosen to be awkward: a scalar, no dim divisible by 8, stacked layers, ints."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[-2]), jnp.float32)
  return {
    "embed": normal(12, 40),
    "layers": {
      "w": normal(3, 40, 40),
      "b": jnp.asarray(rng.normal(size=(3, 40)) * 0.1, jnp.float32),
    },
    "head": normal(40, 13),  # 13 is prime: padded to 16 once sharded
    "odd": normal(7, 5),
    "scale": jnp.asarray(1.3, jnp.float32),
  }


def make_batch(seed: int = 1):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(BATCH, 12)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(BATCH, 13)), jnp.float32)
  return x, y


def poisoned_batch(device: int = 3, devices: int = 8):
  """``make_batch()`` with an inf in the rows of one of ``devices`` devices only."""
  x, y = make_batch()
  rows = BATCH // devices
  return x.at[device * rows, 0].set(jnp.inf), y


def loss_fn(params, x, y):
  """Mean squared error of a scanned MLP. ``zerojax.gather`` is a no-op on full arrays."""
  top = zerojax.gather({k: v for k, v in params.items() if k != "layers"})
  h = x @ top["embed"]

  def layer(h, weights):
    weights = zerojax.gather(weights)
    return jnp.tanh(h @ weights["w"] + weights["b"]), None

  h, _ = jax.lax.scan(jax.checkpoint(layer, policy=zerojax.remat_policy), h, params["layers"])
  out = (h @ top["head"]) * top["scale"]
  out = out + jnp.sum(top["odd"]) * 0.01
  return jnp.mean((out - y) ** 2)


def reference(inner, params, batch, steps):
  """``steps`` steps of plain optax on one device with the whole batch."""
  device = jax.devices()[0]
  params, batch = jax.device_put((params, batch), device)
  state = inner.init(params)

  @jax.jit
  def step(params, state, batch):
    grads = jax.grad(loss_fn)(params, *batch)
    updates, state = inner.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for _ in range(steps):
    params, state = step(params, state, batch)
  return params


def explicit_step(tx):
  @jax.jit
  def step(params, state, *batch):
    loss, grads = zerojax.value_and_grad(loss_fn, tx)(params, *batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  return step


def drop_in_step(tx):
  @jax.jit
  def step(params, state, *batch):
    loss, grads = jax.value_and_grad(loss_fn)(tx.unpad(params), *batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  return step


def train(tx, params, batch, steps, path="explicit"):
  """``steps`` steps with a zerojax transformation; returns full params."""
  params = tx.shard(params)
  state = tx.init(params)
  step = explicit_step(tx) if path == "explicit" else drop_in_step(tx)
  for _ in range(steps):
    params, state, _ = step(params, state, *batch)
  return tx.gather(params)
