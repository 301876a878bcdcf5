"""Preemption notices between processes, faked: two processes in one (the real ones:
tests/test_fault_tolerance.py and tests/test_multiprocess.py)."""

import os
import signal
import time

import jax
import numpy as np

import zerojax
from zerojax._src.cluster import preemption


def test_a_late_sigterm_after_stopping_on_anothers_notice_does_not_end_the_save(monkeypatch):
  # Without JAX's preemption service, the processes agree through a flag per
  # process. One that stops on another's notice must still catch its own
  # SIGTERM when it comes during the save: it is the same preemption, not a
  # second one. Two processes are faked: the other one's flag is `other`.
  monkeypatch.setattr(preemption, "_notice", preemption._Notice())
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  other = [0]
  gather = lambda flag: np.array([flag, other[0]], np.int32)
  monkeypatch.setattr(preemption.multihost_utils, "process_allgather", gather)
  calls = []
  previous = lambda signum, frame: calls.append(signum)
  restore = signal.signal(signal.SIGTERM, previous)
  try:
    assert not zerojax.distributed.preemption_requested(1)
    other[0] = 1
    assert zerojax.distributed.preemption_requested(2)
    assert signal.getsignal(signal.SIGTERM) is preemption._on_sigterm  # still caught
    os.kill(os.getpid(), signal.SIGTERM)  # this process's own notice, late
    time.sleep(0.05)
    assert calls == [signal.SIGTERM]  # the handler before zerojax's still hears of it
    assert signal.getsignal(signal.SIGTERM) is previous  # a second SIGTERM ends the process
    assert not preemption._notice.received
  finally:
    signal.signal(signal.SIGTERM, restore)
