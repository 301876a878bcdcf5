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
SCHEDULES = ("gpipe", "1f1b", "interleaved")


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
    forward_chunk: ``(ticks, stages)``: which of the stage's chunks (virtual
      stages, ``"interleaved"``) the forward slot runs; ``None``: one chunk.
    backward_chunk: the same for backward slots.

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
  forward_chunk: np.ndarray | None = None
  backward_chunk: np.ndarray | None = None

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
  def chunks(self) -> int:
    """The chunks (virtual stages) each stage holds: 1 but for ``"interleaved"``."""
    return 1 if self.forward_chunk is None else int(self.forward_chunk.max()) + 1

  def chunk(self, backward: bool) -> np.ndarray:
    """``forward_chunk`` (or ``backward_chunk``), zeros where there is none."""
    table = self.backward_chunk if backward else self.forward_chunk
    return np.zeros_like(self.forward) if table is None else table

  @property
  def in_flight(self) -> int:
    """The most micro-batches (chunks of them, interleaved) whose activations a stage holds.

    Counted after each tick's forward slot: a micro-batch is held from its
    forward pass to its backward pass. With forward slots only (the first half
    of ``"gpipe"`` without the loss inside) every micro-batch is held.
    """
    return self.ring()[2]

  def ring(self) -> tuple[np.ndarray, np.ndarray, int]:
    """Where each slot keeps its micro-batch's saved activations, in a ring of ``in_flight``.

    Returns ``(forward, backward, size)``: the ring entry each tick's forward
    slot writes and its backward slot reads, per stage (0 where the slot has
    no micro-batch), and the entries needed. A forward pass takes the lowest
    free entry and its backward pass frees it.
    """
    ring_f, ring_b = np.zeros_like(self.forward), np.zeros_like(self.backward)
    chunk_f, chunk_b = self.chunk(False), self.chunk(True)
    size = 0
    for stage in range(self.stages):
      held: dict[tuple[int, int], int] = {}
      for tick in range(self.ticks):
        m, k = int(self.forward[tick, stage]), int(chunk_f[tick, stage])
        if m >= 0:
          held[m, k] = ring_f[tick, stage] = min(set(range(len(held) + 1)) - set(held.values()))
        size = max(size, len(held))
        m, k = int(self.backward[tick, stage]), int(chunk_b[tick, stage])
        if m >= 0:  # 0 if the table lacks the forward pass (GPipe's second half alone)
          ring_b[tick, stage] = held.pop((m, k), 0)
    return ring_f, ring_b, size

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
    # A stage's own slots (each of a chunk: 1/chunks of a stage's layers, as every slot is).
    work = (
      forward_cost * (self.forward[:, 0] >= 0).sum()
      + backward_cost * (self.backward[:, 0] >= 0).sum()
    )
    return 1.0 - float(work) / total


def pipeline_timetable(
  schedule: str,
  *,
  stages: int,
  microbatches: int,
  backward: bool = True,
  virtual_stages: int | None = None,
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

  ``"interleaved"`` (Megatron-LM's interleaved 1F1B; MaxText's circular
  pipeline) gives each stage ``v = virtual_stages`` chunks of its layers:
  chunk ``k`` of stage ``s`` is virtual stage ``k S + s``, and a micro-batch
  passes through the ``v S`` virtual stages in order, from the last stage
  back to the first between chunks. Micro-batches go in groups of ``S``
  (``M`` must divide by ``S``): stage ``s`` runs its ``q``-th forward slot
  at tick ``q + s``, taking chunk 0 of the group's ``S`` micro-batches,
  then chunk 1, ..., and its ``r``-th backward slot at tick
  ``v S - 1 + r + S - 1 - s``, chunks in reverse; every hand-off takes one
  tick, and the last virtual stage's backward pass shares its forward's
  tick. Each kind of slot idles ``S - 1`` of ``v M + S - 1`` ticks, a slot
  being a chunk's work: the bubble ``(S - 1) / (v M + S - 1)``, Megatron's
  ``(S - 1) / (v M)`` of the ideal time. With ``v = 1`` it is ``"1f1b"``.

  Args:
    schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"``.
    stages: the number of stages (the size of the stage axis).
    microbatches: the number of micro-batches.
    backward: ``False`` for the forward passes alone (GPipe's first half,
      when the loss is computed after the pipeline).
    virtual_stages: ``"interleaved"``'s chunks per stage (required there,
      not allowed elsewhere).

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
  check_virtual_stages(schedule, virtual_stages, stages, microbatches)
  S, M = stages, microbatches  # noqa: N806 (the papers' names)
  if schedule == "interleaved":
    assert virtual_stages is not None
    return _interleaved(S, M, virtual_stages, backward)
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


def _interleaved(S: int, M: int, v: int, backward: bool) -> Timetable:  # noqa: N803
  """The interleaved timetable (see ``pipeline_timetable``)."""
  start = v * S - 1  # the tick of the first backward slot: the last virtual stage's first
  ticks = start + v * M + S - 1 if backward else v * M + S - 1
  tables = [np.full((ticks, S), -1, np.int32) for _ in range(2)]
  chunks = [np.zeros((ticks, S), np.int32) for _ in range(2)]
  groups = range(M // S)
  order = [(g * S + i, k) for g in groups for k in range(v) for i in range(S)]
  for q, (m, k) in enumerate(order):
    for s in range(S):
      tables[0][q + s, s], chunks[0][q + s, s] = m, k
  if backward:
    order = [(g * S + i, k) for g in groups for k in reversed(range(v)) for i in range(S)]
    for r, (m, k) in enumerate(order):
      for s in range(S):
        tables[1][start + r + S - 1 - s, s], chunks[1][start + r + S - 1 - s, s] = m, k
  return Timetable(tables[0], tables[1], chunks[0], chunks[1])


def check_virtual_stages(schedule: str, virtual_stages: Any, stages: int, microbatches: int):
  """Raises unless ``virtual_stages`` suits ``schedule``, saying what to pass."""
  if schedule != "interleaved":
    if virtual_stages is not None:
      raise ValueError(
        f"virtual_stages={virtual_stages!r} is the interleaved schedule's: pass "
        "schedule='interleaved', or drop virtual_stages."
      )
    return
  if not isinstance(virtual_stages, int) or isinstance(virtual_stages, bool) or virtual_stages < 1:
    raise ValueError(
      "schedule='interleaved' splits each stage's layers into chunks (virtual stages): pass "
      f"virtual_stages=v, a positive int such as 2, got {virtual_stages!r}."
    )
  if microbatches % stages:
    raise ValueError(
      f"schedule='interleaved' runs micro-batches in groups of the {stages} stages, and "
      f"{microbatches} micro-batches do not divide into them: use a multiple of {stages}."
    )


def check_schedule(schedule: Any) -> None:
  """Raises unless ``schedule`` names a schedule, suggesting the closest name."""
  if schedule not in SCHEDULES:
    close = difflib.get_close_matches(str(schedule), SCHEDULES, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else "."
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}{hint}")
