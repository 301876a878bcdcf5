"""Where XLA:GPU's estimate of a step goes: compute, and waiting on each kind of collective.

For docs/performance.md's "Where the remaining gaps come from": compiles setups of a model for
8 x H100 (deviceless, in a child process started with
``zerojax.diagnostics.deviceless_environment("h100x8", xla_flags=...)``) and splits XLA's
latency-hiding scheduler estimate of each step into what it charges to compute (each
computation's cycles less its wasted cycles, times how often the step runs it) and to waiting
on all-gathers, reduce-scatters and all-reduces (the scheduler's "Wasted cycles for ..."
lines), with each layer loop's compute per iteration and how many reduce-scatters XLA's
collective pipeliner moved across loop iterations (``"is_pipelined":true``). Models: those of
benchmarks/accelerators.py, and "ci", the small model tests/accelerator_worker.py compiles.

Run::

  python benchmarks/gpu_breakdown.py ci fp32 "GSPMD FSDP" "zero3 scan, prefetch=0" "zero3 gather"
  python benchmarks/gpu_breakdown.py activation-heavy fp32 "GSPMD FSDP" "zero3 scan"
  python benchmarks/gpu_breakdown.py ci fp32 "GSPMD FSDP" "zero3 gather" \\
    --xla-flags=--xla_gpu_enable_pipelined_reduce_scatter=false
  python benchmarks/gpu_breakdown.py activation-heavy fp32 "GSPMD FSDP" "zero3 scan" --costs

``--costs`` has the scheduler log each instruction's cost (``TF_CPP_VMODULE=
latency_hiding_scheduler=5``) and sums the step's compute by kind of instruction: cuBLAS
matmuls, and the other fusions by the name XLA gives them (``loop_convert_fusion``,
``loop_dynamic_update_slice_fusion``, ...), times how often the step runs each.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
KINDS = ("all-gather", "reduce-scatter", "all-reduce")
#: ``--costs``' kinds of instruction, the first whose pattern the instruction's line matches.
COST_KINDS = (
  ("matmul", r"__cublas"),
  ("collective start/done", r"(start|done)\("),
  ("dynamic-update-slice", r"%\S*dynamic_update_slice\S* = "),
  ("dynamic-slice", r"%\S*dynamic_slice\S* = "),
  ("copy", r"= \S+ copy\("),
  ("convert", r"%\S*convert\S* = "),
  ("transpose", r"%\S*transpose\S* = "),
  ("other", r""),
)


def statistics(log: str) -> dict[str, dict[str, float]]:
  """Per computation, the scheduler's totals after scheduling and its wasted cycles per kind."""
  found: dict[str, dict[str, float]] = {}
  for block in log.split("Statistics after scheduling")[1:]:
    name = re.search(r"For computation: (\S+),", block)
    if name is None:
      continue
    values = dict(re.findall(r"(Total cycles|Total wasted cycles): ([\d.eE+-]+)", block))
    kinds = dict(re.findall(r"Wasted cycles for ([a-z-]+): ([\d.eE+-]+)", block))
    found[name.group(1)] = {
      "cycles": float(values["Total cycles"]),
      "wasted": float(values["Total wasted cycles"]),
      **{kind: float(kinds.get(kind, 0)) for kind in KINDS},
    }
  return found


def instruction_costs(log: str) -> dict[str, float]:
  """Each instruction's cost, as the scheduler's graph dump logs it (verbose level 5)."""
  costs: dict[str, float] = {}
  current = None
  for line in log.splitlines():
    found = re.search(r"\] Instr: %(\S+) = ", line)
    if found:
      current = found.group(1)
      continue
    found = re.search(r"\] Cost: ([\d.eE+-]+)", line)
    if found and current is not None:
      costs[current] = float(found.group(1))
      current = None
  return costs


def costs_by_kind(log: str, program: str, executions: dict[str, int]) -> dict[str, float]:
  """The step's compute by ``COST_KINDS``: each instruction's cost times its computation's runs."""
  costs = instruction_costs(log)
  totals = dict.fromkeys([name for name, _ in COST_KINDS], 0.0)
  computation = None
  for line in program.splitlines():
    header = re.match(r"^(?:ENTRY )?%(\S+) ", line)
    if header:
      computation = header.group(1)
      continue
    found = re.match(r"\s+(?:ROOT )?%(\S+) = ", line)
    if not found or computation not in executions or found.group(1) not in costs:
      continue
    kind = next(name for name, pattern in COST_KINDS if re.search(pattern, line))
    totals[kind] += costs[found.group(1)] * executions[computation]
  return totals


