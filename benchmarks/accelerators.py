"""Training steps compiled for 8 x H100 and TPU v5e, read without the hardware.

XLA compiles a step for an accelerator from a description of it (deviceless
ahead-of-time compilation, ``pip install "zerojax[accelerators]"``), so the
program the accelerator would run can be read here: per-device arguments and
temporaries (``memory_analysis()``), each layer loop's collectives (whether
they run asynchronously, with compute scheduled between start and done:
``zerojax.diagnostics.loop_collectives``) and, on GPU, XLA's own estimate of
the step from its latency-hiding scheduler (``scheduler_estimate``). XLA's
estimate is its cost model, not a measurement: read it side by side.

Every setup trains the same stack from the same parameters with ``optax.adam``
under the same ``jax.checkpoint`` policy (``--policy``, matmul outputs saved by
default): plain data parallelism and GSPMD FSDP (parameters sharded with
``NamedSharding``, activations constrained to the batch) in plain JAX;
zerojax's stages 1 and 2; and stage 3 on each of its paths: ``zerojax.gather``
in a checkpointed ``jax.lax.scan``, ``zerojax.scan`` with and without
prefetching, ``zerojax.flax.linen.scan``, and drop-in (plain ``jax.value_and_grad``).
Each target compiles in a ``zerojax.diagnostics.DevicelessProcess`` of its own,
which runs ``compile_cell`` for each of the target's cells.

Run::

  python benchmarks/accelerators.py --markdown docs/benchmarks.md          # both models, fp32, bf16
  python benchmarks/accelerators.py --scale --markdown docs/benchmarks.md  # 7.5B, TPU v5e 8 x 8
  python benchmarks/accelerators.py --policies --markdown docs/performance.md
  python benchmarks/accelerators.py --gpu-flags --markdown docs/performance.md
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

import jax
import jax.numpy as jnp
import mlp
import optax
import report
import setups as setups_lib
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from measure import gpu_estimate
from model import AXIS

import zerojax
from zerojax.diagnostics import DevicelessProcess, deviceless_mesh, deviceless_target

MIB = 2**20
#: The models, by name: (the stack's shape, the targets it is compiled for by default).
MODELS = {
  # Issue 29's: 16 layers of two 4096 x 4096 matrices, 16,384 tokens over 8 devices.
  "parameter-heavy": mlp.MlpConfig(layers=16, d=4096, hidden=4096, tokens=16384),
  # Four times the tokens per weight: activations dominate.
  "activation-heavy": mlp.MlpConfig(layers=8, d=2048, hidden=8192, tokens=65536),
  # The ZeRO paper's 7.5B parameters, 2048 tokens per chip of a v5e 8 x 8.
  "7.5b": mlp.MlpConfig(layers=56, d=4096, hidden=16384, tokens=2048 * 64),
}
#: The ``--policy`` names: ``jax.checkpoint`` policies. "everything" saves every value but the
#: gathered weights (whatever the policy, those are gathered again): nothing is recomputed;
#: "nothing" is ``zerojax.scan``'s default.
POLICIES = {
  "dots": jax.checkpoint_policies.dots_saveable,
  "dots without batch dims": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  "nothing": jax.checkpoint_policies.nothing_saveable,
  "everything": jax.checkpoint_policies.everything_saveable,
}
#: zerojax's policy and the compute dtype of each ``--precisions`` name. bf16 reduces gradients in
#: bf16 too, as GSPMD FSDP does when the loss casts the weights (zerojax's named "bf16" policy
#: reduces in fp32: twice the gradient bytes, and exact sums of bf16 products).
PRECISIONS = {
  "fp32": (None, jnp.float32),
  "bf16": (zerojax.Precision(params="fp32", compute="bf16", reduce="bf16"), jnp.bfloat16),
}
ZERO3 = (
  "zero3 gather",
  "zero3 scan, prefetch=0",
  "zero3 scan",
  "zero3 scan, deferred reductions",
  "zero3 Flax scan",
  "zero3 drop-in",
)
SETUPS = ("plain DP", "GSPMD FSDP", "zero1", "zero2", *ZERO3)
#: XLA:GPU flag sets ``--gpu-flags`` compares (each on top of XLA's defaults and
#: the flags ``zerojax.diagnostics.deviceless_environment`` sets on GPU).
GPU_FLAGS = {
  "defaults": "",
  "collective overlap limit 2": "--xla_gpu_experimental_parallel_collective_overlap_limit=2",
  # XLA pipelines reduce-scatters in loops by default (explicit-path gradients, carried one
  # iteration): this turns it off.
  "no pipelined reduce-scatter": "--xla_gpu_enable_pipelined_reduce_scatter=false",
  "combine all-gathers up to 256 MiB": "--xla_gpu_all_gather_combine_threshold_bytes=268435456",
  "pipelined all-gather and reduce-scatter": "--xla_gpu_enable_pipelined_all_gather=true "
  "--xla_gpu_enable_pipelined_reduce_scatter=true",
  "while-loop double buffering": "--xla_gpu_enable_while_loop_double_buffering=true",
  "overlap limit 2 and double buffering": (
    "--xla_gpu_experimental_parallel_collective_overlap_limit=2 "
    "--xla_gpu_enable_while_loop_double_buffering=true"
  ),
  "pipelined collectives and overlap limit 2": "--xla_gpu_enable_pipelined_all_gather=true "
  "--xla_gpu_enable_pipelined_reduce_scatter=true "
  "--xla_gpu_experimental_parallel_collective_overlap_limit=2",
}


# ---------------------------------------------------------------------------
# In the compiling process.
# ---------------------------------------------------------------------------


def build(name: str, config: mlp.MlpConfig, target: str, precision: str, policy: str):
  """The ``setups.Setup`` called ``name``, with abstract arguments on ``target``'s devices."""
  count = deviceless_target(target).device_count
  auto = deviceless_mesh(target, (count,), (AXIS,), (AxisType.Auto,))
  explicit = deviceless_mesh(target, (count,), (AXIS,), (AxisType.Explicit,))
  option, dtype = PRECISIONS[precision]
  chosen = POLICIES[policy]
  params = mlp.abstract_params(config)
  batch = mlp.abstract_batch(config, auto)
  if name in ("plain DP", "GSPMD FSDP"):
    loss = mlp.make_loss("plain", chosen, dtype, NamedSharding(auto, P(AXIS)))
    spec = (lambda _: P()) if name == "plain DP" else lambda s: setups_lib.fsdp_spec(s, count)
    return setups_lib.plain_setup(name, loss, optax.adam(1e-3), params, batch, spec)
  stage = int(name[4])
  mesh = auto if name == "zero3 drop-in" else explicit
  tx = setups_lib.ZERO[stage](optax.adam(1e-3), mesh=mesh, precision=option)
  if name == "zero3 drop-in":
    loss = mlp.make_loss("plain", chosen, dtype, NamedSharding(auto, P(AXIS)))
    return setups_lib.zero_setup(name, tx, setups_lib.dropin_grad(tx, loss), params, batch)
  if name == "zero3 Flax scan":
    params, loss = mlp.flax_model(config, chosen, dtype)
  else:
    # zero1 and zero2 (whose weights are read, not gathered) run zerojax.scan too.
    loss = mlp.make_loss(name.removeprefix("zero3 ") if stage == 3 else "scan", chosen, dtype)
  batch = mlp.abstract_batch(config, explicit)
  return setups_lib.zero_setup(name, tx, zerojax.value_and_grad(loss, tx), params, batch)


