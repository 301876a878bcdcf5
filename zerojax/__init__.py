"""zerojax: ZeRO stages 1, 2 and 3 for JAX, as Optax transformations.

The optimizer API is here: ``zero1``, ``zero2`` and ``zero3`` wrap an optax
optimizer; ``value_and_grad``, ``scan`` and ``gather`` write the training step;
the estimators predict memory and communication; ``CheckpointManager`` saves
and resumes. Reading compiled steps lives in ``zerojax.diagnostics``, running
on many processes in ``zerojax.distributed``, Flax in ``zerojax.flax``, and
the command lines in ``zerojax.launch``, ``zerojax.estimate`` and
``zerojax.export``.
"""

from typing import TYPE_CHECKING, Any

from zerojax._src import lazy
from zerojax._src.deprecations import moved_names

if TYPE_CHECKING:  # what type checkers read; at run time each name is imported when read
  from zerojax import diagnostics as diagnostics
  from zerojax import distributed as distributed
  from zerojax._src.checkpoint import CheckpointManager, StateSpec, train_state_spec
  from zerojax._src.collectives import Shard, except_gathered, gather, remat_policy
  from zerojax._src.estimate import (
    CommunicationEstimate,
    MemoryEstimate,
    estimate_communication,
    estimate_memory,
    estimate_tree_memory,
  )
  from zerojax._src.export import export_safetensors, load_params
  from zerojax._src.grad import value_and_grad
  from zerojax._src.layout import DEFAULT_MIN_SHARD_SIZE, Layout, LeafLayout, default_shard_dim
  from zerojax._src.pipeline import pipeline
  from zerojax._src.pipeline_schedule import Timetable, pipeline_timetable
  from zerojax._src.precision import DynamicLossScale, LossScaleState, Precision
  from zerojax._src.quantize import Quantization
  from zerojax._src.scan import scan
  from zerojax._src.state import ZeroState
  from zerojax._src.zero import ZeroTransformation, zero1, zero2, zero3

__version__ = "0.1.0"

__all__ = (
  "DEFAULT_MIN_SHARD_SIZE",
  "CheckpointManager",
  "CommunicationEstimate",
  "DynamicLossScale",
  "Layout",
  "LeafLayout",
  "LossScaleState",
  "MemoryEstimate",
  "Precision",
  "Quantization",
  "Shard",
  "StateSpec",
  "Timetable",
  "ZeroState",
  "ZeroTransformation",
  "default_shard_dim",
  "estimate_communication",
  "estimate_memory",
  "estimate_tree_memory",
  "except_gathered",
  "export_safetensors",
  "gather",
  "load_params",
  "pipeline",
  "pipeline_timetable",
  "remat_policy",
  "scan",
  "train_state_spec",
  "value_and_grad",
  "zero1",
  "zero2",
  "zero3",
)


def _moved(name: str) -> Any:
  """A name that moved to ``zerojax.diagnostics`` or ``zerojax.distributed``: found here too,
  with a DeprecationWarning that names the new place, for one more release."""
  from zerojax import diagnostics, distributed

  return moved_names(
    "zerojax",
    {
      **dict.fromkeys(diagnostics.__all__, "zerojax.diagnostics"),
      **dict.fromkeys(distributed.__all__, "zerojax.distributed"),
    },
  )(name)


# Each public name is imported from its module when first read (zerojax._src.lazy), so that
# `python -m zerojax.launch`, which only starts and watches processes, imports no JAX.
__getattr__, __dir__ = lazy.attach(globals(), _moved)
