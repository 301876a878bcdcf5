"""zerojax's implementation, one subpackage per concern, each importing only those below it.

From the bottom: ``sharding`` (how a tree is split over a mesh), ``comm`` (the
collectives), ``core`` (the ZeRO-wrapped optimizer), ``step`` (the training
step's program), ``pipeline`` (stages over a mesh axis); on top, side by side,
``checkpoint``, ``flax``, ``diagnostics`` and ``cluster``. The public names are
re-exported by ``zerojax`` and its public modules; docs/design.md has the map.
"""
