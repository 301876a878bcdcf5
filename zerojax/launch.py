"""The launcher's Python API: ``zerojax.launch.launch`` runs a script as N local processes.

``zerojax.launch.launch([sys.executable, "script.py"], num_processes=2,
devices_per_process=4)`` starts a multi-process JAX job on this host and returns
its exit status. The launcher lives in ``zerojax_launch``, which imports no JAX;
its command line is ``python -m zerojax_launch`` (docs/multiprocess.md).
"""

from zerojax_launch.launcher import launch, main

__all__ = ("launch", "main")