def measure(setup: setups_lib.Setup, target: str) -> dict[str, Any]:
  """What ``setup``'s step compiled for ``target`` needs and does; ``error`` if it will not fit."""
  try:
    with zerojax.diagnostics.capture_stderr() as log:
      compiled = setup.compile()
  except Exception as error:  # XLA refuses a program that does not fit the device
    return {"error": str(error).splitlines()[0][:300]}
  memory = compiled.memory_analysis()
  loops = zerojax.diagnostics.loop_collectives(compiled)
  result = {
    "arguments": memory.argument_size_in_bytes,
    "temporaries": memory.temp_size_in_bytes,
    "loops": [
      [loop.asynchronous, loop.overlapped, loop.gathers + loop.reductions] for loop in loops
    ],
  }
  if deviceless_target(target).platform == "cuda":
    result |= gpu_estimate(log[0], compiled)
  return result


def compile_cell(
  target: str, model: str, precision: str, policy: str, names: list[str]
) -> dict[str, Any]:
  """What each of the setups ``names`` needs and does, compiled for ``target`` (in a
  ``DevicelessProcess`` for it: ``cell`` calls this)."""
  results = {}
  for name in names:
    results[name] = measure(build(name, MODELS[model], target, precision, policy), target)
    print(f"compiled {name} for {target}", file=sys.stderr, flush=True)  # the log, if it dies
  return results


