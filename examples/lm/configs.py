"""The settings of a training run: model presets, and one run's resolved and checked ``Config``.

A ``Preset`` is a model size with the defaults of the flags that go with it;
a ``Config`` is everything one run of ``examples/train_lm.py`` needs, built
from the flags once they are all known, and checked as a whole: every
mistake is a ``ValueError`` that names the flags to change.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib

#: Validation windows per evaluation, in units of ``batch_size``.
EVAL_BATCHES = 4
#: The mesh axes the example knows, in mesh order.
MESH_AXES = ("stage", "replica", "node", "data", "model")


@dataclasses.dataclass(frozen=True)
class Preset:
  """A model size and the defaults of the flags that go with it."""

  d_model: int
  n_layers: int
  n_heads: int
  seq_len: int
  batch_size: int
  lr: float
  steps: int


PRESETS = {
  # For CI: seconds on a laptop CPU.
  "tiny": Preset(d_model=64, n_layers=2, n_heads=4, seq_len=64, batch_size=32, lr=3e-3, steps=50),
  # The default: a few minutes on a 2-core CPU, well below the unigram baseline.
  "small": Preset(
    d_model=128, n_layers=4, n_heads=4, seq_len=64, batch_size=32, lr=3e-3, steps=600
  ),
  # For accelerators.
  "medium": Preset(
    d_model=512, n_layers=8, n_heads=8, seq_len=256, batch_size=64, lr=6e-4, steps=5000
  ),
  "large": Preset(
    d_model=1024, n_layers=24, n_heads=16, seq_len=512, batch_size=128, lr=3e-4, steps=20000
  ),
}


@dataclasses.dataclass(frozen=True)
class Config:
  """One training run, as the flags of ``examples/train_lm.py`` describe it.

  Attributes:
    model: the ``PRESETS`` name.
    stage: 0 (replicated data parallelism) or the ZeRO stage, 1 to 3.
    steps: training steps.
    batch_size: the global batch, in sequences.
    seq_len: the context length, in bytes.
    lr: the peak learning rate.
    devices: the devices of the mesh.
    mesh: the named axes and their sizes, as given (``None``: one ``data`` axis).
    precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``.
    quantized_weights: ``"int8"``, ``"int4"`` or ``None``.
    quantized_gradients: ``"int8"``, ``"int4"`` or ``None``.
    quantization_block_size: elements per scale.
    offload: ``"optimizer"``, ``"optimizer+master"`` or ``None``: what lives in host memory.
    secondary_axis: ``"data"`` for ZeRO++'s hpZ (a copy of each layer inside each node), or
      ``None``.
    microbatches: micro-batches accumulated per step (with a ``stage`` axis, the
      pipeline's micro-batches).
    schedule: the pipeline schedule (``"gpipe"`` or ``"1f1b"``) with a ``stage``
      axis, as given (``None``: ``"gpipe"``).
    per_device_batch: the most sequences a device takes at once, if given:
      ``microbatches`` is then what reaches ``batch_size`` on these devices.
    prefetch: layers gathered ahead of the compute by ``zerojax.scan`` (0 or 1).
    checkpoint_dir: where checkpoints go (``None``: no checkpoints).
    save_every: steps between checkpoints.
    keep: checkpoints to keep.
    resume: whether to continue from the latest checkpoint.
    seed: the seed of the initial parameters and of the batches.
    eval_every: steps between validations.
    report: whether to end with the memory table and a sample.
    log_every: steps between progress lines where the output is not a terminal.
    out: where the metrics, the loss log and the plot go.
  """

  model: str
  stage: int
  steps: int
  batch_size: int
  seq_len: int
  lr: float
  devices: int
  mesh: dict[str, int] | None
  precision: str
  quantized_weights: str | None
  quantized_gradients: str | None
  quantization_block_size: int
  offload: str | None
  secondary_axis: str | None
  microbatches: int
  schedule: str | None
  per_device_batch: int | None
  prefetch: int
  checkpoint_dir: pathlib.Path | None
  save_every: int
  keep: int
  resume: bool
  seed: int
  eval_every: int
  report: bool
  log_every: int
  out: pathlib.Path

  def __post_init__(self):
    for problem in (self._options_problem(), self._layout_problem(), self._paths_problem()):
      if problem:
        raise ValueError(problem)

  @property
  def preset(self) -> Preset:
    return PRESETS[self.model]

  @property
  def mesh_shape(self) -> dict[str, int]:
    """The mesh's axes and sizes: ``mesh``, or ``devices`` on one ``data`` axis."""
    return self.mesh or {"data": self.devices}

  @property
  def pipeline(self) -> str | None:
    """The pipeline schedule, with a ``stage`` axis; ``None`` without one."""
    return (self.schedule or "gpipe") if "stage" in self.mesh_shape else None

  @property
  def data_axes(self) -> tuple[str, ...]:
    """The mesh axes ZeRO shards over: ``node`` (across nodes) and ``data``."""
    return tuple(axis for axis in ("node", "data") if axis in self.mesh_shape)

  @property
  def batch_axes(self) -> tuple[str, ...]:
    """The mesh axes the batch is split over."""
    return tuple(axis for axis in ("replica", *self.data_axes) if axis in self.mesh_shape)

  @property
  def batch_devices(self) -> int:
    """The devices the batch is split over: replica x data."""
    return batch_devices(self.mesh_shape)

  @property
  def device_batch(self) -> int:
    """The sequences one device takes in one micro-batch."""
    return self.batch_size // (self.batch_devices * self.microbatches)

  def _options_problem(self) -> str | None:
    """What is wrong with the stage and its options, if anything."""
    if self.stage == 0 and self.per_device_batch and self.microbatches != 1:
      return (
        f"--per-device-batch {self.per_device_batch} needs {self.microbatches} micro-batches on "
        f"{self.batch_devices} devices, and micro-batches apply to stages 1-3 (zerojax): use a "
        "stage, more devices, or a larger --per-device-batch"
      )
    if self.stage == 0 and (
      self.precision != "fp32" or self.microbatches != 1 or self.quantized_gradients
    ):
      return "--precision, --microbatches and --quantized-gradients apply to stages 1-3 (zerojax)"
    if self.stage == 0 and self.offload:
      return "--offload applies to stages 1-3 (zerojax)"
    if self.offload == "optimizer+master" and self.precision == "fp32":
      return (
        "--offload optimizer+master: under fp32 the parameters are the master copy; use "
        "--offload optimizer, or --precision bf16"
      )
    if self.stage != 3 and self.quantized_weights:
      return "--quantized-weights applies to stage 3, the one that gathers weights"
    if self.stage != 3 and self.secondary_axis:
      return "--secondary-axis applies to stage 3, the one that gathers weights"
    if self.secondary_axis and "node" not in self.mesh_shape:
      return (
        f"--secondary-axis {self.secondary_axis} keeps a copy of each layer inside each node: "
        "give the mesh a node axis too, e.g. --mesh node=2,data=4"
      )
    if self.quantization_block_size % 2:
      return (
        f"--quantization-block-size {self.quantization_block_size}: make it even (int4 packs "
        "two codes a byte); 256 is ZeRO++'s"
      )
    if self.stage == 0 and set(self.mesh_shape) != {"data"}:
      return "--stage 0 is plain data parallelism over --devices; --mesh is for stages 1-3"
    if self.stage == 0 and self.checkpoint_dir:
      return "--checkpoint-dir applies to stages 1-3 (zerojax)"
    if self.resume and not self.checkpoint_dir:
      return "--resume needs --checkpoint-dir"
    return None

  def _layout_problem(self) -> str | None:
    """What does not fit between the devices, the mesh, the model and the batch, if anything."""
    sizes = self.mesh_shape
    if math.prod(sizes.values()) != self.devices:
      return f"--devices {self.devices} but --mesh has {math.prod(sizes.values())}"
    if self.schedule and "stage" not in sizes:
      return f"--schedule {self.schedule} runs pipeline stages: add stage=N to --mesh"
    if self.preset.n_layers % sizes.get("stage", 1):
      return (
        f"--mesh stage={sizes['stage']} does not divide the {self.model} model's "
        f"{self.preset.n_layers} layers among the pipeline stages; take a stage count that does"
      )
    model = sizes.get("model", 1)
    if self.preset.d_model % model:
      fits = [n for n in range(2, self.preset.d_model + 1) if self.preset.d_model % n == 0][:4]
      return (
        f"--mesh model={model} does not divide the {self.model} model's d_model "
        f"{self.preset.d_model}, which tensor parallelism splits; take model= one of "
        f"{', '.join(map(str, fits))}, ..."
      )
    if self.batch_size % (self.batch_devices * self.microbatches):
      return (
        f"--batch-size {self.batch_size} must be a multiple of the {self.batch_devices} devices "
        f"the batch is split over (replica x data) times --microbatches {self.microbatches}"
      )
    return None

  def _paths_problem(self) -> str | None:
    """What is wrong with ``--out`` and ``--checkpoint-dir``, if anything: each is a directory."""
    for flag, path in (("--out", self.out), ("--checkpoint-dir", self.checkpoint_dir)):
      if path is None:
        continue
      blocking = next((p for p in (path, *path.parents) if p.exists()), None)
      if blocking is not None and not blocking.is_dir():
        where = "" if blocking == path else f" (in {path})"
        return f"{flag} {path}: {blocking}{where} is a file; {flag} names a directory"
    return None


class FlagsError(ValueError):
  """A mistake in the flags that shows once the run reads its files: the checkpoint directory
  holds another run's checkpoints, or something else is in the way, or the data is too short.

  ``examples/train_lm.py`` reports it as a usage error (status 2), as it does the
  ``ValueError`` s that ``Config`` raises.
  """


def batch_devices(mesh_shape: dict[str, int]) -> int:
  """The devices a mesh of these axes and sizes splits the batch over: replica x node x data."""
  return mesh_shape.get("replica", 1) * mesh_shape.get("node", 1) * mesh_shape["data"]
