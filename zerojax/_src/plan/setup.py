"""The setups a plan chooses among: one ``Setup`` per candidate, a ``Space`` of them.

A setup is every choice a team makes before it runs a model on a machine: the
ZeRO stage, full or hybrid sharding or hpZ, ZeRO++'s quantized collectives,
what the backward pass keeps, optimizer offload, pipeline stages, and the
batch per device. A space is the choices to try, each axis a tuple; its
``setups(...)`` are those that make sense on a machine (hybrid sharding needs
more than one node, a pipeline's stages must divide the layers).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from typing import Any, cast

#: What the backward pass keeps, by the names ``Setup.remat`` takes: the ``policy=`` of
#: ``zerojax.scan`` each stands for is in ``program.py``.
REMAT = ("full", "offload", "names", "dots", "none")
#: How the data axes share the states: over every device (``full``); over the devices of a
#: node, replicated across nodes (``hybrid``, ``replica_axis=``); or over every device with a
#: second copy of the weights sharded within each node for the backward pass (``hpz``, ZeRO++'s
#: ``secondary_axis=``).
SHARDING = ("full", "hybrid", "hpz")
SCHEDULES = ("gpipe", "1f1b")


@dataclasses.dataclass(frozen=True)
class Setup:
  """One way of training a program on a machine: what ``zerojax.plan`` compiles and rates.

  Attributes:
    stage: the ZeRO stage, 1, 2 or 3.
    sharding: ``"full"``, ``"hybrid"`` or ``"hpz"`` (see ``SHARDING``); the last
      two split the devices into nodes (GPU hosts, TPU slices).
    quantized_weights: ZeRO++'s qwZ: stage 3's all-gathers in int8.
    quantized_gradients: ZeRO++'s qgZ: the gradient reductions in int8.
    remat: what the backward pass keeps of each layer, where the program's
      layer does not say (``REMAT``): ``"full"`` only its input (the whole
      layer is recomputed), ``"dots"`` matmul outputs, ``"names"`` the
      activations the program names, ``"offload"`` those in host memory,
      ``"none"`` every value.
    offload: ``"optimizer"`` keeps the optimizer's state in host memory
      between steps; ``None`` on the device.
    pipeline: pipeline stages (1: no pipeline). The layers are split evenly
      over a ``stage`` mesh axis of this size.
    schedule: the pipeline's schedule, ``"gpipe"`` or ``"1f1b"``.
    microbatches: the pipeline's micro-batches a step (1 without a pipeline).
    batch: examples a step per data-parallel rank: the global batch is this
      times the devices over the pipeline stages.
    prefetch: ``zerojax.scan`` 's ``prefetch=``.

  Example:
    >>> from zerojax.planning import Setup
    >>> Setup(remat="dots", batch=4).describe()
    'zero3, remat=dots, batch=4'
    >>> Setup(stage=3, sharding="hpz", quantized_weights=True, batch=2).describe()
    'zero3 hpz qwZ, batch=2'
  """

  stage: int = 3
  sharding: str = "full"
  quantized_weights: bool = False
  quantized_gradients: bool = False
  remat: str = "full"
  offload: str | None = None
  pipeline: int = 1
  schedule: str = "1f1b"
  microbatches: int = 1
  batch: int = 1
  prefetch: int = 1

  def __post_init__(self):
    _check_choice("stage", self.stage, (1, 2, 3))
    _check_choice("sharding", self.sharding, SHARDING)
    _check_choice("remat", self.remat, REMAT)
    _check_choice("offload", self.offload, (None, "optimizer"))
    _check_choice("schedule", self.schedule, SCHEDULES)
    _check_choice("prefetch", self.prefetch, (0, 1))
    for name in ("pipeline", "microbatches", "batch"):
      if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
        raise ValueError(f"Setup's {name} must be a positive int, got {getattr(self, name)!r}.")
    if self.batch % self.microbatches:
      raise ValueError(
        f"Setup(batch={self.batch}, microbatches={self.microbatches}): the pipeline splits "
        "each rank's batch into micro-batches, so microbatches must divide batch."
      )

  def describe(self) -> str:
    """A short name for tables: the options that differ from zerojax's defaults."""
    words = [f"zero{self.stage}"]
    words += [self.sharding] if self.sharding != "full" else []
    words += ["qwZ"] if self.quantized_weights else []
    words += ["qgZ"] if self.quantized_gradients else []
    parts = [" ".join(words)]
    parts += [f"remat={self.remat}"] if self.remat != "full" else []
    parts += [f"offload={self.offload}"] if self.offload else []
    if self.pipeline > 1:
      parts.append(f"pipeline={self.pipeline} {self.schedule} x{self.microbatches}")
    parts += ["prefetch=0"] if self.prefetch == 0 else []
    return ", ".join([*parts, f"batch={self.batch}"])

  def to_json(self) -> dict[str, object]:
    """The setup as a JSON object (``Setup(**setup.to_json())`` rebuilds it)."""
    return dataclasses.asdict(self)

  def needs_at_least(self, other: Setup) -> bool:
    """Whether this setup holds at least what ``other`` holds on a device, so cannot fit if it
    does not: the same setup with at least its batch, and a ``remat`` that keeps at least what
    ``other`` 's keeps (every policy keeps a layer's input, as ``"full"`` does; ``"none"``
    keeps everything any policy keeps).

    Example:
      >>> from zerojax.planning import Setup
      >>> Setup(batch=8).needs_at_least(Setup(batch=4))
      True
      >>> Setup(remat="dots", batch=4).needs_at_least(Setup(batch=2))
      True
      >>> Setup(remat="dots", batch=4).needs_at_least(Setup(remat="names", batch=2))
      False
    """
    same = dataclasses.replace(other, batch=self.batch, remat=self.remat) == self
    keeps_more = other.remat == self.remat or other.remat == "full" or self.remat == "none"
    return same and self.batch >= other.batch and keeps_more


