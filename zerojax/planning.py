"""Planning a run before the hardware exists: ``zerojax.plan`` picks the fastest setup that fits.

A ``Program`` is a model (an embedding, a stack of layers, a head); a
``Space`` is the setups to try (``Setup``: ZeRO stage, hybrid sharding or hpZ,
ZeRO++, what the backward pass keeps, offload, pipeline stages, batch per
device); ``plan`` compiles each candidate for a machine this one need not be
(``zerojax.diagnostics.DEVICELESS_TARGETS``) in worker processes, reads
whether it fits, its memory and bytes across nodes and an estimated step
time, and returns a ``Plan`` (``zerojax.plan``); ``table`` and ``code`` print it. From a shell::

  zerojax-plan examples/plan/model.py:program --target v5e-64 --batches 1,2,4

See docs/planning.md.
"""

from zerojax._src.plan.cli import main
from zerojax._src.plan.compile import Outcome, compile_setup
from zerojax._src.plan.program import Program
from zerojax._src.plan.report import code, table
from zerojax._src.plan.search import Plan
from zerojax._src.plan.setup import REMAT, SHARDING, Setup, Space

__all__ = (
  "REMAT",
  "SHARDING",
  "Outcome",
  "Plan",
  "Program",
  "Setup",
  "Space",
  "code",
  "compile_setup",
  "main",
  "table",
)

if __name__ == "__main__":
  main()