# ---------------------------------------------------------------------------
# In the process that runs the benchmark.
# ---------------------------------------------------------------------------


def cell(
  process: DevicelessProcess, model: str, precision: str, policy: str, names
) -> dict[str, Any]:
  """Compiles the setups ``names`` in ``process``, for its target."""
  args = (process.target, model, precision, policy, list(names))
  return process.call(f"{__file__}:compile_cell", *args)


def rows(results: dict[str, Any], config: mlp.MlpConfig) -> list[dict[str, Any]]:
  """One table row per setup, temporaries and XLA's estimate against GSPMD FSDP's."""
  fsdp = results["GSPMD FSDP"]
  out = []
  for name, r in results.items():
    if "error" in r:
      out.append({"setup": name, "args": float("nan"), "temp": float("nan"), "note": r["error"]})
      continue
    row = {
      "setup": name,
      "args": r["arguments"] / MIB,
      "temp": r["temporaries"] / MIB,
      "layers": (r["temporaries"] - fsdp["temporaries"]) / config.layer_bytes,
      "loops": ", ".join(f"{o}/{n}" for _, o, n in r["loops"]) or "-",
    }
    if "cycles" in r:
      row |= {
        "cycles": r["cycles"] / 1000,
        "vs fsdp": r["cycles"] / fsdp["cycles"],
        "waiting": r["wasted"] / r["cycles"],
        "loop waiting": ", ".join(f"{w:.0%}" for w in r["loop waiting"]) or "-",
      }
      if r["silent"]:
        row["setup"] += " (loops without collectives not in XLA's estimate)"
    out.append(row)
  return out


COLUMNS = {
  "setup": ("setup", "s"),
  "args": ("arguments MiB", ".0f"),
  "temp": ("temporaries MiB", ".0f"),
  "layers": ("temp. - FSDP's (layers)", "+.2f"),
  "cycles": ("XLA's estimate (k)", ".1f"),
  "vs fsdp": ("vs FSDP", ".2f"),
  "waiting": ("waiting (step)", ".0%"),
  "loop waiting": ("waiting (layer loops)", "s"),
  "loops": ("overlapped/collectives per loop", "s"),
}


def table(results: dict[str, Any], config: mlp.MlpConfig, gpu: bool) -> str:
  keys = [k for k in COLUMNS if gpu or k not in ("cycles", "vs fsdp", "waiting", "loop waiting")]
  found = rows(results, config)
  for row in found:
    for key in keys:
      row.setdefault(key, float("nan") if COLUMNS[key][1] != "s" else "-")
  notes = [f"- {row['setup']}: {row['note']}" for row in found if "note" in row]
  return "\n".join([report.table(found, {k: COLUMNS[k] for k in keys}), *notes])


