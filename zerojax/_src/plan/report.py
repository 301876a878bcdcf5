"""A plan as people read it: a table of the candidates, and the winner as the code to build it."""

from __future__ import annotations

import math

from zerojax._src.plan import program as program_lib
from zerojax._src.plan.compile import Outcome, mesh_shape
from zerojax._src.plan.search import Plan
from zerojax._src.plan.setup import Setup

_GIB = 2**30


def table(plan: Plan, limit: int | None = None) -> str:
  """The candidates as a Markdown table, the fitting ones fastest first, then the others.

  Args:
    plan: what ``zerojax.plan`` returned.
    limit: show at most this many rows (``None``: all).

  Returns:
    The table, and a line on what was pruned and how long the plan took.

  Example:
    >>> from zerojax.planning import Outcome, Plan, Setup, table
    >>> memory = {"peak": 3 * 2**30, "device": 16 * 2**30}
    >>> fits = Outcome(Setup(batch=2), True, memory=memory, step_seconds=0.5,
    ...                estimate="roofline", tokens_per_second=4096.0, mfu=0.41)
    >>> print(table(Plan("model.py:program", "v5e-8", (fits,), (), 12.0)).splitlines()[2])
    | zero3, batch=2 | yes | 3.00 | 0.00 | 0.5 | 4,096 | 41% |
  """
  rows = [*plan.fitting, *(o for o in plan.outcomes if not o.fits)]
  lines = [
    "| setup | fits | peak GiB / device | across nodes GB | step s (estimate) | tokens/s | MFU |",
    "|---|---|---:|---:|---:|---:|---:|",
  ]
  for outcome in rows[:limit]:
    lines.append(_row(outcome))
  estimate = next((o.estimate for o in plan.fitting), "")
  lines += [
    "",
    f"{len(plan.outcomes)} setups compiled for {plan.target} ({plan.cached} from the cache), "
    f"{len(plan.pruned)} pruned, in {plan.seconds:.0f} s. Step times: {estimate or 'none'}"
    " (an estimate, not a measurement).",
  ]
  return "\n".join(lines)


def _row(outcome: Outcome) -> str:
  name = outcome.setup.describe()
  if outcome.error:
    return f"| {name} | no: {outcome.error[:80]} | | | | | |"
  peak = (outcome.memory or {}).get("peak", 0) / _GIB
  seconds = f"{outcome.step_seconds:.3g}" if outcome.step_seconds else ""
  speed = f"{outcome.tokens_per_second:,.0f}" if outcome.tokens_per_second else ""
  mfu = f"{outcome.mfu:.0%}" if outcome.mfu is not None else ""
  fits = "yes" if outcome.fits else "no"
  return (
    f"| {name} | {fits} | {peak:.2f} | {outcome.across_bytes / 1e9:.2f} | {seconds} | {speed} "
    f"| {mfu} |"
  )


def code(plan: Plan, setup: Setup | None = None) -> str:
  """The code that builds ``setup`` (the plan's winner by default), for the program's pieces.

  Raises:
    ValueError: if no candidate fits and no ``setup`` is given.

  Example:
    ``print(zerojax.planning.code(plan))`` after a plan of the tiny test model
    (docs/planning.md shows one), for an 8 x H100 node::

      # zero2, remat=dots, batch=4 on h100x8: the plan's pick.
      mesh = jax.make_mesh((8,), ('data',))
      tx = zerojax.zero2(optimizer, mesh=mesh, axis_name='data')
      ...
  """
  if setup is None:
    if plan.best is None:
      raise ValueError(advice(plan))
    setup = plan.best.setup
  from zerojax._src.plan import workers

  program = workers.load(plan.program)
  shape, names = mesh_shape(plan.target, setup)
  given = {"precision": program.precision} if program.precision else {}
  given |= program_lib.zero_options(setup, names)
  options = [f"{key}={value!r}" for key, value in given.items()]
  policy = program_lib.POLICY_CODE[setup.remat].format(
    names=", ".join(repr(n) for n in program.names)
  )
  scan_options = [f"policy={policy}"] if setup.remat != "full" else []
  scan_options += ["prefetch=0"] if setup.prefetch == 0 else []
  scan_call = ", ".join(["layer", "h", "layers", *scan_options])
  lines = [
    f"# {setup.describe()} on {plan.target}: the plan's pick.",
    f"mesh = jax.make_mesh({shape}, {names})",
    f"tx = zerojax.zero{setup.stage}(optimizer, mesh=mesh, {', '.join(options)})",
    f"# a global batch of {setup.batch} examples per data rank, "
    f"{setup.batch * math.prod(shape) // setup.pipeline} in all, placed with P(tx.batch_axes)",
    "def stack(layers, h):  # in the loss, between the embedding and the head",
    f"  return zerojax.scan({scan_call})[0]",
  ]
  if setup.pipeline > 1:
    lines += [
      f"# the layers restacked by stage: (layers, ...) -> ({setup.pipeline}, layers // "
      f"{setup.pipeline}, ...), placed with P('stage')",
      f"loss = zerojax.pipeline(stack, params['layers'], h, microbatches={setup.microbatches}, "
      f"schedule={setup.schedule!r}, loss_fn=head, loss_params=others, targets=batch)",
    ]
  return "\n".join(lines)


def advice(plan: Plan) -> str:
  """What to try when no setup fits."""
  return (
    f"no setup fits {plan.target}: widen the space (smaller batches, stage 3, remat='full', "
    "offload='optimizer', pipeline stages) or plan for a bigger machine."
  )
