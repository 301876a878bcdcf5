"""Command line: ``zerojax-plan PROGRAM --target TARGET``: the plan's table, the winner's code."""

from __future__ import annotations

import argparse
import json
import sys

from zerojax._src.diagnostics import deviceless
from zerojax._src.plan import report
from zerojax._src.plan import search as search_lib
from zerojax._src.plan.compile import LOCAL
from zerojax._src.plan.setup import REMAT, SCHEDULES, SHARDING, Space

_DEFAULT = Space()


def _booleans(text: str) -> tuple[bool, ...]:
  """``"no,yes"`` -> ``(False, True)``."""
  choices = {"no": False, "yes": True}
  words = text.split(",")
  if any(word not in choices for word in words):
    raise argparse.ArgumentTypeError(f"{text!r}: give no, yes or no,yes.")
  return tuple(choices[word] for word in words)


def _words(kind, allowed=None):
  def parse(text: str) -> tuple:
    values = tuple(kind(word) for word in text.split(","))
    wrong = [v for v in values if allowed is not None and v not in allowed]
    if wrong and allowed is not None:
      choices = ", ".join(map(str, allowed))
      raise argparse.ArgumentTypeError(f"{wrong[0]!r} is not one of {choices}.")
    return values

  return parse


def parser() -> argparse.ArgumentParser:
  """The command line's arguments."""
  found = argparse.ArgumentParser(
    prog="zerojax-plan",
    description="Compile a program's candidate setups for a machine (without it) and print the "
    "fastest that fits, as code. Lists are comma-separated.",
  )
  found.add_argument("program", help="the Program: 'module:name' or 'path/to/file.py:name'")
  found.add_argument(
    "--target", required=True, choices=[*deviceless.DEVICELESS_TARGETS, LOCAL], help="the machine"
  )
  word = lambda name, kind, default, allowed=None, text="": found.add_argument(
    f"--{name}",
    type=_words(kind, allowed),
    default=default,
    help=f"{text} (default: {','.join(map(str, default))})",
  )
  word("stages", int, _DEFAULT.stages, (1, 2, 3), "ZeRO stages")
  word("sharding", str, _DEFAULT.sharding, SHARDING, "full, hybrid, hpz")
  word("remat", str, _DEFAULT.remat, REMAT, "what the backward pass keeps")
  word("batches", int, _DEFAULT.batches, None, "examples per data-parallel rank")
  word("pipeline", int, _DEFAULT.pipeline, None, "pipeline stages (1: none)")
  word("schedules", str, _DEFAULT.schedules, SCHEDULES, "pipeline schedules")
  word("microbatches", int, _DEFAULT.microbatches, None, "pipeline micro-batches")
  word("prefetch", int, _DEFAULT.prefetch, (0, 1), "zerojax.scan's prefetch")
  found.add_argument("--offload", type=_words(str, ("none", "optimizer")), default=("none",))
  found.add_argument("--qwz", type=_booleans, default=_DEFAULT.quantized_weights, help="no,yes")
  found.add_argument("--qgz", type=_booleans, default=_DEFAULT.quantized_gradients, help="no,yes")
  found.add_argument("--workers", type=int, default=None, help="compiling processes at once")
  found.add_argument("--cache", default=search_lib.DEFAULT_CACHE, help="past outcomes' directory")
  found.add_argument("--no-cache", action="store_true", help="compile everything again")
  found.add_argument("--exhaustive", action="store_true", help="compile every setup: no pruning")
  found.add_argument("--rows", type=int, default=20, help="table rows to print")
  found.add_argument("--json", help="also write every outcome to this file")
  return found


def main(argv: list[str] | None = None) -> None:
  """Runs ``zerojax-plan``: the plan's table, then the winner as code.

  Example:
    From a shell (``--exhaustive`` compiles every setup, ``--json`` keeps them all)::

      zerojax-plan tests.plan_program:TINY --target v5e-8 --stages 2,3 --batches 1,4
  """
  args = parser().parse_args(argv)
  space = Space(
    stages=args.stages,
    sharding=args.sharding,
    quantized_weights=args.qwz,
    quantized_gradients=args.qgz,
    remat=args.remat,
    offload=tuple(None if o == "none" else o for o in args.offload),
    pipeline=args.pipeline,
    schedules=args.schedules,
    microbatches=args.microbatches,
    batches=args.batches,
    prefetch=args.prefetch,
  )
  try:
    found = search_lib.plan(
      args.program,
      args.target,
      space=space,
      workers=args.workers,
      cache=None if args.no_cache else args.cache,
      prune=not args.exhaustive,
    )
  except ValueError as error:
    sys.exit(f"zerojax-plan: {error}")
  print(report.table(found, args.rows))
  print()
  print(report.code(found) if found.best else "No setup fits: " + report.advice(found))
  if args.json:
    with open(args.json, "w") as out:
      json.dump([o.to_json() for o in found.outcomes], out, indent=1)
