"""Peak host memory of loading a model into stage-3 shards, on 2 processes x 4 CPU devices.

Each way of loading runs as its own 2-process job (``python -m zerojax_launch``) on one file
of about ``--mib`` MiB, and each process reports its peak resident memory (``ru_maxrss``) above
what it held just before loading, and the bytes it read (``rchar`` of ``/proc/self/io``):

* ``zerojax.load_safetensors``;
* ``jax.make_array_from_callback`` with ``safetensors.safe_open(path, "numpy").get_slice(name)``
  per shard (the memory-mapped reader: the pages a strided slice touches count as resident);
* the whole file with ``safetensors.numpy.load_file``, then ``tx.shard``;
* ``zerojax.CheckpointManager.restore`` of a checkpoint of the same parameters (saved at stage 3
  by one process of 8 devices) with Adam's two moments, 3x the parameters' bytes.

On CPU devices the devices' memory is the process's: each process's own half of the model is
part of its growth. Run from the repository root::

  python benchmarks/loading.py --markdown docs/loading.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

MIB = 2**20
WAYS = ("load_safetensors", "safe_open slices", "whole file", "checkpoint restore")
BEGIN, END = "<!-- loading results: begin -->", "<!-- loading results: end -->"


def shapes(mib: int) -> dict[str, tuple[int, ...]]:
  """Half the bytes in leaves split over columns, half in stacked leaves split over rows; 16 MiB
  each (float32)."""
  count = max(1, mib // 32)
  return {
    **{f"wide.{k}": (256, 16384) for k in range(count)},
    **{f"mlp.{k}": (2, 2048, 1024) for k in range(count)},
  }


def resident_mib() -> float:
  return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) / 1024


def bytes_read() -> int:
  return int(Path("/proc/self/io").read_text().split("rchar:")[1].split()[0])


def prepare(directory: Path, mib: int) -> None:
  """Writes ``model.safetensors`` and a stage-3 checkpoint of the same parameters (one process)."""
  import jax
  import numpy as np
  import optax

  import zerojax
  from zerojax._src.checkpoint import tensor_files

  rng = np.random.default_rng(0)
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

  import zerojax

  zerojax.distributed.initialize()
  path = directory / "model.safetensors"
  tx = zerojax.zero3(optax.adam(1e-3), mesh=jax.make_mesh((8,), ("data",)))
  like = {name: jax.ShapeDtypeStruct(s, np.float32) for name, s in shapes(args.mib).items()}
  first = next(iter(like))
  zerojax.load_safetensors(path, tx, {first: like[first]})  # warms up transfers, collectives
  before, read_before = resident_mib(), bytes_read()
  if way == "load_safetensors":
    loaded = zerojax.load_safetensors(path, tx, like)
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


def main() -> None:
  root = Path(__file__).resolve().parent.parent
  env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
  script = [str(Path(__file__).resolve()), "--mib", str(args.mib)]
  with tempfile.TemporaryDirectory() as temporary:
    directory = Path(temporary)
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    run([sys.executable, *script, "--prepare", temporary], env={**env, "XLA_FLAGS": flags})
    file_mib = (directory / "model.safetensors").stat().st_size / MIB
    checkpoint_mib = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    checkpoint_mib = checkpoint_mib / MIB - file_mib
    rows = []
    for way in WAYS:
      launch = [sys.executable, "-m", "zerojax_launch", "-n", "2", "--devices-per-process", "4"]
      run([*launch, *script, "--worker", temporary, "--way", way], env=env, cwd=root)
      reports = [json.loads((directory / f"{way}.p{p}.json").read_text()) for p in (0, 1)]
      size = checkpoint_mib if way == "checkpoint restore" else file_mib
      rows.append((way, size, reports))
  table = [
    "| way | file MiB | held by its devices MiB | peak RSS growth MiB | growth / file | MiB read |",
    "|---|---:|---:|---:|---:|---:|",
  ]
  for way, size, reports in rows:
    growth = " / ".join(f"{r['growth']:.0f}" for r in reports)
    ratio = " / ".join(f"{r['growth'] / size:.2f}" for r in reports)
    read = " / ".join(f"{r['read']:.0f}" for r in reports)
    held = " / ".join(f"{r['held']:.0f}" for r in reports)
    table.append(f"| {way} | {size:.0f} | {held} | {growth} | {ratio} | {read} |")
  import jax

  stamp = (
    f"Measured {datetime.date.today()} with jax {jax.__version__} on {platform.machine()} "
    f"Linux, {os.cpu_count()} CPUs (shared), 2 processes x 4 CPU devices: "
    f"`python benchmarks/loading.py --mib {args.mib}`. Each column gives process 0 / process 1."
  )
  section = "\n".join([BEGIN, stamp, "", *table, END])
  print(section)
  if args.markdown:
    page = Path(args.markdown).read_text()
    start, end = page.index(BEGIN), page.index(END) + len(END)
    Path(args.markdown).write_text(page[:start] + section + page[end:])


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--mib", type=int, default=256, help="the file's size, about")
  parser.add_argument("--markdown", help="write the table into this page, between its markers")
  parser.add_argument("--prepare", type=Path, help=argparse.SUPPRESS)
  parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
  parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.prepare:
    prepare(args.prepare, args.mib)
  elif args.worker:
    worker(args.worker, args.way)
  else:
    main()
