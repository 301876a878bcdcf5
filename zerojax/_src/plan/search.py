"""``zerojax.plan``: every candidate setup compiled for the machine, the fastest that fits picked.

Candidates are compiled in rounds of one batch and one ``remat`` at a time,
smallest first, by worker processes in parallel; a setup that did not fit
prunes every later one that holds at least as much (``Setup.needs_at_least``:
the same setup at a larger batch, or keeping more), so the plan compiles the
frontier of what fits rather than the whole space. The winner is the fitting
setup with the most tokens per second in the estimate.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import queue
import sys
import time
from collections.abc import Callable

from zerojax._src.diagnostics import process as process_lib
from zerojax._src.plan import compile as compile_lib
from zerojax._src.plan import program as program_lib
from zerojax._src.plan import workers as workers_lib
from zerojax._src.plan.compile import LOCAL, Outcome
from zerojax._src.plan.setup import Setup, Space, rounds

#: Where plans keep their compiled outcomes unless told otherwise.
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "zerojax", "plan")


@dataclasses.dataclass(frozen=True)
class Plan:
  """What ``zerojax.plan`` found.

  Attributes:
    program: the program's reference (``"module:name"``).
    target: the machine.
    outcomes: every candidate compiled, in the order compiled.
    pruned: candidates not compiled, since a smaller one did not fit.
    seconds: how long the plan took.
    cached: how many outcomes came from the cache.

  Example:
    >>> from zerojax.planning import Outcome, Plan, Setup
    >>> small = Outcome(Setup(batch=1), True, memory={"peak": 1}, tokens_per_second=10.0)
    >>> big = Outcome(Setup(batch=2), True, memory={"peak": 2}, tokens_per_second=15.0)
    >>> found = Plan("model.py:program", "v5e-8", (small, big), pruned=(), seconds=1.0)
    >>> found.best.setup.batch, found.outcome(Setup(batch=1)) is small
    (2, True)
  """

  program: str
  target: str
  outcomes: tuple[Outcome, ...]
  pruned: tuple[Setup, ...]
  seconds: float
  cached: int = 0

  @property
  def fitting(self) -> list[Outcome]:
    """The candidates that fit, fastest first (most tokens per second in the estimate)."""
    found = [o for o in self.outcomes if o.fits]
    by_speed = lambda o: (-(o.tokens_per_second or 0.0), (o.memory or {}).get("peak", 0))
    return sorted(found, key=by_speed)

  @property
  def best(self) -> Outcome | None:
    """The fastest candidate that fits, or ``None`` if none does."""
    fitting = self.fitting
    return fitting[0] if fitting else None

  def outcome(self, setup: Setup) -> Outcome | None:
    """``setup`` 's outcome, if it was compiled."""
    return next((o for o in self.outcomes if o.setup == setup), None)


