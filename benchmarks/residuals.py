"""Temporaries of one bf16 MLP stack's gradient step, zerojax stage 3 beside GSPMD FSDP, deviceless.

16 layers of 2048 -> 8192 -> 2048 with biases, float32 master parameters split over 8
devices, bfloat16 compute. SETUP: ``zero3`` (``precision="bf16"``: float32 reductions),
``zero3-p0`` (the same with ``prefetch=0``), ``zero3-bf16red`` (bfloat16 reductions),
``gspmd`` (``jax.lax.scan`` of the same layer on parameters annotated as zerojax stores
them, each cast to bfloat16 at use, the residual stream constrained to the batch: GSPMD
reduces the bfloat16 matmuls' gradients in bfloat16). VARIANT: ``plain`` (the layer as is,
every value kept on both sides), ``full`` (``jax.checkpoint(layer)``), ``dots``. TOKENS: a
device's tokens (2048). ``--dump=DIR`` writes XLA's buffer assignment (read it with
``benchmarks/buffers.py``'s ``read_dump``). On an ``h100x8`` target it prints XLA:GPU's
estimate too.

  python benchmarks/residuals.py v5e-8 gspmd full --dump=/tmp/gspmd
  python benchmarks/residuals.py v5e-8 zero3 full --dump=/tmp/zero3
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from zerojax.diagnostics import deviceless_environment

LAYERS, D, HIDDEN = 16, 2048, 8192


def arguments() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("target", help="a deviceless target: v5e-8, h100x8, ...")
  parser.add_argument("setup", choices=("zero3", "zero3-p0", "zero3-bf16red", "gspmd"))
  parser.add_argument("variant", choices=("plain", "full", "dots"))
  parser.add_argument("tokens", type=int, nargs="?", default=2048)
  parser.add_argument("--dump", help="a directory for XLA's dumps (buffer assignment)")
  return parser.parse_args()


def main() -> None:
  args = arguments()
  if os.environ.get("_DEVICELESS") != "1":  # compile in a process of the target's environment
    flags = f"--xla_dump_to={args.dump} --xla_dump_hlo_as_text" if args.dump else ""
    gpu = args.target.startswith("h100")
    target_env = deviceless_environment(args.target, scheduler_log=gpu, xla_flags=flags)
    environment = {**os.environ, **target_env, "_DEVICELESS": "1"}
    os.execve(sys.executable, [sys.executable, *sys.argv], environment)
  print(json.dumps(measure(args)))


def measure(args: argparse.Namespace) -> dict:
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  import zerojax

  gspmd = args.setup == "gspmd"
  axis_types = (AxisType.Auto,) if gspmd else None
  mesh = zerojax.diagnostics.deviceless_mesh(args.target, (8,), ("data",), axis_types)
  precision = "bf16"
  if args.setup == "zero3-bf16red":
    precision = zerojax.Precision(params="float32", compute="bfloat16", reduce="bfloat16")
  tx = zerojax.zero3(optax.adamw(1e-3), mesh=mesh, precision=precision)
  shape = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.float32)
  abstract = {
    "w1": shape(LAYERS, D, HIDDEN),
    "b1": shape(LAYERS, HIDDEN),
    "w2": shape(LAYERS, HIDDEN, D),
    "b2": shape(LAYERS, D),
  }
  batch = NamedSharding(mesh, P("data"))
  x = jax.ShapeDtypeStruct((8 * args.tokens, D), jnp.float32, sharding=batch)

  def layer(h, w):
    return h + jax.nn.gelu(h @ w["w1"] + w["b1"]) @ w["w2"] + w["b2"], None

  def kept(f):
    return {
      "plain": f,
      "full": jax.checkpoint(f),
      "dots": jax.checkpoint(f, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
    }[args.variant]

  if gspmd:
    spec = lambda plan: NamedSharding(mesh, P(*plan.layout.spec))
    params = jax.tree.map(
      lambda s, plan: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=spec(plan)),
      abstract,
      tx.param_shardings(abstract),
    )

    def cast_layer(h, w):
      h = jax.lax.with_sharding_constraint(h, batch)
      return layer(h, jax.tree.map(lambda a: a.astype(jnp.bfloat16), w))

    scan = lambda h, p: jax.lax.scan(kept(cast_layer), h, p)
    out_shardings = (NamedSharding(mesh, P()), jax.tree.map(lambda s: s.sharding, params))
    step = jax.jit(jax.value_and_grad(lambda p, x: loss(scan, p, x)), out_shardings=out_shardings)
  else:
    params = jax.eval_shape(tx.shard, abstract)
    prefetch = 0 if args.setup == "zero3-p0" else 1
    # "plain" keeps every value, as jax.lax.scan of the plain layer does on the GSPMD side.
    policy = "everything_saveable" if args.variant == "plain" else None
    scan = lambda h, p: zerojax.scan(kept(layer), h, p, prefetch=prefetch, policy=policy)
    step = jax.jit(zerojax.value_and_grad(lambda p, x: loss(scan, p, x), tx))
  with zerojax.diagnostics.capture_stderr() as log, jax.set_mesh(mesh):
    compiled = step.lower(params, x).compile()
  memory = compiled.memory_analysis()
  mib = lambda size: round(size / 2**20, 1)
  out = {
    "target": args.target,
    "setup": args.setup,
    "variant": args.variant,
    "T": args.tokens,
    "temp_MiB": mib(memory.temp_size_in_bytes),
    "arg_MiB": mib(memory.argument_size_in_bytes),
    "out_MiB": mib(memory.output_size_in_bytes),
  }
  if args.target.startswith("h100"):
    estimate = zerojax.diagnostics.scheduler_estimate(log[0], compiled)
    out |= {"cycles": estimate.cycles, "wasted": estimate.wasted, "silent": list(estimate.silent)}
  return out


def loss(scan, params, x):
  import jax.numpy as jnp

  h, _ = scan(x.astype(jnp.bfloat16), params)
  return jnp.mean(h.astype(jnp.float32) ** 2)


if __name__ == "__main__":
  main()
