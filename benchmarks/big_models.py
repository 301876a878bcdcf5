"""Models no chip holds: their init and evaluation programs, compiled for a TPU v5e 8 x 8.

The ZeRO paper's 7.5B model (56 layers of 4096 -> 16384 -> 4096, float32
master weights, Adam) on 64 chips of 16 GiB, compiled deviceless (nothing
runs): per chip, what each program needs.

* ``zero3 sharded_init``: ``tx.sharded_init(init_fn)``, the parameters and
  Adam's state made straight into shards;
* ``GSPMD FSDP init``: ``jax.jit(init, out_shardings=...)`` of the same
  parameters and state placed as FSDP places them (MaxText's way), on a mesh of
  ``Auto`` axes and of explicit ones;
* ``zero3 forward``: ``zerojax.forward`` of the stack's per-example loss,
  2048 tokens a chip, each layer gathered one ahead by ``zerojax.scan``;
* ``evaluate on tx.gather``: the same loss on the whole model, gathered.

Run::

  python benchmarks/big_models.py --markdown docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import mlp
import optax
import report
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax
from zerojax.diagnostics import deviceless_environment, deviceless_mesh, deviceless_target

GIB = 2**30
TARGET = "v5e-64"
CONFIG = mlp.MlpConfig(layers=56, d=4096, hidden=16384, tokens=2048 * 64)
SETUPS = (
  "zero3 sharded_init",
  "GSPMD FSDP init, Auto axes",
  "GSPMD FSDP init, explicit axes",
  "zero3 forward",
  "evaluate on tx.gather",
)


def init_fn(key: jax.Array) -> dict[str, jax.Array]:
  """The stack's float32 parameters, drawn from ``key``."""
  up, down = jax.random.split(key)
  shapes = mlp.abstract_params(CONFIG)
  return {
    "up": jax.random.normal(up, shapes["up"].shape) * CONFIG.d**-0.5,
    "down": jax.random.normal(down, shapes["down"].shape) * CONFIG.hidden**-0.5,
  }


def per_example_loss(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  """Each row's mean square after the stack, its layers in bfloat16, one gathered at a time."""
  layer = lambda h, w: (mlp.block(h, w, jnp.bfloat16), None)
  h, _ = zerojax.scan(layer, x.astype(jnp.bfloat16), params)
  return jnp.mean(h.astype(jnp.float32) ** 2, axis=-1)


def compile_one(name: str) -> dict[str, float | str]:
  """The per-chip bytes of ``name``'s program, or why it does not compile (fit)."""
  mesh = deviceless_mesh(TARGET, (64,), ("data",), (AxisType.Explicit,))
  tx = zerojax.zero3(optax.adam(1e-3), mesh=mesh)
  # Abstract only: nothing can be placed on the devices compiled for.
  key_type = jax.eval_shape(lambda: jax.random.key(0))
  key = jax.ShapeDtypeStruct((), key_type.dtype, sharding=NamedSharding(mesh, P()))
  abstract = jax.eval_shape(init_fn, key_type)
  x = jax.ShapeDtypeStruct(
    (CONFIG.tokens, CONFIG.d), jnp.float32, sharding=NamedSharding(mesh, P("data"))
  )
  params = jax.tree.map(
    lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
    jax.eval_shape(tx.shard, abstract),
    tx.param_shardings(abstract),
  )
  try:
    with jax.set_mesh(mesh):
      if name == "zero3 sharded_init":
        lowered = tx.sharded_init(init_fn).lower(key)
      elif name.startswith("GSPMD FSDP init"):
        lowered = fsdp_init(key_type, AxisType.Auto if "Auto" in name else AxisType.Explicit)
      elif name == "zero3 forward":
        lowered = jax.jit(zerojax.forward(per_example_loss, tx)).lower(params, x)
      else:
        evaluate = lambda params, x: per_example_loss(tx.gather(params), x)
        lowered = jax.jit(evaluate).lower(params, x)
      memory = lowered.compile().memory_analysis()
  except Exception as error:  # XLA refuses a program that does not fit the chip
    return {"error": str(error).splitlines()[0][:200]}
  return {
    "arguments": memory.argument_size_in_bytes / GIB,
    "outputs": memory.output_size_in_bytes / GIB,
    "temporaries": memory.temp_size_in_bytes / GIB,
  }


def fsdp_init(key_type: jax.ShapeDtypeStruct, axis_type: AxisType) -> jax.stages.Lowered:
  """MaxText's way: ``jax.jit(init, out_shardings=...)``, the parameters and Adam's moments
  split along their last dimension (on explicit axes, values traced without a sharding are
  whole on every chip)."""
  mesh = deviceless_mesh(TARGET, (64,), ("data",), (axis_type,))
  fresh = lambda key: (lambda params: (params, optax.adam(1e-3).init(params)))(init_fn(key))
  split = lambda s: NamedSharding(mesh, P(*[None] * (s.ndim - 1), "data") if s.ndim else P())
  shardings = jax.tree.map(split, jax.eval_shape(fresh, key_type))
  key = jax.ShapeDtypeStruct((), key_type.dtype, sharding=NamedSharding(mesh, P()))
  with jax.set_mesh(mesh):
    return jax.jit(fresh, out_shardings=shardings).lower(key)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--child", help=argparse.SUPPRESS)
  report.add_output_flags(parser)
  args = parser.parse_args()
  if args.child:
    results = {name: compile_one(name) for name in SETUPS}
    Path(args.child).write_text(json.dumps(results))
    return
  clock = report.Clock()
  with tempfile.NamedTemporaryFile(suffix=".json") as out:
    env = {**os.environ, **deviceless_environment(TARGET)}
    command = [sys.executable, os.path.abspath(__file__), "--child", out.name]
    subprocess.run(command, env=env, check=True)
    results = json.loads(Path(out.name).read_text())
  key_type = jax.eval_shape(lambda: jax.random.key(0))
  psi = sum(s.size for s in jax.tree.leaves(jax.eval_shape(init_fn, key_type)))
  hbm = deviceless_target(TARGET).hbm_bytes / GIB
  keys = ("arguments", "outputs", "temporaries")
  rows = [
    {
      "setup": name,
      **{k: f"{r[k]:.2f}" if k in r else "-" for k in keys},
      "note": r.get("error", ""),
    }
    for name, r in results.items()
  ]
  text = "\n".join(
    [
      *report.section(
        f"{psi / 1e9:.1f}B parameters on a TPU v5e 8 x 8 ({hbm:.0f} GiB a chip), GiB per chip",
        f"ZeRO-3 with Adam, float32 parameters and state: 3 x 4 bytes a parameter, "
        f"{12 * psi / 64 / GIB:.2f} GiB a chip once split 64 ways.",
        report.table(rows, {k: (k, "") for k in ("setup", *keys, "note")}),
      ),
      report.accelerator_provenance(clock),
      "",
      *report.command("big_models.py", sys.argv[1:]),
    ]
  )
  print(text)
  if args.markdown:
    begin = "<!-- results: big_models.py v5e-64 -->"
    report.write_markdown(args.markdown, text, begin, "Benchmarks")


if __name__ == "__main__":
  main()
