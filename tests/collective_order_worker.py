"""Trains a parameter-heavy model with zerojax.value_and_grad, in its own process.

A deep stack of wide scanned layers with a small batch, plus leaves used after
the stack whose dimensions are prime: the program that made XLA:CPU abort in
its collective rendezvous before zerojax ordered the collectives around loops
(see docs/troubleshooting.md). Run by zerojax's ordering tests, or by hand:

  python tests/collective_order_worker.py --stage 2 --steps 30

The same worker with the fix switched off, to measure how often the abort
happens without it, is the ordering module's own test run as a script, with
the same flags (docs/troubleshooting.md). Prints ``ok <loss>`` and exits 0
when every step ran.
``--memory`` prints the compiled step's temporaries instead of training, to
measure what the fix costs.
"""

import argparse
import functools
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax

zerojax.distributed.use_cpu_devices(8)


def make_params() -> dict:
  keys = jax.random.split(jax.random.key(0), 3)
  return {
    "layers": {"w": 0.02 * jax.random.normal(keys[0], (16, 512, 512))},
    "proj": 0.02 * jax.random.normal(keys[1], (512, 509)),
    "odd": 0.02 * jax.random.normal(keys[2], (509, 1021)),
  }


def loss_fn(params, x):
  def layer(h, weights):
    return jnp.tanh(h @ zerojax.gather(weights)["w"]), None

  h, _ = jax.lax.scan(jax.checkpoint(layer), x, params["layers"])
  return jnp.mean((h @ zerojax.gather(params["proj"]) @ zerojax.gather(params["odd"])) ** 2)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--microbatches", type=int, default=1)
  parser.add_argument("--memory", action="store_true")
  args = parser.parse_args()

  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  tx = getattr(zerojax, f"zero{args.stage}")(optax.adam(1e-3), mesh=mesh)
  params = tx.shard(jax.tree.map(np.asarray, make_params()))
  state = tx.init(params)
  grad_fn = zerojax.value_and_grad(loss_fn, tx, microbatches=args.microbatches)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, x):
    loss, grads = grad_fn(params, x)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  x = jax.device_put(np.ones((64, 512), np.float32), NamedSharding(mesh, P("data")))
  if args.memory:
    temporaries = step.lower(params, state, x).compile().memory_analysis().temp_size_in_bytes
    print(f"temporaries {temporaries / 1e6:.1f} MB", flush=True)
    return
  for _ in range(args.steps):
    params, state, loss = step(params, state, x)
    loss.block_until_ready()
  print("ok", float(loss), flush=True)


if __name__ == "__main__":
  main()
