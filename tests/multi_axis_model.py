"""A Megatron-style scanned MLP stack for multi-axis meshes (hybrid sharding, tensor parallelism).

``w1`` is split over ``model`` on its output dimension (column-parallel), ``w2``
on its input dimension (row-parallel), the stacked bias on ``model`` (whose only
non-leading dimension is taken, so the data axis joins it); the head is
replicated and ``odd`` has prime dimensions, so it is padded.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax
from tests.helpers import STAGES

LAYERS, WIDTH, HIDDEN, BATCH = 2, 32, 128, 16
# Small leaves shard too, so that every kind of leaf takes the data axes.
MIN_SHARD_SIZE = 64

MESHES = {
  "hsdp": ((2, 4), ("replica", "data")),
  "tensor": ((4, 2), ("data", "model")),
  "both": ((2, 2, 2), ("replica", "data", "model")),
}
TENSOR_PARALLEL = {
  "layers": {"w1": P(None, None, "model"), "b": P(None, "model"), "w2": P(None, "model", None)},
  "head": P(),
  "odd": P(),
}


def make_params() -> dict:
  rng = np.random.default_rng(0)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[-2]), jnp.float32)
  return {
    "layers": {
      "w1": normal(LAYERS, WIDTH, HIDDEN),
      "b": jnp.asarray(rng.normal(size=(LAYERS, HIDDEN)) * 0.1, jnp.float32),
      "w2": normal(LAYERS, HIDDEN, WIDTH),
    },
    "head": normal(WIDTH, 13),
    "odd": normal(7, 11),  # prime dimensions: padded
  }


def make_batch():
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(BATCH, WIDTH)), jnp.float32)
  return x, jnp.asarray(rng.normal(size=(BATCH, 13)), jnp.float32)


def loss_fn(params, x, y):
  top = zerojax.gather({k: v for k, v in params.items() if k != "layers"})

  def layer(h, weights):
    weights = zerojax.gather(weights)  # column- then row-parallel: plain jnp
    return h + jax.nn.gelu(h @ weights["w1"] + weights["b"]) @ weights["w2"], None

  h, _ = jax.lax.scan(jax.checkpoint(layer, policy=zerojax.remat_policy), x, params["layers"])
  out = h @ top["head"] + jnp.sum(top["odd"]) * 0.01
  return jnp.mean((out - y) ** 2)


def optimizer():
  return optax.adam(1e-2)


def make_mesh(name: str):
  shape, names = MESHES[name]
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def placed_params(mesh):
  """The parameters, on ``model`` as tensor parallelism places them where the mesh has it."""
  specs = (
    TENSOR_PARALLEL if "model" in mesh.axis_names else jax.tree.map(lambda _: P(), make_params())
  )
  return jax.tree.map(
    lambda p, spec: jax.device_put(p, NamedSharding(mesh, spec)),
    make_params(),
    specs,
    is_leaf=lambda x: isinstance(x, P),
  )


def replica_axis(mesh):
  return "replica" if "replica" in mesh.axis_names else None


def batch_on(mesh):
  axes = tuple(a for a in ("replica", "data") if a in mesh.axis_names)
  return jax.device_put(make_batch(), NamedSharding(mesh, P(axes)))


def make_tx(stage: int, mesh, **kwargs):
  return STAGES[stage](
    optimizer(),
    mesh=mesh,
    replica_axis=replica_axis(mesh),
    min_shard_size=MIN_SHARD_SIZE,
    **kwargs,
  )
