"""Pipeline schedules as timetables: which micro-batch each stage runs in each tick.

A tick is one step of the pipeline's loop: every stage may run one
micro-batch's forward pass (its forward slot) and then one micro-batch's
backward pass (its backward slot), after which activations move one stage on
and cotangents one stage back. The stages run the same program (SPMD), so a
tick lasts as long as the slots any stage needs in it: a slot that only some
stages need is run, masked, by all of them. This is where the bubble is.
"""

from __future__ import annotations

import difflib
from typing import Any, NamedTuple

import numpy as np

#: The schedules ``zerojax.pipeline`` runs.
SCHEDULES = ("gpipe", "1f1b")


class Phase(NamedTuple):
  """A run of ticks that need the same kinds of slots.

  Attributes:
    start: the first tick.
    stop: the tick after the last.
    forward: whether some stage runs a forward pass in these ticks.
    backward: whether some stage runs a backward pass in these ticks.
  """

  start: int
  stop: int
  forward: bool
  backward: bool


class Timetable(NamedTuple):
  """Which micro-batch each stage runs in each tick of a schedule.

  Attributes:
    forward: ``(ticks, stages)`` integers: the micro-batch whose forward pass
      the stage runs in that tick, or -1.
    backward: ``(ticks, stages)``: the same for backward passes (a tick's
      forward slot runs before its backward slot).

  Example:
    >>> import zerojax
    >>> t = zerojax.pipeline_timetable("1f1b", stages=2, microbatches=4)
    >>> t.forward[:, 0].tolist(), t.backward[:, 0].tolist()
    ([0, 1, 2, 3, -1, -1], [-1, -1, 0, 1, 2, 3])
    >>> t.in_flight, zerojax.pipeline_timetable("gpipe", stages=2, microbatches=4).in_flight
    (3, 4)
    >>> round(t.bubble(), 3)  # (S - 1) / (M + S - 1)
    0.2
  """

  forward: np.ndarray
  backward: np.ndarray

  @property
  def ticks(self) -> int:
    return self.forward.shape[0]

  @property
  def stages(self) -> int:
    return self.forward.shape[1]

  @property
  def microbatches(self) -> int:
    return int(max(self.forward.max(), self.backward.max())) + 1

  @property
  def in_flight(self) -> int:
    """The most micro-batches whose activations one stage holds at once.

    Counted after each tick's forward slot: a micro-batch is held from its
    forward pass to its backward pass. With forward slots only (the first half
    of ``"gpipe"`` without the loss inside) every micro-batch is held.
    """
    most = 0
    for stage in range(self.stages):
      held: set[int] = set()
      for tick in range(self.ticks):
        held.add(int(self.forward[tick, stage]))
        held.discard(-1)
        most = max(most, len(held))
        held.discard(int(self.backward[tick, stage]))
    return most

  def phases(self) -> list[Phase]:
    """The runs of consecutive ticks that need the same kinds of slots, in order."""
    kinds = [
      (bool((self.forward[t] >= 0).any()), bool((self.backward[t] >= 0).any()))
      for t in range(self.ticks)
    ]
    phases: list[Phase] = []
    for tick, kind in enumerate(kinds):
      if phases and (phases[-1].forward, phases[-1].backward) == kind:
        phases[-1] = phases[-1]._replace(stop=tick + 1)
      else:
        phases.append(Phase(tick, tick + 1, *kind))
    return phases

  def bubble(self, forward_cost: float = 1.0, backward_cost: float = 2.0) -> float:
    """The fraction of a step a stage spends on slots it has no micro-batch for.

    Every stage runs each kind of slot that any stage needs in a tick, so a
    tick costs ``forward_cost`` if some stage runs a forward pass in it, plus
    ``backward_cost`` if some stage runs a backward pass. A backward pass
    costs about twice a forward pass (the defaults).
    """
    costs = [
      forward_cost * phase.forward + backward_cost * phase.backward for phase in self.phases()
    ]
    total = sum(cost * (p.stop - p.start) for cost, p in zip(costs, self.phases(), strict=True))
    has_backward = bool((self.backward >= 0).any())
    work = self.microbatches * (forward_cost + backward_cost * has_backward)
    return 1.0 - work / total


def pipeline_timetable(
  schedule: str, *, stages: int, microbatches: int, backward: bool = True
) -> Timetable:
  """The tick-by-tick timetable of ``schedule`` for ``stages`` stages and ``microbatches``.

  Micro-batch ``m`` runs forward on stage ``s`` at tick ``m + s`` in both
  schedules. GPipe runs the backward passes once the last forward pass is
  done, the last micro-batch first; 1F1B runs micro-batch ``m``'s backward
  pass on stage ``s`` at tick ``m + 2 (S - 1) - s``, as soon as its cotangent
  can arrive. Both keep every stage idle in ``S - 1`` of the ``M + S - 1``
  ticks of each kind: the bubble ``(S - 1) / (M + S - 1)``. Activations and
  cotangents move one stage per tick, so 1F1B holds micro-batch ``m`` on
  stage ``s`` for ``2 (S - 1 - s)`` ticks: at most ``2 S - 1`` micro-batches
  at once, where GPipe holds all ``M``.

  Args:
    schedule: ``"gpipe"`` or ``"1f1b"``.
    stages: the number of stages (the size of the stage axis).
    microbatches: the number of micro-batches.
    backward: ``False`` for the forward passes alone (GPipe's first half,
      when the loss is computed after the pipeline).

  Returns:
    The ``Timetable``.

  Example:
    >>> import zerojax
    >>> zerojax.pipeline_timetable("gpipe", stages=2, microbatches=2).forward.tolist()
    [[0, -1], [1, 0], [-1, 1], [-1, -1], [-1, -1]]
  """
  check_schedule(schedule)
  for name, value in (("stages", stages), ("microbatches", microbatches)):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}.")
  S, M = stages, microbatches  # noqa: N806 (the papers' names)
  turn = M + S - 2  # the tick of the last forward pass
  if not backward:
    ticks = turn + 1
  elif schedule == "gpipe":
    ticks = 2 * turn + 1  # the last stage's first backward pass shares the last forward's tick
  else:
    ticks = M + 2 * S - 2
  forward = np.full((ticks, S), -1, np.int32)
  back = np.full((ticks, S), -1, np.int32)
  for m in range(M):
    for s in range(S):
      forward[m + s, s] = m
      if backward:
        back[
          turn + (M - 1 - m) + (S - 1 - s) if schedule == "gpipe" else m + 2 * (S - 1) - s, s
        ] = m
  return Timetable(forward, back)


def check_schedule(schedule: Any) -> None:
  """Raises unless ``schedule`` names a schedule, suggesting the closest name."""
  if schedule not in SCHEDULES:
    close = difflib.get_close_matches(str(schedule), SCHEDULES, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else "."
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}{hint}")
