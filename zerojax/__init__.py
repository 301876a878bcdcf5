"""zerojax: ZeRO stages 1, 2 and 3 for JAX, as Optax transformations.

The optimizer API is here: ``zero1``, ``zero2`` and ``zero3`` wrap an optax
optimizer; ``value_and_grad``, ``scan`` and ``gather`` write the training step;
the estimators predict memory and communication; ``CheckpointManager`` saves
and resumes; ``load_safetensors`` reads pretrained weights into shards. Reading
compiled steps lives in ``zerojax.diagnostics``, running on many processes in
``zerojax.distributed``, Flax in ``zerojax.flax``, and the command lines in
``zerojax.launch``, ``zerojax.estimate`` and ``zerojax.export``. ``plan`` picks a
setup for a machine before it exists; its pieces are in ``zerojax.planning``.
"""

from zerojax import diagnostics as diagnostics
from zerojax import distributed as distributed
from zerojax import planning as planning
from zerojax._src.checkpoint.export import export_safetensors, load_params
from zerojax._src.checkpoint.load import FileKey, load_safetensors
from zerojax._src.checkpoint.manager import CheckpointManager, StateSpec, train_state_spec
from zerojax._src.checkpoint.pretrained_export import export_pretrained
from zerojax._src.comm.quantized import Quantization
from zerojax._src.comm.shards import Shard, except_gathered, gather, remat_policy
from zerojax._src.core.precision import DynamicLossScale, LossScaleState, Precision
from zerojax._src.core.state import ZeroState
from zerojax._src.core.transformation import ZeroTransformation, zero1, zero2, zero3
from zerojax._src.diagnostics.estimate import (
  CommunicationEstimate,
  MemoryEstimate,
  estimate_communication,
  estimate_memory,
  estimate_tree_memory,
)
from zerojax._src.pipeline.loop import pipeline
from zerojax._src.pipeline.timetable import Timetable, pipeline_timetable
from zerojax._src.plan.search import plan
from zerojax._src.sharding.layout import (
  DEFAULT_MIN_SHARD_SIZE,
  Layout,
  LeafLayout,
  default_shard_dim,
)
from zerojax._src.sharding.stored import Stored
from zerojax._src.step.forward import forward
from zerojax._src.step.scan import scan
from zerojax._src.step.value_and_grad import value_and_grad

__version__ = "0.1.0"

__all__ = (
  "DEFAULT_MIN_SHARD_SIZE",
  "CheckpointManager",
  "CommunicationEstimate",
  "DynamicLossScale",
  "FileKey",
  "Layout",
  "LeafLayout",
  "LossScaleState",
  "MemoryEstimate",
  "Precision",
  "Quantization",
  "Shard",
  "StateSpec",
  "Stored",
  "Timetable",
  "ZeroState",
  "ZeroTransformation",
  "default_shard_dim",
  "estimate_communication",
  "estimate_memory",
  "estimate_tree_memory",
  "except_gathered",
  "export_pretrained",
  "export_safetensors",
  "forward",
  "gather",
  "load_params",
  "load_safetensors",
  "pipeline",
  "pipeline_timetable",
  "plan",
  "remat_policy",
  "scan",
  "train_state_spec",
  "value_and_grad",
  "zero1",
  "zero2",
  "zero3",
)
