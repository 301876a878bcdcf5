"""Restore decisions: what each process makes of a checkpoint, the vote, and the walk back.

Every process of a job reads its own shards of a checkpoint, so one may fail
where the others succeed. Each reaches a ``Verdict``; ``vote`` makes the worst
of them everyone's (one tiny collective), so that all processes restore the
same step or raise the same way. ``latest_readable`` walks back from the
newest checkpoint past damaged ones.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


class Verdict(enum.IntEnum):
  """What a process made of a checkpoint it tried to restore; in a vote the largest wins.

  Attributes:
    READ: read in full, and it fits the spec.
    DAMAGED: could not be read in full (a file missing or truncated, the layout
      record unreadable): a restore of the latest checkpoint falls back to an
      earlier one.
    MISFIT: read, but of another model, optimizer or precision policy: no
      earlier checkpoint would fit either, so a restore raises at once.
  """

  READ = 0
  DAMAGED = 1
  MISFIT = 2

  @property
  def reason(self) -> str:
    """How an error says that a process reached this verdict."""
    return {
      Verdict.READ: "was read",
      Verdict.DAMAGED: "could not be read",
      Verdict.MISFIT: "does not fit this manager's spec",
    }[self]


def on_every_process(value: int) -> np.ndarray:
  """Every process's ``value``, in process order (a collective: every process must call it)."""
  if jax.process_count() == 1:
    return np.array([value])
  return np.asarray(multihost_utils.process_allgather(np.int32(value))).ravel()


def decide(
  verdicts: Sequence[Verdict], own: Verdict, error: Exception | None, what: str
) -> tuple[Verdict, Exception | None]:
  """The verdict every process takes, and this process's error to go with it.

  Args:
    verdicts: every process's verdict, in process order.
    own: this process's verdict.
    error: this process's error (``None`` if it read the checkpoint).
    what: the checkpoint, as an error names it (``"checkpoint step 3 in ckpt"``).

  Returns:
    The largest verdict, and ``error`` if this process reached it; otherwise
    an error that names the processes that did.

  Example:
    >>> verdict, error = decide([Verdict.READ, Verdict.DAMAGED], Verdict.READ, None, "step 3")
    >>> verdict.name, str(error)
    ('DAMAGED', 'step 3 could not be read on process(es) [1]; their errors say why.')
  """
  verdict = max(verdicts)
  if verdict == own:
    return verdict, error
  where = [process for process, other in enumerate(verdicts) if other == verdict]
  return verdict, ValueError(
    f"{what} {verdict.reason} on process(es) {where}; their errors say why."
  )


def vote(own: Verdict, error: Exception | None, what: str) -> tuple[Verdict, Exception | None]:
  """``decide`` on every process's verdict (a collective: every process must call it)."""
  verdicts = [Verdict(int(v)) for v in on_every_process(int(own))]
  return decide(verdicts, own, error, what)


def latest_readable(
  steps: Sequence[int], read: Callable[[int], tuple[Any, Exception | None]], directory: str
) -> tuple[Any, int, list[tuple[int, Exception]]]:
  """The newest checkpoint that ``read`` can read, walking back past damaged ones.

  Args:
    steps: the checkpoints' steps, oldest first.
    read: ``read(step)`` is ``(state, None)``, or ``(None, error)`` for a
      damaged checkpoint; it raises for one that does not fit.
    directory: where the checkpoints are, for the errors.

  Returns:
    ``(state, step, damaged)``: the state read, its step, and the newer
    checkpoints that could not be read, newest first, with their errors.

  Raises:
    FileNotFoundError: if there are no checkpoints.
    ValueError: if none can be read (the newest's error, and with more than
      one, that none of the earlier could be read either).

  Example:
    >>> read = lambda step: ("state", None) if step < 20 else (None, ValueError("truncated"))
    >>> latest_readable([10, 20, 30], read, "ckpt")
    ('state', 10, [(30, ValueError('truncated')), (20, ValueError('truncated'))])
  """
  if not steps:
    raise FileNotFoundError(
      f"no checkpoints in {directory}: nothing to restore (check the directory, or start afresh "
      "when CheckpointManager.latest_step() is None)."
    )
  damaged = []
  for step in reversed(steps):
    state, error = read(step)
    if error is None:
      return state, step, damaged
    damaged.append((step, error))
  newest = damaged[0][1]
  if len(steps) > 1:
    raise ValueError(
      f"{newest} None of the earlier checkpoints {list(steps[:-1])} could be read either."
    ) from newest
  raise newest
