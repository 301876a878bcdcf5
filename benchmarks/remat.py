"""What the backward pass keeps, compiled: big models' training steps under the user's checkpoints.

The training step of ``big_models.py`` (the 7.5B and 70B transformers of
``transformer.py``, float32 parameters and AdamW, bfloat16 compute), its
layer written once and wrapped by the user as a user wraps it, on both sides
of the comparison: zerojax's stage 3 (``zerojax.scan``, where the layer's
checkpoint decides) and GSPMD FSDP (``jax.lax.scan``
under ``jax.jit`` on annotated parameters). The settings (``KEEPS``):

* ``no remat``: no checkpoint (``zerojax.scan(..., policy="everything_saveable")``
  saves every value but the gathered weights, ``jax.lax.scan`` every value);
* ``full remat``: ``jax.checkpoint(layer)`` (``nothing_saveable``);
* ``dots saved``: ``dots_with_no_batch_dims_saveable``;
* ``names saved``: ``save_only_these_names`` of ``transformer.NAMES`` (the
  query and key-value projections, the MLP's hidden activations);
* ``names offloaded``: ``save_and_offload_only_these_names`` of the same
  names, from ``"device"`` to ``"pinned_host"``.

Compiled deviceless, each machine in a ``zerojax.diagnostics.DevicelessProcess``
of its own (which runs ``compile_row``), cached in ``--cache`` one program at a
time, each row stamped with the commit it was compiled at (``+``: with changes);
a cached row is not compiled again unless ``--again`` is passed, so after a
change to zerojax pass ``--again`` or a fresh ``--cache``. ``--largest`` finds, for a setting, the
most sequences a device that still fit, by compiling (doubling, then
bisecting), on both sides.

Run::

  python benchmarks/remat.py --only 7.5B:v5e-64 --markdown docs/big_models.md
  python benchmarks/remat.py --only 70B:v5e-256 --settings "full remat" --settings "dots saved"
  python benchmarks/remat.py --only 7.5B:v5e-64 --largest "full remat"
  python benchmarks/remat.py --only 7.5B:v5e-64 --layers 8 --settings "full remat"
  python benchmarks/remat.py --only 7.5B:v5e-64 --sides "zero3, bf16 reductions"

``--layers`` compiles the model with fewer (or more) layers, cached apart: how
the temporaries grow with depth. ``--sides "zero3, bf16 reductions"`` compiles
stage 3 reducing its gradients in bfloat16, as GSPMD FSDP's bfloat16 matmuls
make them (rows of their own beside ``zero3``'s float32 reductions): the
like-for-like comparison. ``--sides "zero3, prefetch=0"`` compiles stage 3 with
``zerojax.scan(..., prefetch=0)``: each layer gathered in its own iteration.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import big_models
import jax
import report
import transformer

from zerojax.diagnostics import DevicelessProcess, deviceless_target

_policies = jax.checkpoint_policies
#: What the backward pass keeps: the user's wrapping of the layer, the same on both sides.
KEEPS = {
  "no remat": lambda f: f,
  "full remat": jax.checkpoint,
  "dots saved": functools.partial(
    jax.checkpoint, policy=_policies.dots_with_no_batch_dims_saveable
  ),
  "names saved": functools.partial(
    jax.checkpoint, policy=_policies.save_only_these_names(*transformer.NAMES)
  ),
  "names offloaded": functools.partial(
    jax.checkpoint,
    policy=_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=[],
      names_which_can_be_offloaded=list(transformer.NAMES),
      offload_src="device",
      offload_dst="pinned_host",
    ),
  ),
}
#: zerojax's stage 3 (``precision="bf16"``: gradients reduced in float32), GSPMD FSDP, and
#: (``--sides``) stage 3 reducing in bfloat16 as GSPMD FSDP does, or without prefetching.
SIDES = ("zero3", "GSPMD FSDP")
BF16_REDUCTIONS = "zero3, bf16 reductions"
#: (``--sides``) stage 3 gathering each layer in its own iteration (``zerojax.scan(...,
#: prefetch=0)``): no gathered layer carried from one iteration to the next.
PREFETCH_0 = "zero3, prefetch=0"
GIB = big_models.GIB


def key(setting: str, side: str, sequences: int) -> str:
  return f"{setting} | {side} | {sequences}"


def config_of(model: str, layers: int | None) -> transformer.Config:
  """``model``'s shape, with ``layers`` layers if given."""
  config = transformer.CONFIGS[model]
  return config if layers is None else dataclasses.replace(config, layers=layers)


def cache_path(cache: Path, model: str, target: str, layers: int | None) -> Path:
  depth = "" if layers is None else f"-{layers}layers"
  return cache / f"{model}{depth}-{target}.json"


@functools.cache
def _programs(model: str, target: str, layers: int | None, sequences: int) -> big_models.Programs:
  return big_models.Programs(config_of(model, layers), target, sequences)


def compile_row(
  model: str, target: str, layers: int | None, setting: str, side: str, sequences: int
) -> dict[str, Any]:
  """One program's row: ``big_models.measure`` 's per-device bytes, or the compiler's refusal
  (in a ``DevicelessProcess`` for ``target``: ``Compiler.row`` calls this)."""
  programs = _programs(model, target, layers, sequences)
  return big_models.measure(programs.train, *train_args(programs, setting, side))


