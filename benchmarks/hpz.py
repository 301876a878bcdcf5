"""ZeRO++ on 2 nodes x 4 devices: where ZeRO-3, hybrid sharding and hpZ move their bytes.

Compiles one training step of a stack of MLP layers for each setup on a
``node=2 x data=4`` mesh, without running it, and reads the compiled program:

* bytes per step per device, split by the mesh axes each collective spans
  (``zerojax.diagnostics.count_collectives_by_axes``), in units of M, the
  model's bytes in the compute dtype;
* the same as the ZeRO++ paper counts cross-node traffic: what crosses into
  or out of one node per step, each byte of an all-gather or a reduce-scatter
  crossing once (a node receives the other nodes' parts once, then shares
  them inside), an all-reduce twice, and an all-to-all as many times as the
  node has devices in it (its chunks are all different);
* per-device memory (``memory_analysis()``): arguments and temporaries, and
  the secondary partitions that ``zerojax.estimate_memory`` predicts hpZ holds;
* what ``zerojax.estimate_communication`` predicts for each axis;
* with ``--target h100x8``, XLA:GPU's estimate of the step
  (``zerojax.diagnostics.scheduler_estimate``), compiled for 8 x H100
  without them (in a process of its own, started with
  ``zerojax.diagnostics.deviceless_environment``).

Usage::

  python benchmarks/hpz.py                      # XLA:CPU, 8 faked devices
  python benchmarks/hpz.py --target h100x8      # compiled for 8 x H100, deviceless
  python benchmarks/hpz.py --path scan          # zerojax.scan's prefetching layers
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import mlp
import numpy as np
import optax
import setups as setups_lib
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from measure import cross_node

import zerojax
from zerojax.diagnostics import (
  deviceless_environment,
  deviceless_mesh,
  deviceless_target,
)

#: Set in the compiling process that ``--target`` starts.
_TARGET_PROCESS = "ZEROJAX_HPZ_BENCHMARK_TARGET"

#: The setups, by name: zerojax.zero3's options on the node x data mesh.
SETUPS = {
  "ZeRO-3": dict(axis_name=("node", "data")),
  "hybrid": dict(axis_name="data", replica_axis="node"),
  "hpZ": dict(axis_name=("node", "data"), secondary_axis="data"),
  "ZeRO-3+qwZ+qgZ": dict(
    axis_name=("node", "data"), quantized_weights="int8", quantized_gradients="int8"
  ),
  "hpZ+qwZ+qgZ": dict(
    axis_name=("node", "data"),
    secondary_axis="data",
    quantized_weights="int8",
    quantized_gradients="int8",
  ),
  # The paper's setting: 16-bit weights and gradients on the wire, int8 weights, int4 gradients.
  "ZeRO-3, bf16": dict(axis_name=("node", "data"), precision="bf16-reduce"),
  "hpZ+qwZ+qgZ, bf16, int4 gradients": dict(
    axis_name=("node", "data"),
    secondary_axis="data",
    precision="bf16-reduce",
    quantized_weights="int8",
    quantized_gradients="int4",
  ),
}
KEYS = (("node", "data"), ("node",), ("data",))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--target", help="compile for this accelerator (h100x8), deviceless")
  parser.add_argument("--path", choices=("gather", "scan"), default="gather")
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--d-model", type=int, default=512, help="the layers are d x 4d, 4d x d")
  parser.add_argument("--tokens", type=int, default=4096, help="tokens per step (all devices)")
  parser.add_argument("--setups", nargs="*", default=list(SETUPS), choices=list(SETUPS))
  parser.add_argument("--json", help="also write the measurements to this file")
  args = parser.parse_args()
  if args.target and not os.environ.get(_TARGET_PROCESS):
    sys.exit(_in_target_process(args.target))
  config = mlp.MlpConfig(args.layers, args.d_model, 4 * args.d_model, args.tokens)
  results = {name: measure(name, config, args.path) for name in args.setups}
  print(report(results, config, args.path))
  if args.json:
    with open(args.json, "w") as out:
      json.dump(results, out, indent=1)


def _in_target_process(target: str) -> int:
  """Runs this script again in a process that compiles for ``target`` (see the docstring)."""
  flags = os.environ.get("XLA_FLAGS", "")
  env = {**os.environ, **deviceless_environment(target, xla_flags=flags), _TARGET_PROCESS: target}
  return subprocess.run([sys.executable, *sys.argv], env=env).returncode


def measure(name: str, config: mlp.MlpConfig, path: str) -> dict:
  """Compiles ``name``'s step and reads its bytes per axis, memory and (GPU) XLA's estimate."""
  target = os.environ.get(_TARGET_PROCESS)
  if target:
    mesh = deviceless_mesh(target, (2, 4), ("node", "data"), (AxisType.Explicit,) * 2)
  else:
    zerojax.distributed.use_cpu_devices(8)
    mesh = jax.make_mesh((2, 4), ("node", "data"))
  options = dict(SETUPS[name])
  if options.get("precision") == "bf16-reduce":
    options["precision"] = zerojax.Precision(params="fp32", compute="bf16", reduce="bf16")
  tx = zerojax.zero3(optax.adam(1e-3), mesh=mesh, **options)
  dtype = tx.precision.compute_dtype(jnp.float32)
  loss = mlp.make_loss(path, jax.checkpoint_policies.dots_saveable, dtype)
  rows = NamedSharding(mesh, P(tx.batch_axes))
  batch = (jax.ShapeDtypeStruct((config.tokens, config.d), jnp.float32, sharding=rows),) * 2
  grad_fn = zerojax.value_and_grad(loss, tx)
  setup = setups_lib.zero_setup(name, tx, grad_fn, mlp.abstract_params(config), batch)
  with zerojax.diagnostics.capture_stderr() as log:
    compiled = setup.compile()
  memory = compiled.memory_analysis()
  # As text: a deviceless executable cannot list its devices; jit's order is the mesh's.
  counted = zerojax.diagnostics.count_collectives_by_axes(compiled.as_text(), mesh)
  result = {
    "bytes": {
      " ".join(axes): {k: c.bytes for k, c in kinds.items() if c.count}
      for axes, kinds in counted.items()
    },
    "model_bytes": config.parameters * np.dtype(dtype).itemsize,
    "arguments": memory.argument_size_in_bytes,
    "temporaries": memory.temp_size_in_bytes,
    "predicted": _predicted(config, tx, mesh),
  }
  if target and deviceless_target(target).platform == "cuda":
    result["cycles"] = zerojax.diagnostics.scheduler_estimate(log[0], compiled).cycles
  return result


def _predicted(config: mlp.MlpConfig, tx, mesh) -> dict:
  """``zerojax.estimate_communication`` and ``estimate_memory``'s predictions."""
  secondary = None if tx.secondary_axis is None else mesh.shape[tx.secondary_axis]
  # The data axes over nodes: the last is the node's (qgZ's round inside), unless hpZ names it.
  per_node = mesh.shape[tx.data_axes[-1]] if len(tx.data_axes) > 1 and secondary is None else None
  bits = lambda quantization: None if quantization is None else f"int{quantization.bits}"
  param_bytes = np.dtype(tx.precision.compute_dtype(np.float32)).itemsize
  communication = zerojax.estimate_communication(
    config.parameters,
    num_devices=tx.num_shards,
    stage=3,
    quantized_weights=bits(tx.quantized_weights),
    quantized_gradients=bits(tx.quantized_gradients),
    replicas=tx.num_replicas,
    param_bytes=param_bytes,
    grad_bytes=np.dtype(tx.precision.reduce_dtype(np.float32)).itemsize,
    secondary_devices=secondary,
    devices_per_node=per_node,
  )
  memory = zerojax.estimate_memory(
    config.parameters,
    num_devices=tx.num_shards,
    stage=3,
    replicas=tx.num_replicas,
    param_bytes=param_bytes,
    secondary_devices=secondary,
  )
  return {"communication": communication._asdict(), "secondary": memory.secondary}


