"""Compiles a small zero3 step for 2 nodes of 8 H100 and reports its bytes per mesh axis.

Run by tests/test_nodes.py in a process of its own, started with
``zerojax.diagnostics.deviceless_environment("h100x16")`` (the compilers read
it when they load): ``python tests/nodes_worker.py OUT.json SETUP...``. Each
setup is ``zerojax.zero3`` over a ``node=2 x data=8`` mesh with the options
``SETUPS`` names; it writes ``count_collectives_by_axes``'s bytes of the
compiled step, by the axes each collective spans, the number of all-gathers
across both axes, how many reductions in the backward layer loop wait on its
own iteration's compute, and the model's bytes.
"""

import json
import sys

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax
from zerojax.diagnostics import deviceless_mesh

LAYERS, D, F, TOKENS = 4, 2048, 4096, 16 * 256  # 32 MiB matrices: above XLA's combiner
AXES = ("node", "data")
SETUPS = {
  "zero3": dict(axis_name=AXES),
  "qgZ": dict(axis_name=AXES, quantized_gradients="int8"),
  "hpZ+qwZ+qgZ": dict(
    axis_name=AXES, secondary_axis="data", quantized_weights="int8", quantized_gradients="int8"
  ),
}


def compiled_step(mesh, options):
  tx = zerojax.zero3(optax.adam(1e-3), mesh=mesh, **options)
  full = {
    "up": jax.ShapeDtypeStruct((LAYERS, D, F), jnp.float32),
    "down": jax.ShapeDtypeStruct((LAYERS, F, D), jnp.float32),
  }
  place = lambda tree, shardings: jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
  )
  params = place(jax.eval_shape(tx.shard, full), tx.param_shardings(full))
  state = place(jax.eval_shape(tx.init, params), tx.state_shardings(full))
  x = jax.ShapeDtypeStruct((TOKENS, D), jnp.float32, sharding=NamedSharding(mesh, P(AXES)))
  block = lambda h, w: (h + jax.nn.gelu(h @ w["up"]) @ w["down"], None)

  def loss(params, x):
    h, _ = zerojax.scan(block, x, params, policy=jax.checkpoint_policies.dots_saveable)
    return jnp.mean(h**2)

  def step(params, state, x):
    value, grads = zerojax.value_and_grad(loss, tx)(params, x)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  return jax.jit(step, donate_argnums=(0, 1)).lower(params, state, x).compile()


def main():
  out, names = sys.argv[1], sys.argv[2:]
  mesh = deviceless_mesh("h100x16", (2, 8), AXES, (AxisType.Explicit,) * 2)
  results = {"model_bytes": 4 * LAYERS * 2 * D * F}
  for name in names:
    compiled = compiled_step(mesh, SETUPS[name])
    counted = zerojax.diagnostics.count_collectives_by_axes(compiled.as_text(), mesh)
    *_, backward = [loop for loop in zerojax.diagnostics.loop_collectives(compiled) if loop.gathers]
    results[name] = {
      "by_axes": {
        " ".join(axes): {kind: c.bytes for kind, c in kinds.items() if c.count}
        for axes, kinds in counted.items()
      },
      "gathers_across": counted[AXES]["all-gather"].count,
      "backward_waiting_reductions": backward.waiting_reductions,
    }
  with open(out, "w") as f:
    json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
