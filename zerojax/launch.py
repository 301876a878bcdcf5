"""Command line: run a script as N local CPU processes of one multi-process JAX job.

Example:
  From a shell::

    python -m zerojax.launch -n 2 --devices-per-process 4 examples/train_lm.py --model tiny

From Python, ``zerojax.launch.launch([sys.executable, "script.py"], num_processes=2,
devices_per_process=4)`` does the same and returns the exit status. With ``--max-restarts``
the group is started again after a failure; with ``--min-processes`` it goes on without a
process that keeps failing (a host lost for good)::

    python -m zerojax.launch -n 2 --devices-per-process 4 --max-restarts 3 --min-processes 1 \
      examples/train_lm.py --per-device-batch 4 --checkpoint-dir ckpt --resume
"""

import sys

from zerojax._src.launch import launch, main

__all__ = ("launch", "main")

if __name__ == "__main__":
  sys.exit(main())
