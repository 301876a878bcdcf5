"""Peak host memory of loading a model into stage-3 shards, on 2 processes x 4 CPU devices.

Each way of loading runs as its own 2-process job (``python -m zerojax_launch``) on one file
of about ``--mib`` MiB, and each process reports its peak resident memory (``ru_maxrss``) above
what it held just before loading, and the bytes it read (``rchar`` of ``/proc/self/io``):

* ``zerojax.load_safetensors``;
* ``jax.make_array_from_callback`` with ``safetensors.safe_open(path, "numpy").get_slice(name)``
  per shard (the memory-mapped reader: the pages a strided slice touches count as resident);
* the whole file with ``safetensors.numpy.load_file``, then ``tx.shard``;
* ``zerojax.CheckpointManager.restore`` of a checkpoint of the same parameters (saved at stage 3
  by one process of 8 devices) with Adam's two moments, 3x the parameters' bytes;
* ``zerojax.load_safetensors`` of a file written by HuggingFace's ``safetensors`` (issue 56:
  ``model.layers.{i}.mlp.up_proj.weight``, (2048, 4096) float32 as PyTorch keeps them, one a
  32 MiB, and a (1021, 4096) embedding), with ``keys`` that stack the layers and transpose them
  into one scanned (layers, 4096, 2048) leaf, on mesh axes of each type.

On CPU devices the devices' memory is the process's: each process's own half of the model is
part of its growth, and the floor. Run from the repository root::

  python benchmarks/loading.py --markdown docs/loading.md
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

MIB = 2**20
#: The ways of loading ``model.safetensors`` (or its checkpoint), then ``huggingface.safetensors``.
WAYS = ("load_safetensors", "safe_open slices", "whole file", "checkpoint restore")
HUGGINGFACE_WAYS = (
  "load_safetensors: HuggingFace's file, keys=, Explicit axes",
  "load_safetensors: HuggingFace's file, keys=, Auto axes",
)
BEGIN = "<!-- loading results: begin -->"
#: The files the ways load: ``model.safetensors`` for ``WAYS``, the other for ``HUGGINGFACE_WAYS``.
FILES = ("model.safetensors", "huggingface.safetensors")


def shapes(mib: int) -> dict[str, tuple[int, ...]]:
  """Half the bytes in leaves split over columns, half in stacked leaves split over rows; 16 MiB
  each (float32)."""
  count = max(1, mib // 32)
  return {
    **{f"wide.{k}": (256, 16384) for k in range(count)},
    **{f"mlp.{k}": (2, 2048, 1024) for k in range(count)},
  }


def huggingface_layers(mib: int) -> list[str]:
  """The names of the HuggingFace file's layers: one a 32 MiB, about ``mib`` MiB of them."""
  return [f"model.layers.{i}.mlp.up_proj.weight" for i in range(max(1, mib // 32))]


def huggingface_like(mib: int) -> tuple[dict, dict]:
  """The leaves of a scanned model, (in, out), and the ``keys`` that read them from the file."""
  import jax
  import numpy as np

  import zerojax

  layers = huggingface_layers(mib)
  like = {
    "layers": jax.ShapeDtypeStruct((len(layers), 4096, 2048), np.float32),
    "embed": jax.ShapeDtypeStruct((1021, 4096), np.float32),
  }
  keys = {"layers": zerojax.FileKey(layers, transpose=(1, 0)), "embed": "model.embed_tokens.weight"}
  return like, keys


def resident_mib() -> float:
  return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) / 1024


def bytes_read() -> int:
  return int(Path("/proc/self/io").read_text().split("rchar:")[1].split()[0])


def prepare(directory: Path, mib: int) -> None:
  """Writes ``model.safetensors``, a stage-3 checkpoint of the same parameters (one process), and
  ``huggingface.safetensors`` with HuggingFace's writer."""
  import jax
  import numpy as np
  import optax
  from safetensors.numpy import save_file

  import zerojax
  from zerojax._src.checkpoint import tensor_files

  rng = np.random.default_rng(0)
  normal = lambda *shape: rng.standard_normal(shape, np.float32)
  # Saved one tensor at a time: the file alone is the benchmark's size.
  huggingface = {name: normal(2048, 4096) for name in huggingface_layers(mib)}
  huggingface["model.embed_tokens.weight"] = normal(1021, 4096)
  save_file(huggingface, str(directory / "huggingface.safetensors"))
  del huggingface
  arrays = {name: rng.standard_normal(shape, np.float32) for name, shape in shapes(mib).items()}
  tensor_files.write(directory / "model.safetensors", arrays)
  tx = zerojax.zero3(optax.adam(1e-3), mesh=jax.make_mesh((8,), ("data",)))
  params = tx.shard(arrays)
  del arrays
  spec = zerojax.train_state_spec(tx, params)
  with zerojax.CheckpointManager(directory / "checkpoint", spec, async_save=False) as manager:
    manager.save(0, {"params": params, "opt_state": tx.init(params)})


def worker(directory: Path, way: str) -> None:
  """One process of a 2-process job: loads one way, writes ``p<process>.json``."""
  import jax
  import numpy as np
  import optax
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import zerojax

  zerojax.distributed.initialize()
  path = directory / "model.safetensors"
  axis_type = jax.sharding.AxisType.Auto if way == HUGGINGFACE_WAYS[1] else None
  mesh = jax.make_mesh((8,), ("data",), None if axis_type is None else (axis_type,))
  tx = zerojax.zero3(optax.adam(1e-3), mesh=mesh)
  like = {name: jax.ShapeDtypeStruct(s, np.float32) for name, s in shapes(args.mib).items()}
  # JAX started: the processes' first collective, and a small array on every device.
  multihost_utils.sync_global_devices("started")
  jax.block_until_ready(jax.device_put(np.zeros(8 * 1024, np.float32), NamedSharding(mesh, P())))
  before, read_before = resident_mib(), bytes_read()
  if way == "load_safetensors":
    loaded = zerojax.load_safetensors(path, tx, like)
  elif way in HUGGINGFACE_WAYS:
    like, keys = huggingface_like(args.mib)
    loaded = zerojax.load_safetensors(directory / FILES[1], tx, like, keys=keys)
  elif way == "safe_open slices":
    from safetensors import safe_open

    shardings = tx.param_shardings(like)
    with safe_open(str(path), "numpy") as file:
      loaded = {
        name: jax.make_array_from_callback(
          like[name].shape, shardings[name].value, lambda index, n=name: file.get_slice(n)[index]
        )
        for name in like
      }
  elif way == "whole file":
    from safetensors.numpy import load_file

    loaded = tx.shard(load_file(str(path)))
  else:
    spec = zerojax.train_state_spec(tx, like)
    with zerojax.CheckpointManager(directory / "checkpoint", spec) as manager:
      loaded = manager.restore()
  jax.block_until_ready(loaded)
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  held = sum(s.data.nbytes for x in jax.tree.leaves(loaded) for s in x.addressable_shards) / MIB
  report = {"growth": peak - before, "held": held, "read": (bytes_read() - read_before) / MIB}
  (directory / f"{way}.p{jax.process_index()}.json").write_text(json.dumps(report))


def run(command: list[str], **options) -> None:
  done = subprocess.run(command, capture_output=True, text=True, **options)
  if done.returncode:
    raise SystemExit(done.stdout[-2000:] + done.stderr[-4000:])


def row(way: str, size: float, reports: list[dict]) -> dict[str, Any]:
  """A row of the table: ``way`` of loading a file of ``size`` MiB, as each process reported it."""
  each = lambda spec, value: " / ".join(format(value(r), spec) for r in reports)
  return {
    "way": way,
    "file": size,
    "held": each(".0f", lambda r: r["held"]),
    "growth": each(".0f", lambda r: r["growth"]),
    "per held": each(".2f", lambda r: r["growth"] / r["held"]),
    "per file": each(".2f", lambda r: r["growth"] / size),
    "read": each(".0f", lambda r: r["read"]),
  }


def main() -> None:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the provenance names the CPU the jobs ran on
  import report

  clock = report.Clock()
  root = Path(__file__).resolve().parent.parent
  env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
  script = [str(Path(__file__).resolve()), "--mib", str(args.mib)]
  rows = []
  with tempfile.TemporaryDirectory() as temporary:
    directory = Path(temporary)
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    run([sys.executable, *script, "--prepare", temporary], env={**env, "XLA_FLAGS": flags})
    sizes = {name: (directory / name).stat().st_size / MIB for name in FILES}
    checkpoint_mib = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    checkpoint_mib = checkpoint_mib / MIB - sum(sizes.values())
    for way in (*WAYS, *HUGGINGFACE_WAYS):
      launch = [sys.executable, "-m", "zerojax_launch", "-n", "2", "--devices-per-process", "4"]
      run([*launch, *script, "--worker", temporary, "--way", way], env=env, cwd=root)
      reports = [json.loads((directory / f"{way}.p{p}.json").read_text()) for p in (0, 1)]
      size = sizes[FILES[way in HUGGINGFACE_WAYS]]
      size = checkpoint_mib if way == "checkpoint restore" else size
      rows.append(row(way, size, reports))
  columns = {
    "way": ("way", "s"),
    "file": ("file MiB", ".0f"),
    "held": ("held by its devices MiB", "s"),
    "growth": ("peak RSS growth MiB", "s"),
    "per held": ("growth / held", "s"),
    "per file": ("growth / file", "s"),
    "read": ("MiB read", "s"),
  }
  section = "\n".join(
    [
      f"{report.provenance(8, clock)} 2 processes x 4 CPU devices; each column gives process 0 / "
      "process 1. Made by:",
      "",
      *report.command("loading.py", ["--mib", str(args.mib), "--markdown", "docs/loading.md"]),
      "",
      report.table(rows, columns),
    ]
  )
  print(section)
  if args.markdown:
    report.write_markdown(args.markdown, section, BEGIN, "Loading pretrained weights into shards")


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--mib", type=int, default=256, help="the file's size, about")
  parser.add_argument("--markdown", help="write the table into this page, between its markers")
  parser.add_argument("--prepare", type=Path, help=argparse.SUPPRESS)
  parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
  parser.add_argument("--way", choices=(*WAYS, *HUGGINGFACE_WAYS), help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.prepare:
    prepare(args.prepare, args.mib)
  elif args.worker:
    worker(args.worker, args.way)
  else:
    main()
