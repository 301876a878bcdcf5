"""An uninterrupted run of examples/train_lm.py on 1 process x 8 devices, computed once a run.

tests/test_slurm.py (``srun -n 2``, 2 processes x 4 devices) and tests/test_elastic.py (a job
that loses a process and ends on 1 x 4) check their losses against it. 2 x 4 trains like 1 x 8
to 1e-6 (tests/test_multiprocess.py; the elastic job's steps before its checkpoint), so this run
stands for an uninterrupted 2 x 4 one too.
"""

import functools
import json

from examples import train_lm
from tests.helpers import computed_once

#: The tiny model, 12 steps of a global batch of 32 sequences of 32 bytes, at most 4 sequences
#: per device at a time: 1 micro-batch on 8 devices, 2 on 4.
FLAGS = (
  *("--model", "tiny", "--steps", "12", "--seq-len", "32", "--batch-size", "32"),
  *("--per-device-batch", "4", "--eval-every", "12", "--no-report"),
)


@functools.cache
def eight_devices() -> dict:
  """The metrics (``train_loss``, ``config``, ...) of ``FLAGS`` on 8 devices, trained once a run.

  In the worker that asks first (``tests/helpers.computed_once``); the others read its
  ``metrics.json``.
  """
  train = lambda out: train_lm.main([*FLAGS, "--devices", "8", "--out", str(out)])
  return json.loads((computed_once("lm_reference", train) / "metrics.json").read_text())