@dataclasses.dataclass(frozen=True)
class Space:
  """The choices ``zerojax.plan`` tries, one tuple per axis of ``Setup``.

  Every combination is a candidate, less those that make no sense for the
  program and the machine (``setups``). The defaults try what pays on most
  machines: stages 2 and 3, hybrid sharding and hpZ where there is more than
  one node, ZeRO++'s int8 collectives across nodes, three choices of what the
  backward pass keeps, and batches from 1 to 16.

  Attributes:
    stages: ZeRO stages.
    sharding: values of ``Setup.sharding``.
    quantized_weights: values of ``Setup.quantized_weights``.
    quantized_gradients: values of ``Setup.quantized_gradients``.
    remat: values of ``Setup.remat``.
    offload: values of ``Setup.offload``.
    pipeline: pipeline stage counts (1: none).
    schedules: pipeline schedules.
    microbatches: pipeline micro-batch counts.
    batches: examples per data-parallel rank.
    prefetch: values of ``Setup.prefetch``.

  Example:
    >>> from zerojax.planning import Space
    >>> space = Space(stages=(3,), remat=("full", "dots"), batches=(1, 2))
    >>> [s.describe() for s in space.setups(layers=4, devices=8, nodes=1)]
    ['zero3, batch=1', 'zero3, remat=dots, batch=1', 'zero3, batch=2', 'zero3, remat=dots, batch=2']
  """

  stages: tuple[int, ...] = (2, 3)
  sharding: tuple[str, ...] = SHARDING
  quantized_weights: tuple[bool, ...] = (False, True)
  quantized_gradients: tuple[bool, ...] = (False, True)
  remat: tuple[str, ...] = ("full", "names", "dots")
  offload: tuple[str | None, ...] = (None,)
  pipeline: tuple[int, ...] = (1,)
  schedules: tuple[str, ...] = ("1f1b",)
  microbatches: tuple[int, ...] = (1,)
  batches: tuple[int, ...] = (1, 2, 4, 8, 16)
  prefetch: tuple[int, ...] = (1,)

  def setups(self, *, layers: int, devices: int, nodes: int, names: bool = True) -> list[Setup]:
    """The space's setups that make sense for a program of ``layers`` layers on ``devices``
    devices in ``nodes`` nodes, smallest batch first.

    Left out: hybrid sharding, hpZ and ZeRO++'s quantized collectives on one
    node (they trade bytes across nodes); qwZ and hpZ below stage 3 (only
    stage 3 gathers weights); pipelines whose stages divide neither the layers nor
    the devices, or with micro-batches that do not divide the batch, or
    with hybrid sharding or hpZ (a pipeline shards over its data axis only);
    micro-batches without a pipeline; ``"names"`` and ``"offload"`` for a
    program that names no activation (``names=False``).

    Args:
      layers: the program's layer count.
      devices: the machine's device count.
      nodes: its nodes (GPU hosts, TPU slices).
      names: whether the program names activations (``Program.names``).

    Returns:
      The setups, ordered by batch, then by how much ``remat`` keeps.
    """
    found = []
    axes = itertools.product(
      self.batches,
      self.remat,
      self.stages,
      self.sharding,
      self.quantized_weights,
      self.quantized_gradients,
      self.offload,
      self.pipeline,
      self.schedules,
      self.microbatches,
      self.prefetch,
    )
    for combination in axes:
      batch, remat, stage, sharding, qw, qg, offload, stages, schedule, micro, prefetch = cast(
        tuple[Any, ...], combination
      )
      across = sharding != "full" or qw or qg
      pipelined = stages > 1
      if (
        (across and nodes == 1)
        or ((qw or sharding == "hpz") and stage != 3)
        or (remat in ("names", "offload") and not names)
        or (pipelined and (layers % stages or devices % stages or sharding != "full"))
        or (not pipelined and (micro != 1 or schedule != self.schedules[0]))
        or batch % micro
      ):
        continue
      found.append(
        Setup(stage, sharding, qw, qg, remat, offload, stages, schedule, micro, batch, prefetch)
      )
    return sorted(found, key=lambda s: (s.batch, REMAT.index(s.remat)))


def _check_choice(name: str, value: object, choices: tuple[object, ...]) -> None:
  if value not in choices:
    raise ValueError(f"Setup's {name} must be one of {choices}, got {value!r}.")


def rounds(setups: list[Setup]) -> Iterator[list[Setup]]:
  """``setups`` grouped into the rounds a plan compiles in parallel: one batch and ``remat``
  rank at a time, so that what did not fit prunes the rounds after it."""
  key = lambda s: (s.batch, REMAT.index(s.remat))
  for _, group in itertools.groupby(sorted(setups, key=key), key=key):
    yield list(group)
