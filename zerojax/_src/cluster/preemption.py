"""Preemption: after a SIGTERM, every process stops at the same step, so that step can be saved.

A preempted Cloud TPU VM or GCE instance, a SLURM job with ``--signal`` (or one
being preempted), and ``python -m zerojax_launch`` when it is told to stop all
send SIGTERM some seconds before the processes are killed. A training loop that
asks ``preemption_requested(step)`` after every step finishes the step it is
in, saves a checkpoint of the step every process agreed on, and exits with
``PREEMPTED_EXIT_CODE``, which the launcher (or a requeue rule) reads as
"restart me", not as a failure.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


class _Notice:
  """This process's own SIGTERM handling, where JAX's preemption service does not do it."""

  def __init__(self):
    self.received = False
    self.previous: Any = signal.SIG_DFL
    # Stopped on another process's notice, before this one's own arrived: when
    # it does, it is that notice (already acted on), not a second one.
    self.awaiting_own = False


_notice = _Notice()


def preemption_requested(step: int) -> bool:
  """Whether to stop after ``step`` because of a preemption notice (SIGTERM); the same everywhere.

  Call it after every training step, on every process, with the step just
  finished (steps counting up by one from where this run started). Once any
  process has received SIGTERM, it returns ``True`` at one step, the same step
  on every process; save a checkpoint of that step there and exit with
  ``PREEMPTED_EXIT_CODE``. Before and after, it returns ``False``.

  How the processes agree:

  - Under ``jax.distributed`` (``zerojax.distributed.initialize`` in a multi-process run),
    with JAX's preemption service (the default): through
    ``jax.experimental.multihost_utils.reached_preemption_sync_point``. JAX
    catches SIGTERM from ``initialize`` on, shares the notice through its
    coordination service in the background, and picks the step after the
    furthest any process has reached, so no process waits on another.
  - Under ``jax.distributed`` with that service turned off
    (``jax_enable_preemption_service=False``): this call installs its own
    SIGTERM handler and all-gathers one flag per process at every step (a
    small collective per step).
  - In a single process: its own SIGTERM handler, no communication.

  Where it installs a handler (the last two cases), SIGTERM no longer ends the
  process from the first call on, only asks it to stop, as JAX's own handler
  does in the first case; a previously installed Python handler is still
  called. Once it has returned ``True``, the previous handler is back in place,
  so a second SIGTERM during the final save ends the process as before. (A
  process that stopped on another's notice before its own SIGTERM arrived puts
  it back when that SIGTERM comes: the usual preemption signals every process,
  not always at the same instant, and the late one must not end the save.)

  Args:
    step: the step just finished.

  Returns:
    ``True`` at the step every process stops at after a notice, else ``False``.

  Raises:
    ValueError: if it first runs outside the main thread where it must install
      its SIGTERM handler.

  Example:
    >>> import os, signal, zerojax
    >>> zerojax.distributed.preemption_requested(1)  # no notice yet
    False
    >>> os.kill(os.getpid(), signal.SIGTERM)  # what a preempted VM or SLURM sends
    >>> zerojax.distributed.preemption_requested(2)  # stop: save step 2, exit PREEMPTED_EXIT_CODE
    True

    In a training loop::

      for step in range(first_step, num_steps + 1):
        state = train_step(state, batch(step))
        stop = zerojax.distributed.preemption_requested(step)
        checkpoints.save(step, state, force=stop)
        if stop:
          checkpoints.close()  # waits for the save
          sys.exit(zerojax.distributed.PREEMPTED_EXIT_CODE)
  """
  if jax.distributed.is_initialized():
    try:
      return multihost_utils.reached_preemption_sync_point(step)
    except RuntimeError:  # JAX's preemption service is turned off: use our own.
      pass
  _listen()
  received = _notice.received
  if jax.process_count() > 1:
    flags = multihost_utils.process_allgather(np.int32(received))
    received = bool(np.any(flags))
  if received:
    if _notice.received:
      _stop_listening()
    else:
      _notice.awaiting_own = True
    _notice.received = False
  return received


def _on_sigterm(signum: int, frame: Any) -> None:
  if _notice.awaiting_own:
    _notice.awaiting_own = False
    _stop_listening()
  else:
    _notice.received = True
  if callable(_notice.previous):
    _notice.previous(signum, frame)


def _listen() -> None:
  """Installs ``_on_sigterm`` unless it is already the SIGTERM handler."""
  if signal.getsignal(signal.SIGTERM) is _on_sigterm:
    return
  if threading.current_thread() is not threading.main_thread():
    raise ValueError(
      "zerojax.distributed.preemption_requested installs a SIGTERM handler, which Python allows "
      "only in the main thread: call it from the main thread (at least the first time)."
    )
  previous = signal.signal(signal.SIGTERM, _on_sigterm)
  # None: a handler installed from C, which Python cannot put back; the default is the best guess.
  _notice.previous = signal.SIG_DFL if previous is None else previous


def _stop_listening() -> None:
  if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, _notice.previous)
