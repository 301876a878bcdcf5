"""zerojax: ZeRO stages 1, 2 and 3 for JAX, as Optax transformations."""

from zerojax._src.checkpoint import CheckpointManager, StateSpec, train_state_spec
from zerojax._src.collectives import Shard, gather, remat_policy
from zerojax._src.devices import use_cpu_devices
from zerojax._src.distributed import gather_to_host, global_batch, initialize
from zerojax._src.elastic import elastic_device_counts, elastic_microbatches
from zerojax._src.estimate import (
  CommunicationEstimate,
  MemoryEstimate,
  estimate_communication,
  estimate_memory,
  estimate_tree_memory,
)
from zerojax._src.export import export_safetensors, load_params
from zerojax._src.grad import value_and_grad
from zerojax._src.hlo import Collective, count_collectives, count_collectives_by_axes
from zerojax._src.layout import DEFAULT_MIN_SHARD_SIZE, Layout, LeafLayout, default_shard_dim
from zerojax._src.overlap import LoopCollectives, loop_collectives
from zerojax._src.pipeline import pipeline
from zerojax._src.pipeline_schedule import Timetable, pipeline_timetable
from zerojax._src.precision import DynamicLossScale, LossScaleState, Precision
from zerojax._src.preemption import PREEMPTED_EXIT_CODE, preemption_requested
from zerojax._src.profile import StepProfile, profile
from zerojax._src.quantize import Quantization
from zerojax._src.scan import scan
from zerojax._src.state import ZeroState
from zerojax._src.zero import ZeroTransformation, zero1, zero2, zero3

__version__ = "0.1.0"

__all__ = (
  "DEFAULT_MIN_SHARD_SIZE",
  "PREEMPTED_EXIT_CODE",
  "CheckpointManager",
  "Collective",
  "CommunicationEstimate",
  "DynamicLossScale",
  "Layout",
  "LeafLayout",
  "LoopCollectives",
  "LossScaleState",
  "MemoryEstimate",
  "Precision",
  "Quantization",
  "Shard",
  "StateSpec",
  "StepProfile",
  "Timetable",
  "ZeroState",
  "ZeroTransformation",
  "count_collectives",
  "count_collectives_by_axes",
  "default_shard_dim",
  "elastic_device_counts",
  "elastic_microbatches",
  "estimate_communication",
  "estimate_memory",
  "estimate_tree_memory",
  "export_safetensors",
  "gather",
  "gather_to_host",
  "global_batch",
  "initialize",
  "load_params",
  "loop_collectives",
  "pipeline",
  "pipeline_timetable",
  "preemption_requested",
  "profile",
  "remat_policy",
  "scan",
  "train_state_spec",
  "use_cpu_devices",
  "value_and_grad",
  "zero1",
  "zero2",
  "zero3",
)
