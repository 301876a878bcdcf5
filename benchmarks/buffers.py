"""Where a compiled program's temporaries go, buffer by buffer, from XLA's buffer assignment.

``compiled.memory_analysis()`` gives one number; this compiles the programs of
``big_models.py`` (a transformer of ``transformer.py``'s shapes, any number of
layers) deviceless with XLA's dump switched on
(``--xla_dump_to=DIR --xla_dump_hlo_as_text``) and reads what the compiler
wrote about its own memory:

* **heap**: the size of the temporaries' allocation in the buffer assignment
  (``*buffer-assignment.txt``), what the compiler packs every temporary into
  and checks against the device's memory;
* **max live**: the most bytes of temporaries alive at one point of the
  schedule (``*live-range.txt``), buffers that share memory counted once; heap
  minus max live is fragmentation, room the packing could not use;
* the buffers alive at that point, largest first, with the operation that made
  them.

On GPU ``memory_analysis()``'s temporaries are the heap. On TPU they are not: XLA:TPU reports
more than its buffer assignment packs, most where a loop carries a value an asynchronous
all-gather made (docs/performance.md shows a program reported at 16.5 GiB of temporaries that
compiles for a 16 GiB chip); the table shows both.

``loop:WIDTH`` compiles ``carried_gather``'s loop instead: plain JAX, no zerojax.

Run (each target in a process of its own)::

  python benchmarks/buffers.py v5e-8 --layers 4 --model 70B \\
    "evaluate:GSPMD FSDP" "evaluate:zero3 forward"
  python benchmarks/buffers.py v5e-8 --layers 5 loop:52224
  python benchmarks/buffers.py v5e-64 --model 7.5B --layers 30 --keep "names offloaded" \\
    train:zero3 "train:GSPMD FSDP"

``--keep`` compiles ``train:SIDE`` (a side as ``remat.py`` names it) with the layer
wrapped as ``remat.py``'s setting of that name.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

MIB = 2**20


@dataclasses.dataclass
class Value:
  name: str
  size: int
  offset: int
  shape: str
  op: str = ""


@dataclasses.dataclass
class Accounting:
  """What one compiled program's buffer assignment says of its temporaries."""

  heap: int
  max_live: int
  at: int
  live: list[Value]


def read_dump(directory: str) -> Accounting:
  """The temporaries' heap of the module XLA dumped into ``directory``, and its fullest point."""
  assignment = _one(directory, "*after_optimizations-buffer-assignment.txt")
  heap, values = 0, []
  current = None
  for line in _lines(assignment):
    m = re.match(r"allocation \d+: size (\d+), (.*):$", line.rstrip())
    if m:
      current = "preallocated-temp" in m[2] and "color" not in m[2]
      if current:
        heap = max(heap, int(m[1]))
      continue
    m = re.match(r" value: <\d+ (\S+)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (.*)", line)
    if m and current:
      values.append(Value(m[1], int(m[2]), int(m[3]), m[4]))
    if line.startswith(("Used values", "BufferAssignment stats")):
      current = None
  ops = _ops(_one(directory, "*after_optimizations-buffer-assignment-values.txt"))
  ranges = {}
  for line in _lines(_one(directory, "*after_optimizations-live-range.txt")):
    m = re.match(r"    (\S+):(\d+)-(\d+)$", line)
    if m:
      ranges[m[1]] = (int(m[2]), int(m[3]))
  timed = [(v, ranges.get(v.name) or ranges.get(v.name + "{}")) for v in values]
  timed = [(v, r) for v, r in timed if r]
  for v, _ in timed:
    name = v.name.split("{")[0]
    loop = re.match(r"(wide\.)?(param|while)", name)  # a loop's state, in or out
    v.op = "carried by a loop" if loop else ops.get(name, "")
    index = v.name[len(name) :].strip("{}")
    if v.op and index and not loop:  # one output of a fusion of several operations
      v.op = f"output {index} of a fusion with {v.op}"
  best = (-1, 0, [])
  for t in range(max((r[1] for _, r in timed), default=0) + 1):
    by_offset: dict[int, Value] = {}
    for v, (start, end) in timed:
      if start <= t <= end and v.size > by_offset.get(v.offset, Value("", -1, 0, "")).size:
        by_offset[v.offset] = v  # values sharing a buffer counted once
    total = sum(v.size for v in by_offset.values())
    if total > best[0]:
      best = (total, t, sorted(by_offset.values(), key=lambda v: -v.size))
  return Accounting(heap, best[0], best[1], best[2])


def _lines(path: str) -> list[str]:
  with open(path) as f:
    return f.readlines()


def _one(directory: str, pattern: str) -> str:
  found = sorted(glob.glob(os.path.join(directory, pattern)))
  if not found:
    raise FileNotFoundError(f"no {pattern} in {directory}: was it compiled with --xla_dump_to?")
  return found[-1]