def report(results: dict, config: mlp.MlpConfig, path: str) -> str:
  """Markdown tables: bytes per axis and across nodes in units of M; memory; XLA's estimate."""
  target = os.environ.get(_TARGET_PROCESS)
  lines = [
    f"{config.layers} layers of d_model {config.d} (two {config.d} x {config.hidden} "
    f"matrices each), {config.tokens} tokens a step, Adam, path `{path}`, mesh node=2 x "
    f"data=4, compiled for {target or 'XLA:CPU'}; M = the model's bytes in the compute dtype.",
    "",
    "| setup | all-gather over node, data | reduce over node, data | over node | over data "
    "| across nodes, paper's accounting | estimator: across / inside |",
    "|---|---|---|---|---|---|---|",
  ]
  for name, r in results.items():
    m, by = r["model_bytes"], r["bytes"]
    joint = by.get("node data", {})
    gathered = joint.get("all-gather", 0)
    cells = [gathered, sum(joint.values()) - gathered]
    cells += [sum(by.get(axes, {}).values()) for axes in ("node", "data")]
    predicted = r["predicted"]["communication"]
    if SETUPS[name].get("replica_axis") == "node":  # only the sum across replicas crosses
      across = predicted["replica_reductions"]
    else:  # everything but hpZ's gathers and qgZ's first round, inside the node
      across = predicted["total"] - predicted["secondary_gathers"] - predicted["inner_reductions"]
    inside = predicted["total"] - across
    lines.append(
      f"| {name} | "
      + " | ".join(f"{c / m:.3f} M" for c in cells)
      + f" | {cross_node(by, 4) / m:.2f} M | {across / m:.3f} / {inside / m:.3f} M |"
    )
  cycles = any("cycles" in r for r in results.values())
  lines += [
    "",
    "| setup | arguments MiB | temporaries MiB | estimator's secondary MiB"
    + (" | XLA's estimate, cycles |" if cycles else " |"),
    "|---|---|---|---" + ("|---|" if cycles else "|"),
  ]
  for name, r in results.items():
    lines.append(
      f"| {name} | {r['arguments'] / 2**20:.1f} | {r['temporaries'] / 2**20:.1f} | "
      f"{r['predicted']['secondary'] / 2**20:.1f} |"
      + (f" {r['cycles']:,.0f} |" if "cycles" in r else "")
    )
  return "\n".join(lines)


if __name__ == "__main__":
  main()
