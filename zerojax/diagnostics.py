"""Reading compiled steps: their memory, their collectives, and what compute waits on them.

``profile`` compiles a step and reports its per-device memory and collective
bytes; ``count_collectives`` and ``count_collectives_by_axes`` read those
bytes from any compiled program's HLO; ``loop_collectives`` says, for each
loop of a compiled program (a layer scan), which of its collectives the
compute inside waits on. See docs/accounting.md and docs/performance.md.
"""

from zerojax._src.hlo import Collective, count_collectives, count_collectives_by_axes
from zerojax._src.overlap import LoopCollectives, loop_collectives
from zerojax._src.profile import StepProfile, profile

__all__ = (
  "Collective",
  "LoopCollectives",
  "StepProfile",
  "count_collectives",
  "count_collectives_by_axes",
  "loop_collectives",
  "profile",
)