def compile_setups(
  model: str, precision: str, names: list[str], costs: bool = False
) -> dict[str, dict]:
  """In the child: each setup's estimate, split; the log and program read as they compile."""
  sys.path[:0] = [HERE, os.path.dirname(HERE)]
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from zerojax.diagnostics import capture_stderr, scheduler_estimate

  results = {}
  for name in names:
    if model == "ci":
      from tests import accelerator_worker as worker

      (step, (params, state)), mesh = worker.setups("h100x8")[name]()
      batch = NamedSharding(mesh, P("data"))
      x = jax.ShapeDtypeStruct((worker.TOKENS["cuda"], worker.D), jnp.float32, sharding=batch)
      lowered = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, x)
    else:
      import accelerators

      setup = accelerators.build(name, accelerators.MODELS[model], "h100x8", precision, "dots")
      lowered = setup.jitted.lower(setup.params, setup.state, *setup.batch)
    with capture_stderr() as log:
      compiled = lowered.compile()
    text = log[0] if isinstance(log[0], str) else "".join(log[0])
    estimate = scheduler_estimate(text, compiled)
    split = statistics(text)
    program = compiled.as_text()
    starts = [line for line in program.splitlines() if "reduce-scatter-start(" in line]
    computations = [
      {
        "name": c.name,
        "executions": c.executions,
        **split[c.name],
      }
      for c in estimate.computations
    ]
    results[name] = {
      "cycles": estimate.cycles,
      "computations": computations,
      "reduce_scatters": len(starts),
      "pipelined_reduce_scatters": sum('"is_pipelined":true' in line for line in starts),
    }
    if costs:
      runs = {c.name: c.executions for c in estimate.computations}
      results[name]["costs"] = costs_by_kind(text, program, runs)
  return results


def _total(computations: list[dict], key: str) -> float:
  """``key`` summed over a step: each computation's, times how often the step runs it."""
  return sum(c[key] * c["executions"] for c in computations)


def summary(results: dict[str, dict]) -> str:
  """A markdown table: each setup's estimate against the first's, split."""
  base = next(iter(results.values()))["cycles"]
  lines = [
    "| setup | estimate | vs first | compute | waiting: all-gather | reduce-scatter | all-reduce "
    "| per iteration of each loop: compute (waiting) | reduce-scatters pipelined by XLA |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for name, r in results.items():
    comps = r["computations"]
    compute = _total(comps, "cycles") - _total(comps, "wasted")
    loops = ", ".join(
      f"{c['cycles'] - c['wasted']:.1f} ({c['wasted']:.1f}) x{c['executions']}"
      for c in comps
      if c["executions"] > 1
    )
    entry = [c for c in comps if c["executions"] == 1]
    loops += "; entry " + ", ".join(
      f"{c['cycles'] - c['wasted']:.1f} ({c['wasted']:.1f})" for c in entry
    )
    lines.append(
      f"| {name} | {r['cycles']:.1f} | {r['cycles'] / base:.3f} | {compute:.1f} "
      f"| {_total(comps, 'all-gather'):.1f} | {_total(comps, 'reduce-scatter'):.1f} "
      f"| {_total(comps, 'all-reduce'):.1f} "
      f"| {loops} | {r['pipelined_reduce_scatters']}/{r['reduce_scatters']} |"
    )
  if all("costs" in r for r in results.values()):
    kinds = [name for name, _ in COST_KINDS]
    lines += ["", "| setup | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 1) + "|"]
    for name, r in results.items():
      lines.append(f"| {name} | " + " | ".join(f"{r['costs'][k]:.1f}" for k in kinds) + " |")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("model", help='a model of benchmarks/accelerators.py, or "ci"')
  parser.add_argument("precision", choices=["fp32", "bf16"], help='"fp32" only for "ci"')
  parser.add_argument("setups", nargs="+")
  parser.add_argument("--xla-flags", default="", help="XLA_FLAGS on top of XLA's defaults")
  parser.add_argument("--costs", action="store_true", help="compute by kind of instruction")
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--out", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    with open(args.out, "w") as out:
      json.dump(compile_setups(args.model, args.precision, args.setups, args.costs), out)
    return
  sys.path.insert(0, os.path.dirname(HERE))
  from zerojax.diagnostics import deviceless_environment

  env = {**os.environ, **deviceless_environment("h100x8", xla_flags=args.xla_flags)}
  if args.costs:
    env["TF_CPP_VMODULE"] = "latency_hiding_scheduler=5"
  with tempfile.NamedTemporaryFile(suffix=".json") as out:
    command = [sys.executable, os.path.abspath(__file__), "--child", "--out", out.name]
    command += ["--costs"] * args.costs + [args.model, args.precision, *args.setups]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
      raise RuntimeError(f"compiling for h100x8 failed:\n{done.stderr[-4000:]}")
    with open(out.name) as found:
      results = json.load(found)
  print(summary(results))


if __name__ == "__main__":
  main()
