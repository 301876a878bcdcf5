"""examples/train_lm.py as a process of ``python -m zerojax_launch``; process 1 is a lost host.

Usage: ``python -m zerojax_launch -n 2 ... tests/lost_host_worker.py CHECKPOINT_DIR [flags]``
runs ``examples/train_lm.py [flags] --checkpoint-dir CHECKPOINT_DIR`` in every process. Process
1 vanishes (SIGKILL, as a lost host does) as soon as the first checkpoint is complete, and fails
at every start after that; once the launcher goes on without it, no process is number 1. The
test makes it fail this way, not the library.
"""

import os
import pathlib
import runpy
import signal
import sys
import threading
import time

LOST = "1"
EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def has_checkpoint(directory: pathlib.Path) -> bool:
  """Whether a complete checkpoint is there (a step's directory, named by its number)."""
  return directory.is_dir() and any(path.name.isdigit() for path in directory.iterdir())


def vanish_after_first_checkpoint(directory: pathlib.Path) -> None:
  while not has_checkpoint(directory):
    time.sleep(0.05)
  os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
  directory = pathlib.Path(sys.argv[1])
  if os.environ["ZEROJAX_PROCESS_ID"] == LOST:
    if has_checkpoint(directory):
      sys.exit(f"lost_host_worker: process {LOST} is a host lost for good: it cannot start")
    threading.Thread(target=vanish_after_first_checkpoint, args=(directory,), daemon=True).start()
  script = EXAMPLES / "train_lm.py"
  sys.argv = [str(script), *sys.argv[2:], "--checkpoint-dir", str(directory)]
  sys.path.insert(0, str(EXAMPLES))  # as for python examples/train_lm.py
  runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
  main()
