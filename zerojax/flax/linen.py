"""Linen: modules that gather their parameters when called, and layer stacks run by zerojax.

``gathered`` and ``remat_gathered`` wrap module classes so that each module
gathers its own parameters when it is called (one layer per iteration under
``nn.scan``); ``scan`` runs a layer stack with ``zerojax.scan`` (each layer
gathered one ahead), and ``pipeline`` splits that stack into pipeline stages
(``zerojax.pipeline``). See docs/flax.md.
"""

from zerojax._src.flax.linen import gathered, pipeline, remat_gathered, scan

__all__ = ("gathered", "pipeline", "remat_gathered", "scan")
