"""Does ``zerojax.plan`` pick well? The planner against the whole space, and against the defaults.

For a transformer of ``plan_models`` (the seeds' 7.5B, or the 70B) on a deviceless
target, a small space is planned twice over one cache: first as
``zerojax.plan`` runs (``prune=True``: a setup that did not fit skips every
larger one), then exhaustively (``prune=False``), which compiles only what the
first run pruned. It reports whether the pick is the exhaustive best, the
compiles each needed and the search time, and the pick's estimated speed
against the defaults (``Setup()``: stage 3, ``remat="full"``) at batch 1 and
at the largest batch they fit. ``--doc`` writes the result into
``docs/planning.md`` 's section "Does it pick well?", one subsection per target.

  PYTHONPATH=.:benchmarks python benchmarks/plan.py --target v5e-64 --doc
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import tempfile

import plan_models

import zerojax
from zerojax.planning import Plan, Setup, Space

SECTION = "## Does it pick well?"
DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "planning.md"
INTRO = """\
Compiling every setup of a space is the planner's ground truth: if the plan's
pick is the exhaustive search's best, pruning lost nothing. For the seeds'
transformers (`benchmarks/transformer.py`: the 7.5B, 30 layers of d 4096, and the 70B, 80
layers of d 8192 with grouped-query attention; 2048-token sequences, bf16 compute, AdamW)
`benchmarks/plan.py` plans a small space (stage 3 sharded over every device, no ZeRO++;
`remat` full or dots, pipeline stages where given; batches per device) with `prune=True`,
then again with
`prune=False` over the same cache, so the second run compiles only what the
first pruned. The step times are the planner's estimates (a roofline on TPU,
XLA:GPU's scheduler on GPU), not measurements: the comparison says the search
finds the estimate's best, not that the estimate is right.
"""


def compare(model: str, target: str, space: Space, cache: str, workers: int) -> dict:
  """The plan and the exhaustive search of ``space`` for ``model`` on ``target``, compared."""
  program = f"plan_models:{plan_models.PROGRAMS[model]}"
  pruned = zerojax.plan(program, target, space=space, workers=workers, cache=cache)
  full = zerojax.plan(program, target, space=space, workers=workers, cache=cache, prune=False)
  fitting = [o for o in full.fitting if o.setup.remat == "full" and _is_default(o.setup)]
  defaults_best = max(fitting, key=lambda o: o.setup.batch, default=None)
  defaults_one = full.outcome(Setup(batch=1))
  return {
    "name": f"{model} on {target}",
    "plan": pruned,
    "full": full,
    "same": (pruned.best and pruned.best.setup) == (full.best and full.best.setup),
    "defaults_best": defaults_best,
    "defaults_one": defaults_one,
    "workers": workers,
  }


def _is_default(setup: Setup) -> bool:
  return setup == Setup(batch=setup.batch)


def _speed(outcome) -> str:
  if outcome is None or not outcome.fits or not outcome.tokens_per_second:
    return "does not fit"
  return f"{outcome.tokens_per_second:,.0f} tokens/s ({outcome.setup.describe()})"


def _ratio(pick, other) -> str:
  if pick is None or other is None or not other.fits or not other.tokens_per_second:
    return ""
  return f", the pick {pick.tokens_per_second / other.tokens_per_second:.2f}x"


def _compiled(plan: Plan) -> int:
  return len(plan.outcomes) - plan.cached


def summary(result: dict) -> str:
  """The comparison as Markdown: the exhaustive table, then what it shows."""
  plan, full = result["plan"], result["full"]
  pick = plan.best
  compile_seconds = sum(o.compile_seconds for o in full.outcomes)
  lines = [
    f"### {result['name']}",
    "",
    "Every setup of the space (the exhaustive run; its last line counts the outcomes it "
    "reused from the plan's cache):",
    "",
    zerojax.planning.table(full),
    "",
    f"* The plan's pick: **{pick.setup.describe() if pick else 'none fits'}**; the exhaustive "
    f"best: **{full.best.setup.describe() if full.best else 'none fits'}**: "
    f"{'the same' if result['same'] else 'DIFFERENT'}.",
    f"* Compiles: the plan {_compiled(plan)} of {len(plan.outcomes) + len(plan.pruned)} "
    f"candidates ({len(plan.pruned)} pruned: "
    f"{', '.join(s.describe() for s in plan.pruned) or 'none'}); the exhaustive search "
    f"{len(full.outcomes)}, {_compiled(full)} of them beyond the plan's.",
    f"* Search time: the plan {plan.seconds:.0f} s "
    f"({'from the cache' if plan.cached else 'every candidate compiled afresh'}); the exhaustive "
    f"run's extra compiles {full.seconds:.0f} s; every compile of the space, summed, "
    f"{compile_seconds:.0f} s ({result['workers']} worker(s)).",
    f'* The pick: {_speed(pick)}. The defaults (`Setup()`: stage 3, `remat="full"`) at the '
    f"largest batch they fit: {_speed(result['defaults_best'])}"
    f"{_ratio(pick, result['defaults_best'])}; at batch 1: {_speed(result['defaults_one'])}"
    f"{_ratio(pick, result['defaults_one'])}.",
  ]
  return "\n".join(lines)


def write_doc(name: str, text: str, command: str) -> None:
  """Puts ``text`` in ``docs/planning.md`` 's section as subsection ``name``."""
  doc = DOC.read_text() if DOC.exists() else ""
  if SECTION not in doc:
    doc = doc.rstrip() + ("\n\n" if doc.strip() else "") + f"{SECTION}\n\n{INTRO}\n"
  start = doc.index(SECTION)
  end = doc.find("\n## ", start + len(SECTION))
  end = len(doc) if end < 0 else end + 1
  section = doc[start:end]
  block = f"{text}\n\nMade by:\n\n```\n{command}\n```\n"
  heading = re.escape(f"### {name}") + r"\n"
  found = re.search(heading + r".*?(?=\n### |\Z)", section, flags=re.S)
  if found:
    section = section[: found.start()] + block.rstrip("\n") + "\n" + section[found.end() :]
  else:
    section = section.rstrip("\n") + "\n\n" + block
  doc = doc[:start] + section.rstrip("\n") + "\n" + ("\n" + doc[end:] if doc[end:] else "")
  DOC.write_text(doc)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default="v5e-64")
  parser.add_argument("--model", default="7.5B", choices=sorted(plan_models.PROGRAMS))
  parser.add_argument("--pipeline", default="1", help="pipeline stage counts to try")
  parser.add_argument("--microbatches", default="1", help="pipeline micro-batch counts")
  parser.add_argument("--batches", default="1,2,4")
  parser.add_argument("--remat", default="full,dots")
  parser.add_argument("--workers", type=int, default=1, help="compiling processes at once")
  parser.add_argument("--cache", default=None, help="default: a fresh temporary directory")
  parser.add_argument("--doc", action="store_true", help="write the result into docs/planning.md")
  args = parser.parse_args(argv)
  space = Space(  # the same setups on every target: one node or many
    stages=(3,),
    sharding=("full",),
    quantized_weights=(False,),
    quantized_gradients=(False,),
    remat=tuple(args.remat.split(",")),
    batches=tuple(int(b) for b in args.batches.split(",")),
    pipeline=tuple(int(s) for s in args.pipeline.split(",")),
    microbatches=tuple(int(m) for m in args.microbatches.split(",")),
  )
  cache = args.cache or tempfile.mkdtemp(prefix="zerojax-plan-bench-")
  text = summary(compare(args.model, args.target, space, cache, args.workers))
  print(text)
  if args.doc:
    command = "PYTHONPATH=.:benchmarks python benchmarks/plan.py " + " ".join(
      a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("--cache")
    )
    write_doc(f"{args.model} on {args.target}", text, command)


if __name__ == "__main__":
  main()