def _ops(path: str) -> dict[str, str]:
  """Each instruction's ``op_name`` (where in the JAX program it came from)."""
  ops = {}
  for line in _lines(path):
    m = re.match(r" from instruction: %(\S+) = .*?op_name=\"([^\"]*)\"", line)
    if m:
      ops[m[1]] = m[2].replace("jit(<unnamed function>)/", "").replace("jit(step)/", "")
  return ops


def carried_gather(target: str, layers: int, width: int):
  """A plain-JAX loop (no zerojax) over ``layers`` square matrices split 8 ways: iteration i
  all-gathers matrix i+1, carried to the next iteration, while it multiplies by matrix i."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  from zerojax.diagnostics import deviceless_mesh

  mesh = deviceless_mesh(target, (8,), ("data",), (AxisType.Explicit,))
  gather = lambda shard: jax.lax.all_gather(shard, "data", axis=0, tiled=True)

  def body(x, w):
    def step(state, i):
      h, current = state
      return (jnp.tanh(h @ current), gather(w[i + 1])), None

    (h, current), _ = jax.lax.scan(step, (x, gather(w[0])), jnp.arange(layers - 1))
    return jnp.tanh(h @ current)

  f = jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P(None, "data")), out_specs=P("data"))
  x = jax.ShapeDtypeStruct((8 * 2048, width), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
  w = jax.ShapeDtypeStruct(
    (layers, width, width), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "data"))
  )
  with jax.set_mesh(mesh):
    return jax.jit(f).lower(x, w)


def child(args: argparse.Namespace) -> None:
  """In a process started for the target: compile the program (XLA dumps it)."""
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  program, setup = args.program.split(":", 1)
  if program == "loop":
    lowered = carried_gather(args.target, args.layers, int(setup))
  else:
    import big_models
    import transformer

    config = dataclasses.replace(transformer.CONFIGS[args.model], layers=args.layers)
    programs = big_models.Programs(config, args.target)
    if args.keep:  # the training step with the layer wrapped as remat.py wraps it
      import remat

      lowered = programs.train(*remat.train_args(programs, args.keep, setup))
    else:
      lowered = programs.lower(program, setup)
  memory = lowered.compile().memory_analysis()
  with open(args.out, "w") as out:
    json.dump(
      {
        "temporaries": memory.temp_size_in_bytes,
        "arguments": memory.argument_size_in_bytes,
        "peak": getattr(memory, "peak_memory_in_bytes", 0),
      },
      out,
    )


def account(
  target: str, model: str, layers: int, program: str, keep: str | None = None
) -> dict[str, Any]:
  """Compiles ``program`` for ``target`` in a child process; its accounting."""
  from zerojax.diagnostics import deviceless_environment

  with tempfile.TemporaryDirectory() as dump:
    out = os.path.join(dump, "memory.json")
    flags = f"--xla_dump_to={dump} --xla_dump_hlo_as_text"
    env = {**os.environ, **deviceless_environment(target, scheduler_log=False, xla_flags=flags)}
    command = [sys.executable, os.path.abspath(__file__), "--child", target, "--out", out]
    command += ["--model", model, "--layers", str(layers), "--program", program]
    command += ["--keep", keep] if keep else []
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
      raise RuntimeError(f"compiling {program} for {target} failed:\n{done.stderr[-3000:]}")
    with open(out) as f:
      return {**json.load(f), "accounting": read_dump(dump)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("target", nargs="?")
  parser.add_argument(
    "programs",
    nargs="*",
    help="PROGRAM:SETUP as big_models.py names them, or loop:WIDTH for carried_gather's loop",
  )
  parser.add_argument("--model", default="70B")
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--top", type=int, default=12, help="buffers listed per program")
  parser.add_argument(
    "--keep", help="train:SIDE with the layer wrapped as remat.py's setting (e.g. 'names saved')"
  )
  parser.add_argument("--child", help=argparse.SUPPRESS)
  parser.add_argument("--out", help=argparse.SUPPRESS)
  parser.add_argument("--program", help=argparse.SUPPRESS)
  args = parser.parse_intermixed_args()
  if args.child:
    args.target = args.child
    child(args)
    return
  print(f"{args.model}'s shapes, {args.layers} layers, on {args.target}; MiB per device\n")
  for program in args.programs:
    found = account(args.target, args.model, args.layers, program, args.keep)
    a = found["accounting"]
    print(
      f"**{program}**: arguments {found['arguments'] / MIB:.0f}; temporaries: reported "
      f"{found['temporaries'] / MIB:.0f}, heap {a.heap / MIB:.0f}, max live "
      f"{a.max_live / MIB:.0f} (fragmentation {(a.heap - a.max_live) / MIB:.0f}); peak reported "
      f"{found['peak'] / MIB:.0f}\n"
    )
    print("| MiB | shape | made by |\n|---|---|---|")
    for v in a.live[: args.top]:
      shape = re.sub(r"\{.*", "", v.shape)
      print(f"| {v.size / MIB:.0f} | `{shape}` | {v.op or v.name} |")
    print()
  quoted = " ".join(f'"{a}"' if " " in a else a for a in sys.argv[1:])
  print(f"```\npython benchmarks/buffers.py {quoted}\n```")


if __name__ == "__main__":
  main()
