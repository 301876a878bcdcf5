"""XLA:GPU's own estimate of a step, read from its latency-hiding scheduler's log.

When XLA:GPU schedules a program it logs, for each computation it schedules
(the entry, each loop body), "Total cycles" (its estimated length) and "Total
wasted cycles" (the part spent waiting on collectives). A step's estimate is
each computation's cycles times how often it runs: the product of the trip
counts of the loops it sits in. It is XLA's cost model, not a measurement:
compare setups side by side with it. A loop body with no collective is not
logged; such bodies are listed as ``silent``, since the step's sum leaves
them out.
"""

from __future__ import annotations

import dataclasses
import re

import jax

from zerojax._src.diagnostics import hlo as hlo_lib


@dataclasses.dataclass(frozen=True)
class ComputationEstimate:
  """One scheduled computation: its estimate and how often a step runs it.

  Attributes:
    name: the computation (a loop body, or the entry).
    executions: how many times one step runs it (trip counts multiplied).
    cycles: XLA's estimated length of one execution.
    wasted: the part of ``cycles`` spent waiting on collectives.

  Example:
    >>> from zerojax.diagnostics import ComputationEstimate
    >>> ComputationEstimate("body", executions=15, cycles=1000.0, wasted=250.0).waiting
    0.25
  """

  name: str
  executions: int
  cycles: float
  wasted: float

  @property
  def waiting(self) -> float:
    """How much of the computation is spent waiting on collectives, as a share (0 to 1)."""
    return self.wasted / self.cycles if self.cycles else 0.0


@dataclasses.dataclass(frozen=True)
class StepEstimate:
  """XLA:GPU's estimate of one step, per computation.

  Attributes:
    computations: every computation the scheduler logged, the entry last.
    silent: loop bodies that run but were not logged (no collective in them),
      so that ``cycles`` leaves them out.

  Example:
    >>> from zerojax.diagnostics import ComputationEstimate, StepEstimate
    >>> body = ComputationEstimate("body", executions=15, cycles=1000.0, wasted=250.0)
    >>> entry = ComputationEstimate("main", executions=1, cycles=3000.0, wasted=0.0)
    >>> step = StepEstimate((body, entry), silent=())
    >>> step.cycles, step.wasted, [loop.name for loop in step.loops]
    (18000.0, 3750.0, ['body'])
  """

  computations: tuple[ComputationEstimate, ...]
  silent: tuple[str, ...]

  @property
  def cycles(self) -> float:
    """The step's estimated length, the sum of each computation's cycles times its executions."""
    return sum(c.cycles * c.executions for c in self.computations)

  @property
  def wasted(self) -> float:
    """How much of ``cycles`` is spent waiting on collectives."""
    return sum(c.wasted * c.executions for c in self.computations)

  @property
  def loops(self) -> tuple[ComputationEstimate, ...]:
    """The loop bodies, the computations that run more than once per step."""
    return tuple(c for c in self.computations if c.executions > 1)


_HEADER = re.compile(r"\[latency-hiding-scheduler\] Statistics (before|after) scheduling")
_COMPUTATION = re.compile(r"For computation: (\S+), module (\S+)")
_TOTAL = re.compile(r"Total (wasted )?cycles: ([\d.eE+-]+)")


def scheduler_estimate(log: str | list[str], hlo: str | jax.stages.Compiled) -> StepEstimate:
  """The step estimate XLA:GPU logged while compiling ``hlo``.

  Compile in a process started with
  ``zerojax.diagnostics.deviceless_environment("h100x8")`` (or with
  ``TF_CPP_MIN_LOG_LEVEL=0`` and ``TF_CPP_VMODULE=latency_hiding_scheduler=1``
  on a GPU host), and capture its standard error during the compilation.

  Args:
    log: the captured log (statistics of other modules are ignored): its
      text, or the list ``capture_stderr`` yields.
    hlo: the compiled program (``compiled.as_text()``, or the ``Compiled``).

  Returns:
    The ``StepEstimate``.

  Raises:
    ValueError: if the log holds no statistics for this program.

  Example:
    >>> log = '''
    ... [latency-hiding-scheduler] Statistics after scheduling:
    ... For computation: body, module jit_step(1)
    ... Total wasted cycles: 5
    ... Total cycles: 20
    ... [latency-hiding-scheduler] Statistics after scheduling:
    ... For computation: main, module jit_step(1)
    ... Total wasted cycles: 0
    ... Total cycles: 100
    ... '''
    >>> hlo = '''HloModule jit_step
    ... body {
    ...   p = (s32[]) parameter(0)
    ... }
    ... cond {
    ...   p = (s32[]) parameter(0)
    ... }
    ... ENTRY main {
    ...   t = (s32[]) tuple()
    ...   w = (s32[]) while(t), body=body, backend_config={"known_trip_count":{"n":"3"}}
    ... }
    ... '''
    >>> estimate = scheduler_estimate(log, hlo)
    >>> estimate.cycles, estimate.wasted, [(c.name, c.executions) for c in estimate.loops]
    (160.0, 15.0, [('body', 3)])
    >>> scheduler_estimate([log], hlo) == estimate  # as capture_stderr() yields it
    True
  """
  log = "".join(log) if isinstance(log, list) else log
  text = hlo_lib.text_of(hlo)
  module = re.match(r"HloModule ([\w.\-]+)", text)
  module_name = module.group(1) if module else None
  computations, entry = hlo_lib.parse_module(text)
  executions = hlo_lib.executions(computations, entry)
  logged = _statistics(log, module_name)
  if not logged:
    raise ValueError(
      f"the log holds no latency-hiding scheduler statistics for module {module_name!r}: "
      "compile with TF_CPP_MIN_LOG_LEVEL=0 and TF_CPP_VMODULE=latency_hiding_scheduler=1 "
      "set before jax is imported, for a GPU, and capture the standard error meanwhile."
    )
  estimates = [
    ComputationEstimate(name, executions.get(name, 1), cycles, wasted)
    for name, (cycles, wasted) in logged.items()
  ]
  estimates.sort(key=lambda c: (c.name == entry, c.name))
  bodies = {name for name, count in executions.items() if name != entry}
  silent = tuple(
    sorted(name for name in bodies if name not in logged and _is_body(name, computations))
  )
  return StepEstimate(tuple(estimates), silent)


def _statistics(log: str, module_name: str | None) -> dict[str, tuple[float, float]]:
  """``{computation: (cycles, wasted)}`` from the log's after-scheduling blocks (the last wins)."""
  found: dict[str, tuple[float, float]] = {}
  after, name, wasted = False, None, 0.0
  for line in log.splitlines():
    header = _HEADER.search(line)
    if header:
      after, name = header.group(1) == "after", None
      continue
    computation = _COMPUTATION.search(line)
    if computation:
      module = computation.group(2)
      same = module_name is None or re.sub(r"\(\d+\)$", "", module) == module_name
      name = computation.group(1) if after and same else None
      continue
    total = _TOTAL.search(line)
    if total and name is not None:
      if total.group(1):
        wasted = float(total.group(2))
      else:
        found[name] = (float(total.group(2)), wasted)
  return found


def _is_body(name: str, computations) -> bool:
  """Whether ``name`` is the body of a while loop of the module."""
  return any(
    re.search(rf"body=%?{re.escape(name)}\b", i.attributes)
    for instructions in computations.values()
    for i in instructions
    if i.opcode == "while"
  )