def plan(
  program: program_lib.Program | str,
  target: str,
  *,
  space: Space | None = None,
  workers: int | None = None,
  cache: str | os.PathLike | None = DEFAULT_CACHE,
  progress: Callable[[str], None] | None = None,
  prune: bool = True,
  measure: int = 0,
) -> Plan:
  """Compiles ``program`` 's candidate setups for ``target`` and picks the fastest that fits.

  Nothing runs: each candidate's training step is compiled for the target
  (deviceless for an accelerator this machine does not have) and read: the
  compiler's own refusal, or its memory per device against the device's,
  decides whether it fits; the step time is XLA:GPU's estimate on GPUs, a
  roofline on TPUs (``docs/planning.md`` says what each leaves out).

  Args:
    program: a ``zerojax.planning.Program`` defined at the top level of a
      module, or its reference, ``"module:name"`` / ``"file.py:name"``.
    target: one of ``zerojax.diagnostics.DEVICELESS_TARGETS``, or
      ``"local"`` for the devices of this process (compiled here).
    space: the setups to try (``zerojax.planning.Space()``'s by default).
    workers: compiling processes at once (default: the CPU count, at most 4).
    cache: a directory of past outcomes, reused when the program's file,
      the target, the setup and the versions are the same; ``None`` for none.
    progress: called with a line per candidate compiled (default: printed
      to standard error).
    prune: skip candidates that hold at least what a non-fitting one holds;
      ``False`` compiles the whole space.
    measure: with ``target="local"`` (on the accelerators themselves), run
      this many of the fitting candidates for real (the fastest in the
      estimate first; all of them where there is no estimate, as on CPUs)
      and rank them by their measured step time (the median of 3 steps).

  Returns:
    The ``Plan``: ``plan.best`` is the winner, ``zerojax.planning.code(plan)``
    the code that builds it.

  Example:
    For the tiny model the planner's tests use (``tests/plan_program.py``)::

      import zerojax
      found = zerojax.plan("tests.plan_program:TINY", "v5e-8",
                           space=zerojax.planning.Space(batches=(1, 4)))
      found.best.setup, found.best.tokens_per_second
      print(zerojax.planning.code(found))

  Raises:
    ValueError: for an unknown target, a program the workers cannot import,
      a space with no setup for this program and machine, or ``measure``
      for a target this machine does not have.
  """
  if measure and target != LOCAL:
    raise ValueError(
      f"measure={measure} runs the candidates on this machine's devices, and {target} is "
      "compiled for, not here: plan with target='local' on the accelerators' host to measure."
    )
  start = time.perf_counter()
  ref = workers_lib.reference(program)
  loaded = workers_lib.load(ref)
  devices, nodes = compile_lib.machine(target)
  candidates = (space or Space()).setups(
    layers=loaded.layers, devices=devices, nodes=nodes, names=bool(loaded.names)
  )
  if not candidates:
    raise ValueError(
      f"the space has no setup for {loaded.name} on {target} ({devices} devices, {nodes} "
      f"node(s), {loaded.layers} layers): widen it (a pipeline's stages must divide the layers "
      "and the devices; hybrid sharding, hpZ and ZeRO++ need more than one node)."
    )
  say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
  store = workers_lib.Cache(cache, ref, target)
  count = 1 if target == LOCAL else max(1, min(workers or min(os.cpu_count() or 1, 4), 8))
  pool = [process_lib.DevicelessProcess(target) for _ in range(count)]
  free: queue.Queue[process_lib.DevicelessProcess] = queue.Queue()
  for worker in pool:
    free.put(worker)
  outcomes: list[Outcome] = []
  pruned: list[Setup] = []
  cached = 0
  try:
    with concurrent.futures.ThreadPoolExecutor(len(pool)) as threads:
      for batch in rounds(candidates):
        failed = [o.setup for o in outcomes if o.out_of_memory]
        todo = [s for s in batch if not (prune and any(s.needs_at_least(f) for f in failed))]
        pruned += [s for s in batch if s not in todo]
        found: dict[Setup, Outcome] = {}
        for setup in todo:
          kept = store.get(setup)
          if kept is not None:
            found[setup] = kept
        cached += len(found)
        missing = [s for s in todo if s not in found]
        futures = [threads.submit(_compile, free, ref, target, s) for s in missing]
        for setup, future in zip(missing, futures, strict=True):
          found[setup] = future.result()
          store.put(found[setup])
        for setup in todo:
          outcomes.append(found[setup])
          say(_line(len(outcomes), len(candidates) - len(pruned), found[setup]))
  finally:
    for worker in pool:
      worker.close()
  if measure:
    outcomes = _measured(loaded, outcomes, measure, say)
  return Plan(ref, target, tuple(outcomes), tuple(pruned), time.perf_counter() - start, cached)


def _measured(program, outcomes: list[Outcome], count: int, say) -> list[Outcome]:
  """``outcomes`` with the ``count`` fastest fitting ones timed on this process's devices."""
  fitting = [o for o in outcomes if o.fits]
  fitting.sort(key=lambda o: -(o.tokens_per_second or 0.0))
  timed = {}
  for outcome in fitting[:count]:
    seconds = compile_lib.measure_setup(program, outcome.setup)
    speed = outcome.examples * program.tokens_per_example / seconds
    timed[outcome.setup] = dataclasses.replace(
      outcome, step_seconds=seconds, estimate="measured", tokens_per_second=speed
    )
    say(f"measured {outcome.setup.describe()}: {seconds * 1e3:.1f} ms a step")
  return [timed.get(o.setup, o) for o in outcomes]


def _compile(free: queue.Queue, ref: str, target: str, setup: Setup) -> Outcome:
  """``setup`` compiled by whichever process is free."""
  worker = free.get()
  try:
    found = worker.call("zerojax._src.plan.workers:compile_json", ref, setup.to_json(), target)
  except RuntimeError as error:
    raise RuntimeError(f"compiling {setup.describe()}: {error}") from None
  finally:
    free.put(worker)
  return Outcome.from_json(found)


def _line(index: int, total: int, outcome: Outcome) -> str:
  """A progress line: the candidate, whether it fit, its peak and its estimated speed."""
  head = f"[{index}/{total}] {outcome.setup.describe()}: "
  if outcome.error:
    return head + f"refused ({outcome.error[:120]})"
  memory = outcome.memory or {}
  verdict = "fits" if outcome.fits else "does not fit"
  speed = f", {outcome.tokens_per_second:,.0f} tokens/s" if outcome.tokens_per_second else ""
  return (
    head + f"{verdict}, {memory.get('peak', 0) / 2**30:.2f} of "
    f"{memory.get('device', 0) / 2**30:.1f} GiB{speed} ({outcome.compile_seconds:.0f} s)"
  )