def describe(model: str, config: mlp.MlpConfig, precision: str, policy: str) -> str:
  return (
    f"{model}: {config.layers} layers of `h + gelu(h @ up) @ down` ({config.d} x "
    f"{config.hidden}), {config.parameters / 1e9:.2f}B parameters ({config.layer_bytes / MIB:.0f} "
    f"MiB a layer in fp32), {config.tokens:,} tokens a step, {precision}, `optax.adam`, "
    f"remat policy: {policy}."
  )


def run(args: argparse.Namespace) -> list[str]:
  """The report's lines for the command line's choice."""
  lines = []
  if args.scale:
    config = MODELS["7.5b"]
    with DevicelessProcess("v5e-64") as process:
      results = cell(process, "7.5b", "bf16", args.policy, ("GSPMD FSDP", *ZERO3))
    hbm = deviceless_target("v5e-64").hbm_bytes / 2**30
    lines += report.section(
      f"TPU v5e 8 x 8 ({hbm:.2f} GiB of HBM a chip)",
      describe("7.5b", config, "bf16", args.policy),
      table(results, config, gpu=False),
    )
    return lines
  if args.policies:
    for target in args.targets:
      with DevicelessProcess(target) as process:
        for policy in POLICIES:
          config = MODELS[args.models[0]]
          results = cell(process, args.models[0], "fp32", policy, ("GSPMD FSDP", "zero3 scan"))
          gpu = deviceless_target(target).platform == "cuda"
          title = f"{target}, remat policy {policy}"
          lines += report.section(title, table(results, config, gpu))
    return lines
  if args.gpu_flags:
    config = MODELS[args.models[0]]
    for name, flags in GPU_FLAGS.items():
      with DevicelessProcess("h100x8", xla_flags=flags) as process:
        results = cell(process, args.models[0], "fp32", args.policy, SETUPS[1:])
      lines += report.section(
        f"h100x8, XLA_FLAGS: {name} (`{flags}`)", table(results, config, True)
      )
    return lines
  with contextlib.ExitStack() as stack:
    processes = {t: stack.enter_context(DevicelessProcess(t)) for t in args.targets}
    for model in args.models:
      config = MODELS[model]
      for precision in args.precisions:
        for target in args.targets:
          results = cell(processes[target], model, precision, args.policy, SETUPS)
          gpu = deviceless_target(target).platform == "cuda"
          lines += report.section(
            f"{target}, {model}, {precision}",
            describe(model, config, precision, args.policy),
            table(results, config, gpu),
          )
  return lines


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--targets", nargs="+", default=["h100x8", "v5e-8"], choices=["h100x8", "v5e-8"]
  )
  parser.add_argument(
    "--models",
    nargs="+",
    default=["parameter-heavy", "activation-heavy"],
    choices=["parameter-heavy", "activation-heavy"],
  )
  parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=PRECISIONS)
  parser.add_argument("--policy", default="dots", choices=POLICIES)
  modes = parser.add_mutually_exclusive_group()
  modes.add_argument("--scale", action="store_true", help="the 7.5B model on a TPU v5e 8 x 8")
  modes.add_argument("--policies", action="store_true", help="each remat policy, FSDP and zero3")
  modes.add_argument("--gpu-flags", action="store_true", help="XLA:GPU flag sets compared")
  report.add_output_flags(parser)
  args = parser.parse_args()
  clock = report.Clock()
  lines = run(args)
  argv = sys.argv[1:]
  text = "\n".join(
    [*lines, report.accelerator_provenance(clock), "", *report.command("accelerators.py", argv)]
  )
  print(text)
  if args.markdown:
    mode = (
      "scale"
      if args.scale
      else "policies"
      if args.policies
      else "gpu-flags"
      if args.gpu_flags
      else "setups"
    )
    targets = "v5e-64" if args.scale else "h100x8" if args.gpu_flags else " ".join(args.targets)
    begin = f"<!-- results: accelerators.py {mode} {targets} -->"
    report.write_markdown(args.markdown, text, begin, "Benchmarks")


if __name__ == "__main__":
  main()
