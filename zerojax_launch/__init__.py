"""The launcher: N processes of one script on this host, started, watched and restarted together.

It imports no JAX (nor the ``zerojax`` package, which does): the launcher only
starts and watches processes, and a process that imports JAX with a GPU or TPU
plugin installed pays a second and logs the plugin's probing. Its Python API is
also ``zerojax.launch``; its command line is ``python -m zerojax_launch`` (or
``zerojax-launch``).
"""

from zerojax_launch.launcher import launch, main

__all__ = ("launch", "main")
