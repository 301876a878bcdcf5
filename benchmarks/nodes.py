"""ZeRO-3, hybrid sharding and ZeRO++ across nodes and pods, compiled for them without them.

One training step of an MLP stack (``mlp.py``: fp32, ``optax.adam``, the layers
under ``zerojax.scan`` with matmul outputs saved, a fixed number of tokens per
device) is compiled, deviceless, for 1, 2, 4, 8 and 16 nodes of 8 H100, for a
TPU v5e 16 x 16 pod and for 2 and 4 v5e-16 slices joined by the data-center
network, on a ``node x data`` mesh (``node``: the nodes or the slices; on one
slice, the rows of its torus, with no slower link between them). For each
setup it reads:

* XLA:GPU's estimate of the step (``zerojax.diagnostics.scheduler_estimate``),
  against GSPMD FSDP's over both axes (GPU only);
* per-device arguments and temporaries (``memory_analysis()``);
* the bytes that cross into or out of one node (or slice) per step, as the
  ZeRO++ paper counts them (``measure.cross_node``), in units of M, the
  model's bytes in fp32.

The setups: GSPMD FSDP (parameters and Adam state sharded over both axes with
``NamedSharding``) and GSPMD HSDP (over ``data``, replicated over ``node``),
and ``zerojax.zero3`` with full sharding over both axes (a layer's weights
gathered in one packed all-gather across nodes, the default on GPUs, and with
``packed_gathers=False``, "zero3 unpacked", one all-gather a weight, the
default on TPUs), hybrid sharding (``replica_axis="node"``), hpZ
(``secondary_axis="data"``), int8 qwZ, int8 qgZ and hpZ + qwZ + qgZ; each
zerojax setup also with ``zerojax.scan(..., defer_reductions=True)`` (",
deferred", GPUs only), which is ``zerojax.scan``'s default on GPUs for
quantized gradients and where the data axes span nodes (2 nodes and more):
there the two rows agree. The memory section checks zero3's
arguments against the ZeRO formula, 12Ψ/N bytes of model states per device
(fp32 parameters and Adam's two moments) plus the device's batch, from 8 to
256 devices.

Each target compiles in a ``zerojax.diagnostics.DevicelessProcess`` of its own,
which runs ``compile_named`` for each of the target's setups. Every result is kept in
a JSON cache (``--cache``, committed beside this script) under its target,
model and setup, with the commit it was compiled at, and compiled again only
with ``--refresh`` (the 16-node and TPU compiles are the slow ones).

Run::

  python benchmarks/nodes.py --markdown docs/scaling.md --plots docs/img
  python benchmarks/nodes.py --refresh --targets h100x16 h100x32 --setups "GSPMD FSDP" qgZ
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import measure
import mlp
import optax
import report
import setups as setups_lib
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from matplotlib.figure import Figure

import zerojax
from zerojax.diagnostics import DevicelessProcess, deviceless_mesh, deviceless_target

MIB = 2**20
AXES = ("node", "data")
BEGIN = "<!-- results: nodes.py -->"
#: The models: (layers, d, hidden, tokens per device). The stack's tokens are these times N.
MODELS = {
  # Issue 49's: 16 layers of two 4096 x 4096 matrices, 2048 tokens a device.
  "parameter-heavy": (16, 4096, 4096, 2048),
  # Wider layers, four times the tokens a device: activations dominate.
  "activation-heavy": (8, 2048, 8192, 8192),
}
GPU_TARGETS = ("h100x8", "h100x16", "h100x32", "h100x64", "h100x128")
TPU_TARGETS = ("v5e-256", "2xv5e-16", "4xv5e-16")
#: Compiled for zero3 alone, so that memory against N also has TPU points at 8 and 64 chips.
MEMORY_TARGETS = ("v5e-8", "v5e-64")
#: zerojax.zero3's options for each zerojax setup, on the node x data mesh.
ZERO3 = {
  "zero3": dict(axis_name=AXES),
  "zero3 unpacked": dict(axis_name=AXES, packed_gathers=False),
  "hybrid": dict(axis_name="data", replica_axis="node"),
  "hpZ": dict(axis_name=AXES, secondary_axis="data"),
  "qwZ": dict(axis_name=AXES, quantized_weights="int8"),
  "qgZ": dict(axis_name=AXES, quantized_gradients="int8"),
  "hpZ+qwZ+qgZ": dict(
    axis_name=AXES, secondary_axis="data", quantized_weights="int8", quantized_gradients="int8"
  ),
}
DEFERRED = ", deferred"
GSPMD = ("GSPMD FSDP", "GSPMD HSDP")
SETUPS = (*GSPMD, *ZERO3, *(name + DEFERRED for name in ZERO3))
FSDP = "GSPMD FSDP"
#: ZeRO++'s bytes across nodes per step for hpZ + qwZ + qgZ, in units of M (the paper's 0.75M).
PAPER_ACROSS = 0.75


def config_of(model: str, devices: int) -> mlp.MlpConfig:
  layers, d, hidden, tokens = MODELS[model]
  return mlp.MlpConfig(layers, d, hidden, tokens * devices)


def nodes_of(target: str) -> int:
  """The mesh's ``node`` axis: GPU nodes or TPU slices, or the rows of one TPU slice's torus."""
  spec = deviceless_target(target)
  if spec.platform == "cuda" or spec.slices > 1:
    return spec.hosts
  return int(spec.topology.split(":")[1].split("x")[0])


# ---------------------------------------------------------------------------
# In the compiling process.
# ---------------------------------------------------------------------------


def build(name: str, config: mlp.MlpConfig, mesh) -> setups_lib.Setup:
  """The ``setups.Setup`` called ``name``, with abstract arguments on ``mesh``."""
  policy = jax.checkpoint_policies.dots_saveable
  params = mlp.abstract_params(config)
  if name in GSPMD:
    auto = jax.sharding.Mesh(mesh.devices, AXES, axis_types=(AxisType.Auto,) * 2)
    rows = NamedSharding(auto, P(AXES))
    batch = (jax.ShapeDtypeStruct((config.tokens, config.d), jnp.float32, sharding=rows),) * 2
    loss = mlp.make_loss("plain", policy, jnp.float32, rows)
    over = AXES if name == FSDP else "data"
    shards = math.prod(auto.shape[a] for a in ((over,) if isinstance(over, str) else over))
    spec = lambda shape: setups_lib.fsdp_spec(shape, shards, axes=over)
    return setups_lib.plain_setup(name, loss, optax.adam(1e-3), params, batch, spec, AXES)
  base = name.removesuffix(DEFERRED)
  tx = zerojax.zero3(optax.adam(1e-3), mesh=mesh, **ZERO3[base])
  rows = NamedSharding(mesh, P(tx.batch_axes))
  batch = (jax.ShapeDtypeStruct((config.tokens, config.d), jnp.float32, sharding=rows),) * 2
  stack = "scan, deferred reductions" if name.endswith(DEFERRED) else "scan"
  loss = mlp.make_loss(stack, policy, jnp.float32)
  return setups_lib.zero_setup(name, tx, zerojax.value_and_grad(loss, tx), params, batch)


def measure_setup(setup: setups_lib.Setup, target: str, mesh) -> dict[str, Any]:
  """What ``setup``'s step compiled for ``target`` needs and moves; ``error`` if it fails."""
  try:
    with zerojax.diagnostics.capture_stderr() as log:
      compiled = setup.compile()
  except Exception as error:  # XLA refuses a program that does not fit the device
    return {"error": str(error).splitlines()[0][:300]}
  memory = compiled.memory_analysis()
  result = {"arguments": memory.argument_size_in_bytes, "temporaries": memory.temp_size_in_bytes}
  text = compiled.as_text()
  slices = deviceless_target(target).slices
  if slices == 1:
    counted = zerojax.diagnostics.count_collectives_by_axes(text, mesh)
    result["bytes"] = {
      " ".join(axes): {k: c.bytes for k, c in kinds.items() if c.count}
      for axes, kinds in counted.items()
    }
  else:
    result["across slices"] = dcn_bytes(text, slices, mesh.size // slices)
  if deviceless_target(target).platform == "cuda":
    result |= measure.gpu_estimate(log[0], compiled)
  return result


def dcn_bytes(text: str, slices: int, per_slice: int) -> dict[str, float]:
  """Bytes into or out of one slice per step over the data-center network, by transfer kind:
  ``zerojax.diagnostics.count_across_slices`` (a chip's) for each chip of the slice."""
  counted = zerojax.diagnostics.count_across_slices(text, slices)
  return {kind: count * per_slice for kind, count in counted.items()}


@functools.cache
def node_mesh(target: str) -> jax.sharding.Mesh:
  """``target``'s devices on the ``node x data`` mesh (in a process compiling for it)."""
  nodes = nodes_of(target)
  count = deviceless_target(target).device_count
  return deviceless_mesh(target, (nodes, count // nodes), AXES, (AxisType.Explicit,) * 2)


def compile_named(target: str, model: str, name: str) -> dict[str, Any]:
  """What the setup ``name`` of ``model`` needs and moves, compiled for ``target`` (in a
  ``DevicelessProcess`` for it: ``compile_missing`` calls this)."""
  mesh = node_mesh(target)
  return measure_setup(build(name, config_of(model, mesh.size), mesh), target, mesh)


# ---------------------------------------------------------------------------
# In the process that runs the benchmark.
# ---------------------------------------------------------------------------


def compile_missing(wanted: dict[str, list[str]], models, cache: dict, refresh: bool) -> None:
  """Compiles into ``cache`` the setups ``wanted`` for each target, of each of ``models``, that
  it does not hold (all of them with ``refresh``), in one ``DevicelessProcess`` a target."""
  for target, names in wanted.items():
    missing = {
      model: [name for name in names if refresh or name not in cache.get(f"{target} {model}", {})]
      for model in models
    }
    if not any(missing.values()):
      continue
    stamp = {"commit": report.commit(), "date": datetime.date.today().isoformat()}
    with DevicelessProcess(target) as process:
      for model, names in missing.items():
        known = cache.setdefault(f"{target} {model}", {})
        if names:
          print(f"compiling {len(names)} setups of {model} for {target}", file=sys.stderr)
        for name in names:  # each kept as it is done: it survives a later failure
          known[name] = process.call(f"{__file__}:compile_named", target, model, name) | stamp


def across(result: dict[str, Any], target: str) -> float:
  """Bytes into or out of one node (slice) per step, in the paper's accounting."""
  if "across slices" in result:
    return sum(result["across slices"].values())
  nodes = nodes_of(target)
  per_node = deviceless_target(target).device_count // nodes
  return measure.cross_node(result["bytes"], per_node) if nodes > 1 else 0.0


def batch_bytes(model: str) -> int:
  """One device's inputs and targets, float32."""
  _, d, _, tokens = MODELS[model]
  return 2 * tokens * d * 4


def zero_formula(model: str, devices: int, replicas: int = 1) -> float:
  """ZeRO-3's model states per device, fp32 Adam: 12Ψ over the devices it is split over."""
  return 12 * config_of(model, 1).parameters / (devices / replicas)


def gpu_tables(results: dict, model: str, targets: list[str]) -> list[str]:
  """Step estimate, bytes across nodes and memory, a column per node count."""
  columns = {t: f"{deviceless_target(t).hosts} x 8" for t in targets}
  lines = []
  for title, suffix in (
    ("`zerojax.scan`", ""),
    ("`zerojax.scan(..., defer_reductions=True)`", DEFERRED),
  ):
    names = [*GSPMD, *(name + suffix for name in ZERO3)]
    rows = []
    for name in names:
      row = {"setup": name}
      for t in targets:
        r, fsdp = results[t][name], results[t][FSDP]
        row[t] = (
          "-"
          if "cycles" not in r
          else f"{fsdp['cycles'] / 1000:.1f}k"
          if name == FSDP
          else f"{r['cycles'] / fsdp['cycles']:.2f}"
        )
      rows.append(row)
    lines += report.section(
      f"{model}: XLA:GPU's estimate of the step against GSPMD FSDP's, zerojax under {title}",
      report.table(rows, {"setup": ("setup", "s")} | {t: (c, "s") for t, c in columns.items()}),
    )
  rows = []
  for name in (*GSPMD, *ZERO3):
    row = {"setup": name}
    for t in targets[1:]:
      r = results[t][name]
      moved = across(r, t) / (4 * config_of(model, 1).parameters) if "bytes" in r else None
      row[t] = "does not compile" if moved is None else f"{moved:.2f} M"
    rows.append(row)
  lines += report.section(
    f"{model}: bytes crossing into or out of one node per step (ZeRO++'s accounting, M = the "
    "model's fp32 bytes)",
    report.table(rows, {"setup": ("setup", "s")} | {t: (columns[t], "s") for t in targets[1:]}),
  )
  rows = []
  for name in (*GSPMD, *ZERO3):
    row = {"setup": name}
    for t in targets:
      r = results[t][name]
      row[t] = memory_cell(r)
    rows.append(row)
  lines += report.section(
    f"{model}: MiB per device, arguments / temporaries",
    report.table(rows, {"setup": ("setup", "s")} | {t: (c, "s") for t, c in columns.items()}),
  )
  return lines


def memory_cell(result: dict[str, Any]) -> str:
  """``arguments / temporaries`` in MiB, or XLA's refusal (the step does not fit)."""
  if "error" in result:
    return "does not compile"
  return f"{result['arguments'] / MIB:.0f} / {result['temporaries'] / MIB:.0f}"


def tpu_table(results: dict, model: str, targets: list[str]) -> list[str]:
  rows = []
  for name in (*GSPMD, *ZERO3):
    row = {"setup": name}
    for t in targets:
      r = results[t][name]
      cross = ""
      if "across slices" in r:
        cross = f", {across(r, t) / (4 * config_of(model, 1).parameters):.2f} M"
      row[t] = memory_cell(r) + cross
    rows.append(row)
  per_node = lambda t: deviceless_target(t).device_count // nodes_of(t)
  heads = {t: (f"{t} ({nodes_of(t)} x {per_node(t)})", "s") for t in targets}
  return report.section(
    f"{model} on TPU v5e: MiB per chip, arguments / temporaries, and on several slices the "
    "bytes crossing into or out of a slice per step (ZeRO++'s accounting)",
    report.table(rows, {"setup": ("setup", "s")} | heads),
  )


def memory_rows(results: dict, model: str) -> list[dict[str, Any]]:
  """zero3 and hybrid: model states per device (arguments less the batch) against the formula."""
  rows = []
  for target, by_setup in results.items():
    count = deviceless_target(target).device_count
    for name, replicas in (("zero3", 1), ("hybrid", nodes_of(target))):
      if name not in by_setup or "error" in by_setup[name]:
        continue
      states = by_setup[name]["arguments"] - batch_bytes(model)
      formula = zero_formula(model, count, replicas)
      rows.append(
        {
          "n": count,
          "target": target,
          "setup": name,
          "states": states / MIB,
          "formula": formula / MIB,
          "ratio": states / formula,
        }
      )
  return sorted(rows, key=lambda row: (row["setup"], row["n"], row["target"]))


MEMORY_COLUMNS = {
  "n": ("N", "d"),
  "target": ("target", "s"),
  "setup": ("setup", "s"),
  "states": ("arguments - batch, MiB", ".1f"),
  "formula": ("ZeRO formula MiB", ".1f"),
  "ratio": ("measured / formula", ".4f"),
}


def checks(gpu: dict, model: str, memory: list[dict]) -> list[str]:
  """The issue's targets, each met or not, from the measurements."""
  out = []
  psi_bytes = 4 * config_of(model, 1).parameters
  multi = [t for t in gpu if deviceless_target(t).hosts >= 2]

  def verdict(ok: bool) -> str:
    return "met" if ok else "**NOT met**"

  moved = {t: across(gpu[t]["hpZ+qwZ+qgZ"], t) / psi_bytes for t in multi}
  out.append(
    f"- hpZ + qwZ + qgZ moves at most {PAPER_ACROSS}M across nodes: "
    + ", ".join(f"{moved[t]:.2f}M at {deviceless_target(t).hosts} nodes" for t in multi)
    + f": {verdict(all(v <= PAPER_ACROSS for v in moved.values()))}"
  )
  for suffix, stack in (("", "zerojax.scan"), (DEFERRED, "deferred reductions")):
    ratio = lambda t, name, suffix=suffix: gpu[t][name + suffix]["cycles"] / gpu[t][FSDP]["cycles"]
    for alone in ("qwZ", "qgZ"):
      worse = [t for t in multi if ratio(t, alone) > ratio(t, "zero3")]
      out.append(
        f"- {stack}: {alone} no slower than zero3 at 2 nodes and more: "
        + ", ".join(f"{ratio(t, alone):.2f} vs {ratio(t, 'zero3'):.2f}" for t in multi)
        + f": {verdict(not worse)}"
      )
    fastest = [t for t in multi if all(ratio(t, "hpZ+qwZ+qgZ") <= ratio(t, name) for name in ZERO3)]
    out.append(
      f"- {stack}: hpZ + qwZ + qgZ the fastest zero3 setup at 2 nodes and more: "
      f"{len(fastest)} of {len(multi)} node counts: {verdict(len(fastest) == len(multi))}"
    )
    four = [t for t in multi if deviceless_target(t).hosts == 4]
    if four:
      value = ratio(four[0], "hpZ+qwZ+qgZ")
      out.append(
        f"- {stack}: hpZ + qwZ + qgZ at most 0.6x GSPMD FSDP at 4 nodes: {value:.2f}: "
        f"{verdict(value <= 0.6)}"
      )
    zero3 = {t: ratio(t, "zero3") for t in multi}
    out.append(
      f"- {stack}: zero3 (full sharding) at most 0.85x GSPMD FSDP at 2 nodes and more: "
      + ", ".join(f"{v:.2f}" for v in zero3.values())
      + f": {verdict(all(v <= 0.85 for v in zero3.values()))}"
    )
    below = [t for t in gpu if ratio(t, "hpZ+qwZ+qgZ") <= ratio(t, "hpZ")]
    out.append(
      f"- {stack}: hpZ + qwZ + qgZ at most hpZ at every node count: "
      + ", ".join(f"{ratio(t, 'hpZ+qwZ+qgZ'):.2f} vs {ratio(t, 'hpZ'):.2f}" for t in gpu)
      + f": {verdict(len(below) == len(gpu))}"
    )
  worst = max(abs(row["ratio"] - 1) for row in memory)
  out.append(
    f"- zero3 and hybrid arguments within 2% of the ZeRO formula plus the batch at every N: "
    f"worst {worst:.2%}: {verdict(worst <= 0.02)}"
  )
  return out


def plot_gpu(gpu: dict, model: str, path: str) -> None:
  """XLA's estimate against GSPMD FSDP's, and arguments + temporaries, against the node count."""
  nodes = [deviceless_target(t).hosts for t in gpu]
  figure = Figure(figsize=(15, 4.4))
  default, deferred, memory = figure.subplots(1, 3)
  color = {name: f"C{i}" for i, name in enumerate((*GSPMD, *ZERO3))}  # the same in each panel
  for ax, suffix, title in (
    (default, "", "zerojax.scan"),
    (deferred, DEFERRED, "deferred reductions"),
  ):
    for name in (*GSPMD, *ZERO3):
      key = name if name in GSPMD else name + suffix
      values = [gpu[t][key]["cycles"] / gpu[t][FSDP]["cycles"] for t in gpu]
      ax.plot(nodes, values, marker="o", color=color[name], label=name)
    ax.set(title=f"step / GSPMD FSDP's (XLA:GPU), {title}", xlabel="nodes of 8 H100")
  for name in (*GSPMD, *ZERO3):
    values = [(gpu[t][name]["arguments"] + gpu[t][name]["temporaries"]) / 2**30 for t in gpu]
    memory.plot(nodes, values, marker="o", color=color[name], label=name)
  memory.set(title="arguments + temporaries", xlabel="nodes of 8 H100", ylabel="GiB per device")
  for ax in (default, deferred, memory):
    ax.set_xscale("log", base=2)
    ax.set_xticks(nodes, [str(n) for n in nodes])
  handles, labels = memory.get_legend_handles_labels()
  figure.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=5)
  figure.suptitle(f"{model}, {MODELS[model][3]} tokens a device", y=1.02)
  figure.savefig(path, dpi=110, bbox_inches="tight")


def plot_memory(memory: list[dict], model: str, path: str) -> None:
  """Model states per device against N, measured and the ZeRO formula."""
  figure = Figure(figsize=(7, 4))
  ax = figure.subplots()
  for setup, marker in (("zero3", "o"), ("hybrid", "s")):
    rows = [row for row in memory if row["setup"] == setup]
    for platform, fill in (("h100", "full"), ("v5e", "none")):
      mine = [row for row in rows if platform in row["target"]]
      ax.plot(
        [row["n"] for row in mine],
        [row["states"] for row in mine],
        marker=marker,
        fillstyle=fill,
        linestyle="none",
        label=f"{setup}, {'H100' if platform == 'h100' else 'TPU v5e'}",
      )
  counts = sorted({row["n"] for row in memory})
  formula = [zero_formula(model, n) / MIB for n in counts]
  ax.plot(counts, formula, color="gray", linestyle="--", label="12Ψ/N (ZeRO-3)")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log", base=2)
  ax.set_xticks(counts, [str(n) for n in counts])
  ax.set(xlabel="devices N", ylabel="MiB per device", title="model states per device (compiled)")
  ax.legend(fontsize=8)
  figure.savefig(path, dpi=110, bbox_inches="tight")


def wanted_setups(names, targets) -> dict[str, list[str]]:
  """Which of ``names`` each of ``targets`` compiles (TPUs have no deferred rows), and zero3 on
  the memory section's targets."""
  wanted = {}
  for target in targets:
    tpu = deviceless_target(target).platform == "tpu"
    wanted[target] = [name for name in names if not (tpu and name.endswith(DEFERRED))]
  for target in MEMORY_TARGETS:
    names = wanted.get(target, [])
    wanted[target] = names if "zero3" in names else [*names, "zero3"]
  return wanted


def run(args: argparse.Namespace, cache: dict) -> list[str]:
  lines = []
  gpu_targets = [t for t in args.targets if deviceless_target(t).platform == "cuda"]
  tpu_targets = [t for t in args.targets if deviceless_target(t).platform == "tpu"]
  # --setups names what to compile (again, with --refresh); the tables read every setup, and
  # compile the ones the cache lacks.
  compile_missing(wanted_setups(args.setups, args.targets), args.models, cache, args.refresh)
  compile_missing(wanted_setups(SETUPS, args.targets), args.models, cache, False)
  tpu_setups = [name for name in SETUPS if not name.endswith(DEFERRED)]
  chosen = lambda target, model, names: {name: cache[f"{target} {model}"][name] for name in names}
  where = lambda name: report.plot_path(args.plots, args.markdown, name)
  for model in args.models:
    _, d, hidden, tokens = MODELS[model]
    config = config_of(model, 1)
    lines += [
      f"### {model}",
      "",
      f"{config.layers} layers of `h + gelu(h @ up) @ down` ({d} x {hidden}), "
      f"{config.parameters / 1e9:.2f}B parameters (M = {4 * config.parameters / 2**30:.1f} GiB "
      f"in fp32), {tokens:,} tokens a device, fp32, `optax.adam`, matmul outputs saved.",
      "",
    ]
    gpu = {t: chosen(t, model, SETUPS) for t in gpu_targets}
    tpu = {t: chosen(t, model, tpu_setups) for t in tpu_targets}
    extra = {t: chosen(t, model, ["zero3"]) for t in MEMORY_TARGETS}
    if gpu:
      lines += gpu_tables(gpu, model, gpu_targets)
      path, relative = where(f"nodes_{model}.png")
      if path:
        plot_gpu(gpu, model, path)
        lines += [f"![{model}: step and memory against nodes]({relative})", ""]
    if tpu:
      lines += tpu_table(tpu, model, tpu_targets)
    memory = memory_rows({**gpu, **tpu, **extra}, model)
    lines += report.section(
      f"{model}: model states per device against N (arguments less the batch, "
      f"{batch_bytes(model) / MIB:.0f} MiB a device)",
      report.table(memory, MEMORY_COLUMNS),
    )
    path, relative = where(f"nodes_memory_{model}.png")
    if path:
      plot_memory(memory, model, path)
      lines += [f"![{model}: model states per device against N]({relative})", ""]
    if gpu and model == "parameter-heavy":  # the model issue 49 states its targets for
      lines += report.section(f"{model}: issue 49's targets", *checks(gpu, model, memory))
  commits = sorted({r["commit"] for by in cache.values() for r in by.values() if "commit" in r})
  lines.append(f"Compiled at commit(s) {', '.join(commits)}; cached in `{args.cache_name}`.")
  return lines


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--targets", nargs="+", default=[*GPU_TARGETS, *TPU_TARGETS])
  parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
  parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=SETUPS)
  default_cache = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nodes.json")
  parser.add_argument("--cache", default=default_cache, help="the JSON file of past compiles")
  parser.add_argument("--refresh", action="store_true", help="compile again what is cached")
  report.add_output_flags(parser, plots=True)
  args = parser.parse_args()
  args.cache_name = os.path.relpath(args.cache)
  clock = report.Clock()
  cache = {}
  if os.path.exists(args.cache):
    with open(args.cache) as f:
      cache = json.load(f)
  try:
    lines = run(args, cache)
  finally:
    with open(args.cache, "w") as out:
      json.dump(cache, out, indent=1, sort_keys=True)
  argv = sys.argv[1:]
  text = "\n".join(
    [report.accelerator_provenance(clock), "", *report.command("nodes.py", argv), "", *lines]
  )
  print(text)
  if args.markdown:
    report.write_markdown(args.markdown, text, BEGIN, "Scaling")


if __name__ == "__main__":
  main()