def train_args(programs: big_models.Programs, setting: str, side: str) -> tuple[Any, ...]:
  """``programs.train`` 's arguments for ``side`` 's step, the layer wrapped as ``setting``."""
  tx = programs.bf16_reductions_tx if side == BF16_REDUCTIONS else programs.tx
  return side != "GSPMD FSDP", tx, KEEPS[setting], 0 if side == PREFETCH_0 else 1


class Compiler:
  """Compiles ``model``'s training step on ``target`` in ``process`` (a ``DevicelessProcess``
  for it), caching each program's row in ``path`` as soon as it is compiled, stamped with the
  commit it was compiled at."""

  def __init__(self, model: str, target: str, layers: int | None, path: Path, process: Any):
    self.model, self.target, self.layers, self.path = model, target, layers, path
    self.machine = deviceless_target(target)
    self.rows = json.loads(path.read_text()) if path.exists() else {}
    self.process = process

  def row(self, setting: str, side: str, sequences: int = 1) -> dict[str, Any]:
    name = key(setting, side, sequences)
    if name not in self.rows:
      clock = report.Clock()
      args = (self.model, self.target, self.layers, setting, side, sequences)
      row = self.process.call(f"{__file__}:compile_row", *args)
      self.rows[name] = row | {"seconds": clock.elapsed(), "commit": report.commit()}
      self.path.write_text(json.dumps(self.rows, indent=1))
      print(f"{self.model} on {self.target}, {name}: {self.rows[name]}", flush=True)
    return self.rows[name]

  def fits(self, setting: str, side: str, sequences: int) -> bool:
    return not big_models.note(self.row(setting, side, sequences), self.machine)

  def largest(self, setting: str, side: str) -> int:
    """The most sequences a device that fit (0 if one does not): doubling, then bisecting."""
    if not self.fits(setting, side, 1):
      return 0
    low = 1
    while self.fits(setting, side, 2 * low):
      low *= 2
    high = 2 * low  # low fits, high does not
    while high - low > 1:
      middle = (low + high) // 2
      low, high = (middle, high) if self.fits(setting, side, middle) else (low, middle)
    return low


def run(name: str, args: argparse.Namespace) -> dict[str, Any]:
  """``name``'s cached rows, after compiling what is missing in a ``DevicelessProcess`` for its
  machine (``--again``: everything asked for)."""
  model, target = name.split(":")
  args.cache.mkdir(parents=True, exist_ok=True)
  path = cache_path(args.cache, model, target, args.layers)
  if args.cached:
    return json.loads(path.read_text()) if path.exists() else {}
  with DevicelessProcess(target, scheduler_log=False) as process:
    compiler = Compiler(model, target, args.layers, path, process)
    settings, sides = args.settings or list(KEEPS), args.sides or list(SIDES)
    if args.again:  # forget what this run compiles, at every batch
      largest = set(args.largest or ())
      forget = lambda parts: (
        (parts[0] in settings and parts[1] in sides) or bool({parts[0], parts[1]} & largest)
      )
      compiler.rows = {k: v for k, v in compiler.rows.items() if not forget(k.split(" | "))}
    for setting in settings:
      for side in sides:
        compiler.row(setting, side)
    for setting in args.largest or ():
      for side in SIDES:
        compiler.rows[f"largest | {setting} | {side}"] = compiler.largest(setting, side)
        compiler.path.write_text(json.dumps(compiler.rows, indent=1))
  return compiler.rows


