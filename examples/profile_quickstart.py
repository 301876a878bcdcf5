"""Profile README's quickstart step: per-device memory and collectives, without running it.

Run: python examples/profile_quickstart.py
"""

import jax
import jax.numpy as jnp
import optax

import zerojax

zerojax.distributed.use_cpu_devices(8)
mesh = jax.make_mesh((8,), ("data",))
tx = zerojax.zero3(optax.adamw(3e-4), mesh=mesh)
params = tx.shard({"w": jnp.zeros((512, 512)), "layers": jnp.zeros((4, 512, 512))})
opt_state = tx.init(params)


def loss_fn(params, x, y):
  h = x @ zerojax.gather(params["w"])

  def layer(h, w):
    return jnp.tanh(h @ zerojax.gather(w)), None

  layer = jax.checkpoint(layer, policy=zerojax.remat_policy)
  h, _ = jax.lax.scan(layer, h, params["layers"])
  return jnp.mean((h - y) ** 2)


@jax.jit
def train_step(params, opt_state, x, y):
  loss, grads = zerojax.value_and_grad(loss_fn, tx)(params, x, y)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


x = y = jnp.ones((64, 512))
print(zerojax.diagnostics.profile(train_step, params, opt_state, x, y))
