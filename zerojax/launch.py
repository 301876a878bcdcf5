"""The launcher's Python API: ``zerojax.launch.launch`` runs a script as N local processes.

``zerojax.launch.launch([sys.executable, "script.py"], num_processes=2,
devices_per_process=4)`` starts a multi-process JAX job on this host and returns
its exit status. The launcher lives in ``zerojax_launch``, which imports no JAX;
its command line is ``python -m zerojax_launch`` (docs/multiprocess.md).
``python -m zerojax.launch``, the command earlier docs gave, says so and exits 2.
"""

import shlex
import sys

from zerojax_launch.launcher import launch, main

__all__ = ("launch", "main")

if __name__ == "__main__":
  # Running the launcher from here would import JAX into it, which it must not do.
  given = shlex.join(sys.argv[1:])
  print(
    "python -m zerojax.launch: the launcher's command line moved to its own package, which "
    f"imports no JAX: run `python -m zerojax_launch {given}` (or `zerojax-launch {given}`)",
    file=sys.stderr,
  )
  sys.exit(2)
