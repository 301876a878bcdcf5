"""Reading compiled steps: their memory, their collectives, and what compute waits on them.

``profile`` compiles a step and reports its per-device memory and collective
bytes; ``count_collectives`` and ``count_collectives_by_axes`` read those
bytes from any compiled program's HLO; ``loop_collectives`` says, for each
loop of a compiled program (a layer scan), which of its collectives the
compute inside waits on and which run asynchronously under compute;
``pipeline_slots`` counts the slots a pipeline stage runs, its bubble.

Compiling for GPUs and TPUs this machine does not have: start a process with
``deviceless_environment(target)`` (one of ``DEVICELESS_TARGETS``: 1 to 16
nodes of 8 H100, v5e slices of 8 to 256 chips, multi-slice v5e;
``deviceless_target`` says what each is), build the
mesh with ``deviceless_mesh``, lower with abstract arrays and compile; on GPU,
``scheduler_estimate`` reads XLA's own estimate of the step from the log
``capture_stderr`` collected meanwhile. ``roofline`` estimates a step's time
from its compiled program (``program_cost``, loops unrolled) and a ``Chip``'s
published peaks, a lower bound where XLA gives no estimate (TPU). See
docs/accounting.md and docs/performance.md.
"""

from zerojax._src.diagnostics.deviceless import (
  DEVICELESS_TARGETS,
  DevicelessTarget,
  capture_stderr,
)
from zerojax._src.diagnostics.deviceless import environment as deviceless_environment
from zerojax._src.diagnostics.deviceless import find_target as deviceless_target
from zerojax._src.diagnostics.deviceless import mesh as deviceless_mesh
from zerojax._src.diagnostics.gpu_log import ComputationEstimate, StepEstimate, scheduler_estimate
from zerojax._src.diagnostics.hlo import (
  Collective,
  count_across_slices,
  count_collectives,
  count_collectives_by_axes,
)
from zerojax._src.diagnostics.overlap import LoopCollectives, loop_collectives
from zerojax._src.diagnostics.process import DevicelessProcess
from zerojax._src.diagnostics.process import find as find_by_name
from zerojax._src.diagnostics.profile import StepProfile, profile
from zerojax._src.diagnostics.roofline import Chip, Cost, Roofline, chip, program_cost, roofline
from zerojax._src.diagnostics.slots import pipeline_slots

__all__ = (
  "DEVICELESS_TARGETS",
  "Chip",
  "Collective",
  "ComputationEstimate",
  "Cost",
  "DevicelessProcess",
  "DevicelessTarget",
  "LoopCollectives",
  "Roofline",
  "StepEstimate",
  "StepProfile",
  "capture_stderr",
  "chip",
  "count_across_slices",
  "count_collectives",
  "count_collectives_by_axes",
  "deviceless_environment",
  "deviceless_mesh",
  "deviceless_target",
  "find_by_name",
  "loop_collectives",
  "pipeline_slots",
  "profile",
  "program_cost",
  "roofline",
  "scheduler_estimate",
)