def section(name: str, rows: dict[str, Any], layers: int | None = None) -> list[str]:
  """The table of ``name``'s settings at one sequence a device, zerojax's rows beside GSPMD's."""
  model, target = name.split(":")
  config, machine = config_of(model, layers), deviceless_target(target)
  layer = 2 * config.layer_parameters / GIB  # one layer in the compute dtype, bfloat16
  cell = lambda row, k: f"{row[k]:.2f}" if row.get(k) is not None else "-"
  lines = []
  for setting in KEEPS:
    gspmd = rows.get(key(setting, "GSPMD FSDP", 1))
    for side in ("zero3", BF16_REDUCTIONS, PREFETCH_0, "GSPMD FSDP"):
      row = rows.get(key(setting, side, 1))
      if row is None:
        continue
      fits, needs = verdict(row, machine)
      host = sum(row.get(f"host {k}", 0) for k in ("temp", "argument", "output"))
      line = {
        "setting": setting,
        "side": side,
        "fits": fits or "yes",
        "temporaries": "-" if needs is None else f"{needs:.2f}" + (" (refused)" if fits else ""),
        "peak": cell(row, "peak"),
        "host": f"{host:.2f}" if "host temp" in row else "-",
        "vs GSPMD": "",
        "peak vs GSPMD": "",
      }
      gspmd_fits, gspmd_needs = verdict(gspmd, machine) if gspmd else ("", None)
      if side != "GSPMD FSDP" and needs is not None and gspmd_needs is not None:
        over = needs - gspmd_needs
        line["vs GSPMD"] = f"{over:+.2f} GiB = {over / layer:+.2f} layers" + (
          ": target met" if over <= layer + 1e-9 else ": TARGET MISSED"
        ) * (not gspmd_fits)
        if row.get("peak") is not None and gspmd.get("peak") is not None:
          line["peak vs GSPMD"] = f"{row['peak'] - gspmd['peak']:+.2f}"
      lines.append(line)
  columns = ("setting", "side", "fits", "temporaries", "peak", "host", "vs GSPMD", "peak vs GSPMD")
  titles = {
    "temporaries": "temporaries GiB",
    "peak": "peak GiB",
    "host": "host GiB (temp + args + outputs)",
    "vs GSPMD": "zero3 - GSPMD temporaries (target: at most one layer)",
    "peak vs GSPMD": "zero3 - GSPMD peak GiB",
  }
  out = report.section(
    f"{config.parameters / 1e9:.1f}B parameters ({config.layers} layers, d {config.d}) on "
    f"{target} ({machine.device_count} devices of {machine.hbm_bytes / GIB:.0f} GiB), one "
    f"sequence of {config.seq_len} tokens a device; one layer in bfloat16 is {layer:.2f} GiB",
    report.table(lines, {k: (titles.get(k, k), "s") for k in columns}),
  )
  programs = [r for r in rows.values() if isinstance(r, dict)]
  seconds = sum(r.get("seconds", 0) for r in programs)
  commits = sorted({r["commit"] for r in programs if "commit" in r})
  unstamped = sum("commit" not in r for r in programs)
  at = f", at commit(s) {', '.join(commits)}" if commits else ""
  if commits and unstamped:
    at += f" ({unstamped} of the {len(programs)} rows compiled before rows were stamped)"
  out[-1:-1] = ["", f"Compiling these programs took {seconds:.0f} s{at}."]
  largest = [k for k in rows if k.startswith("largest | ")]
  if largest:
    found = [f"{k.split(' | ')[2]}, {k.split(' | ')[1]}: {rows[k]}" for k in largest]
    out += report.section(
      f"Largest per-device batch that fits on {target} (sequences of {config.seq_len} tokens, "
      "found by compiling: doubling, then bisecting)",
      "\n".join(f"- {line}" for line in found + tried_lines(rows, largest, machine)),
    )
  return out


def verdict(row: dict[str, Any], machine: Any) -> tuple[str, float | None]:
  """Why ``row``'s program does not fit ("" if it does), and the temporaries it needs, GiB (also
  where XLA:TPU refuses them: its message says how many; ``None`` where it does not)."""
  why = big_models.note(row, machine)
  refused = re.search(r"HLO temporaries \(([\d.]+)G\) exceeds available HBM \(([\d.]+)G", why)
  if refused:  # XLA:TPU's "G" are GiB (a v5e chip's 16 GiB are 15.75G to it)
    return f"no: XLA:TPU refuses it ({refused[2]} GiB available)", float(refused[1])
  return why, row.get("temporaries")


def tried_lines(rows: dict[str, Any], largest: list[str], machine: Any) -> list[str]:
  """What each search compiled: sequences a device, and whether it fit (temporaries, GiB)."""
  lines = []
  for k in largest:
    _, setting, side = k.split(" | ")
    tried = []
    for name, row in rows.items():
      parts = name.split(" | ")
      if len(parts) == 3 and parts[:2] == [setting, side]:
        fits = not big_models.note(row, machine)
        temporaries = f"{row['temporaries']:.2f} GiB" if "temporaries" in row else "refused"
        tried.append((int(parts[2]), f"{parts[2]}: {temporaries}" + ("" if fits else " (no)")))
    lines.append(f"{side}, {setting}, compiled: " + ", ".join(t for _, t in sorted(tried)))
  return lines


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--only", action="append", choices=big_models.RUNS)
  parser.add_argument("--settings", action="append", choices=tuple(KEEPS))
  parser.add_argument("--largest", action="append", choices=tuple(KEEPS))
  parser.add_argument("--sides", action="append", choices=(*SIDES, BF16_REDUCTIONS, PREFETCH_0))
  parser.add_argument("--layers", type=int, help="compile the model with this many layers")
  parser.add_argument("--cache", type=Path, default=Path("/tmp/zerojax-remat"))
  parser.add_argument("--again", action="store_true", help="compile again what is cached")
  parser.add_argument("--cached", action="store_true", help="compile nothing: show the cache")
  report.add_output_flags(parser)
  args = parser.parse_args()
  clock = report.Clock()
  lines = []
  for name in args.only or big_models.RUNS:
    rows = run(name, args)
    lines += section(name, rows, args.layers) if rows else []
  text = "\n".join(
    [
      *lines,
      report.accelerator_provenance(clock),
      "",
      *report.command("remat.py", [shlex.quote(a) for a in sys.argv[1:]]),
    ]
  )
  print(text)
  if args.markdown:
    begin = "<!-- results: remat.py -->"
    report.write_markdown(args.markdown, text, begin, "Models bigger than a device")


if __name__ == "__main__":
  main()
