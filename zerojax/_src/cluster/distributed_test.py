"""initialize's exception hook alone, in a process of one (the hook in real multi-process runs:
tests/test_multiprocess.py and tests/test_fault_tolerance.py)."""

import subprocess
import sys

from tests import environment
from tests.environment import ROOT
from zerojax._src.cluster import distributed


def test_a_collective_that_lost_its_peer_ends_the_process_in_one_line():
  # What initialize's exception hook does in every process of a multi-process run.
  code = (
    "from zerojax._src.cluster import distributed; "
    "distributed._exit_at_once_on_uncaught_exceptions(); "
    "raise RuntimeError('UNKNOWN: Gloo AllGather failed: [pair.cc:547] Connection closed by peer "
    "[127.0.0.1]:39836')"
  )
  done = subprocess.run(
    [sys.executable, "-c", code],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=60,
    env=environment.subprocess_env(JAX_PLATFORMS="cpu"),
  )
  assert done.returncode == distributed.PEER_LOST_EXIT_CODE
  lines = [line for line in done.stderr.splitlines() if "zerojax" in line or "Traceback" in line]
  assert lines == [
    "zerojax: process 0 stopped: a collective lost another process (RuntimeError: UNKNOWN: Gloo "
    "AllGather failed: [pair.cc:547] Connection closed by peer [127.0.0.1]:39836); the process "
    "that failed first says why."
  ]
