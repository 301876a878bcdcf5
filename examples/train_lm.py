"""Trains a character-level GPT on the Python standard library with ZeRO stage 0, 1, 2 or 3.

This file holds the flags; the example itself is the folder ``examples/lm``:
``lm/train.py`` is the training loop, ``lm/model.py`` the model (a byte-level
transformer whose scanned layers gather one layer at a time), ``lm/data.py``
the data (the running interpreter's standard library, no download),
``lm/stages.py`` how each stage trains, ``lm/configs.py`` the model presets
and the checked settings of a run, and ``lm/report.py`` what is printed and
written. Gradients come from ``zerojax.value_and_grad``, which runs the loss
once per device on its slice of the batch. Stage 0 is the baseline: replicated
parameters and optimizer state, plain ``jax.value_and_grad`` under ``jax.jit``.
At the end the script prints the compiled train step's per-device memory next
to stage 0's, writes ``metrics.json`` and ``loss.png`` to ``--out``, and prints
a sample (``--no-report``: ``metrics.json`` only). Every step's training loss
is appended to ``--out``/``losses.jsonl`` as it is computed (a line
``{"step": 5, "loss": 2.31...}``; with ``--resume`` the file is continued, so it
records every attempt of a restarted run, re-done steps included).

On CPU the script asks JAX for ``--devices`` CPU devices (8 by default,
``zerojax.distributed.use_cpu_devices``), so the sharding is real. Usage::

  python examples/train_lm.py                                 # small model, ZeRO-3
  python examples/train_lm.py --stage 0                       # replicated baseline
  python examples/train_lm.py --model tiny --steps 20 --stage 2
  python examples/train_lm.py --model medium --devices 8      # on 8 accelerators
  python examples/train_lm.py --mesh replica=2,data=4         # hybrid sharding (HSDP)
  python examples/train_lm.py --mesh data=4,model=2           # with tensor parallelism
  python examples/train_lm.py --mesh stage=2,data=4 --microbatches 4 --schedule 1f1b  # pipeline
  python examples/train_lm.py --mesh node=2,data=4 --secondary-axis data  # ZeRO++'s hpZ
  python examples/train_lm.py --quantized-weights int8 --quantized-gradients int8  # ZeRO++
  python examples/train_lm.py --checkpoint-dir ckpt --resume  # save every 100 steps; resume
  python -m zerojax_launch -n 2 --devices-per-process 4 examples/train_lm.py  # 2 processes
  python -m zerojax_launch -n 2 --devices-per-process 4 --max-restarts 3 \\
    examples/train_lm.py --checkpoint-dir ckpt --resume      # restarted after failures
  python -m zerojax_launch -n 2 --devices-per-process 4 --max-restarts 3 --min-processes 1 \\
    examples/train_lm.py --per-device-batch 4 --checkpoint-dir ckpt --resume  # fewer hosts
  sbatch examples/slurm/train.sbatch                          # SLURM: one process per GPU

``--mesh`` lays the devices out over named axes: ``data`` (ZeRO shards over it),
``node`` (ZeRO shards over it and ``data`` jointly: the nodes of a cluster, whose
links are slower), ``replica`` (everything replicated, the batch split: hybrid
sharding), ``model`` (the attention and MLP weights placed Megatron-style, see
``lm.model.tensor_parallel_specs``) and ``stage`` (the layers split into
pipeline stages, ``zerojax.pipeline``; ``--microbatches`` micro-batches flow
through them as ``--schedule`` says). ``--secondary-axis data`` adds ZeRO++'s
hpZ: each layer's backward gather reads a copy kept inside the node. With
``--checkpoint-dir`` the training state (parameters, optimizer state with its
master copy and loss scale, step) is saved as sharded arrays every
``--save-every`` steps and at the end, keeping the last ``--keep``; ``--resume``
continues from the latest one that can be read, on any device count, mesh or
stage. Batches are a function of the seed and the step number, and the
learning-rate schedule is the one the checkpoints started with
(``CHECKPOINT_DIR/schedule.json``, whatever ``--steps`` says now), so a resumed
run trains on exactly the batches and learning rates an uninterrupted run
would. Without ``--resume``, a ``--checkpoint-dir`` holding checkpoints is
refused.

Preemption: on SIGTERM (a preempted VM, SLURM's ``--signal``, the launcher
being stopped) every process finishes its step, all stop after the same step
(``zerojax.distributed.preemption_requested``), save it (with ``--checkpoint-dir``) and exit
with status ``zerojax.distributed.PREEMPTED_EXIT_CODE`` (75), which ``python -m
zerojax_launch`` answers with a restart. Under ``--resume`` the restarted run
continues from exactly that step.

Elastic batches: with ``--per-device-batch P`` the micro-batches are whatever
reaches ``--batch-size`` with at most P sequences per device
(``zerojax.distributed.elastic_microbatches``), so a run resumed on fewer devices (a host
lost for good, ``python -m zerojax_launch --min-processes``) keeps its global
batch, and a device count that cannot reach it is refused with those that can.
Batches depend on the seed, the step and the sample's index only, never on the
device or process count.

Progress: a bar where stderr is a terminal; elsewhere (a batch job's log, the
launcher's pipes) a plain line every ``--log-every`` steps or minute.

Multi-process (one process per host or GPU): ``--coordinator``,
``--num-processes`` and ``--process-id`` (or the variables ``python -m
zerojax_launch`` sets, or ``--detect-cluster`` under SLURM, Open MPI or a
Cloud TPU pod slice) join the processes with ``zerojax.distributed.initialize``; each
process then loads only its rows of every batch. Process 0 alone prints and
writes files.

A mistake in the flags ends the script with a usage message and status 2
before anything is computed. From Python, ``main(["--model", "tiny", "--steps",
"20"])`` returns the metrics (or raises ``SystemExit(2)`` for a mistake,
``SystemExit(75)`` when preempted).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import pathlib
import sys
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

import zerojax

try:  # imported as examples.train_lm (the tests, benchmarks/quantization.py)
  from .lm import configs, train
except ImportError:  # run as a script, python examples/train_lm.py: examples/ is on the path
  from lm import configs, train


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the script with the flags in ``argv`` (default: the command line); returns the metrics."""
  parser = build_parser()
  args = parser.parse_args(argv)
  try:
    # First, before anything touches a device; False (and nothing done) for one process.
    multi_process = zerojax.distributed.initialize(
      args.coordinator, args.num_processes, args.process_id, detect_cluster=args.detect_cluster
    )
    config = make_config(args, multi_process)
    if multi_process:
      check_same_flags(config, sys.argv[1:] if argv is None else argv)
    devices = claim_devices(config.devices, multi_process)
  except ValueError as error:
    parser.error(str(error))
  sizes = config.mesh_shape
  # With a tensor-parallel axis, the compiler partitions the layers' plain jnp
  # math (Auto axes); explicit axes would ask every sharded contraction for its
  # output's sharding. Otherwise jax.make_mesh's default, Explicit.
  axis_type = jax.sharding.AxisType.Auto if "model" in sizes else jax.sharding.AxisType.Explicit
  mesh = jax.make_mesh(
    tuple(sizes.values()), tuple(sizes), axis_types=(axis_type,) * len(sizes), devices=devices
  )
  with jax.set_mesh(mesh):
    try:
      return train.train(config, mesh)
    except configs.FlagsError as error:
      parser.error(str(error))


def make_config(args: argparse.Namespace, multi_process: bool) -> configs.Config:
  """The run's ``Config``: the flags, the ``--model`` preset's defaults for those left unset.

  Raises:
    ValueError: if the flags do not fit together (``Config`` says which).
  """
  if multi_process:
    if args.devices not in (None, jax.device_count()):
      raise ValueError(
        f"--devices {args.devices}, but the {jax.process_count()} processes have "
        f"{jax.device_count()} devices: a multi-process mesh spans them all; drop --devices."
      )
    devices = jax.device_count()
  else:
    devices = args.devices or (math.prod(args.mesh.values()) if args.mesh else 8)
  preset = configs.PRESETS[args.model]
  names = [field.name for field in dataclasses.fields(configs.Config) if field.name != "devices"]
  flags = {name: getattr(args, name) for name in names}
  for name in ("steps", "batch_size", "seq_len", "lr"):
    if flags[name] is None:
      flags[name] = getattr(preset, name)
  flags["microbatches"] = microbatches(args, flags["batch_size"], devices)
  return configs.Config(**(flags | {"devices": devices}))


def check_same_flags(config: configs.Config, argv: Sequence[str]) -> None:
  """Raises unless every process of a multi-process run has this ``config`` (one tiny all-gather).

  Processes that build different models would otherwise meet in collectives
  of different sizes, which abort in gloo.

  Raises:
    ValueError: naming the processes whose flags differ from process 0's, and
      this process's ``argv``.
  """
  signature = np.uint32(zlib.crc32(repr(config).encode()))
  everyone = np.asarray(multihost_utils.process_allgather(signature)).ravel()
  differ = [int(p) for p in np.flatnonzero(everyone != everyone[0])]
  if differ:
    raise ValueError(
      f"process(es) {differ} were started with other flags than process 0, and every process "
      f"of a run needs the same ones; process {jax.process_index()} has: {' '.join(argv)}"
    )


def microbatches(args: argparse.Namespace, batch_size: int, devices: int) -> int:
  """``--microbatches``, or with ``--per-device-batch`` what reaches the batch on ``devices``.

  Raises:
    ValueError: if both flags are given, or no whole number of micro-batches
      reaches the batch (``zerojax.distributed.elastic_microbatches`` says which device
      counts do).
  """
  if args.per_device_batch is None:
    return args.microbatches or 1
  if args.microbatches is not None:
    raise ValueError(
      "--microbatches and --per-device-batch: pass one; --per-device-batch picks the "
      "micro-batches that reach --batch-size on the devices there are"
    )
  batch_devices = configs.batch_devices(args.mesh or {"data": devices})
  try:
    return zerojax.distributed.elastic_microbatches(
      batch_size, batch_devices, args.per_device_batch
    )
  except ValueError as error:
    raise ValueError(f"--batch-size {batch_size} on {batch_devices} devices: {error}") from None


def claim_devices(count: int, multi_process: bool) -> list[jax.Device]:
  """The first ``count`` of JAX's devices; on one CPU, first asks JAX for ``count`` of them.

  Raises:
    ValueError: if JAX has fewer than ``count`` devices.
  """
  if not multi_process:
    # If JAX started before this script (a test, a notebook), it keeps its devices: the mesh
    # takes the first ``count`` of them.
    with contextlib.suppress(ValueError):
      zerojax.distributed.use_cpu_devices(count)
  if jax.device_count() < count:
    raise ValueError(
      f"--devices {count}, but JAX has {jax.device_count()} devices: pass --devices "
      f"{jax.device_count()} or fewer (on CPU, JAX fixes the number when it starts: a fresh "
      "process can have more)."
    )
  return jax.devices()[:count]


def build_parser() -> argparse.ArgumentParser:
  """The flags; those of the model's size left unset take the ``--model`` preset's value."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=3)
  parser.add_argument("--model", choices=tuple(configs.PRESETS), default="small")
  parser.add_argument("--steps", type=at_least(1), help="train steps (default: the preset's)")
  parser.add_argument(
    "--batch-size", type=at_least(1), help="global batch, a multiple of --devices"
  )
  parser.add_argument("--seq-len", type=at_least(1), help="context length in bytes")
  parser.add_argument("--lr", type=positive_number, help="peak learning rate")
  parser.add_argument("--seed", type=at_least(0), default=0)
  parser.add_argument(
    "--microbatches",
    type=at_least(1),
    help="micro-batches accumulated per step, per device (stages 1-3; default 1)",
  )
  parser.add_argument(
    "--per-device-batch",
    type=at_least(1),
    help="the most sequences a device takes at once; the micro-batches are then whatever "
    "reaches --batch-size on the devices there are (zerojax.distributed.elastic_microbatches), "
    "so a run restarted on fewer devices (python -m zerojax_launch --min-processes) keeps its "
    "batch",
  )
  parser.add_argument(
    "--prefetch",
    type=int,
    choices=(0, 1),
    default=1,
    help="layers zerojax.scan gathers ahead of the compute: 1 overlaps the gathers with the "
    "compute on GPUs and TPUs; 0 serialises them, cheaper on CPU, where collectives are "
    "synchronous (the same numbers to rounding: docs/performance.md)",
  )
  add_parallelism_flags(parser)
  add_precision_flags(parser)
  add_checkpoint_flags(parser)
  parser.add_argument(
    "--eval-every", type=at_least(1), default=100, help="steps between validations"
  )
  parser.add_argument(
    "--report",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="end with the per-device memory table (compiling the stage-0 step too), a sample and "
    "the loss plot; --no-report skips all three (metrics.json and losses.jsonl are still "
    "written), e.g. for a long run where only the checkpoints matter",
  )
  parser.add_argument(
    "--log-every",
    type=at_least(1),
    default=50,
    help="where the output is not a terminal (a batch job's log), print a progress line every "
    "this many steps (and at least every minute) instead of the progress bar",
  )
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("out"))
  return parser


def add_parallelism_flags(parser: argparse.ArgumentParser) -> None:
  """The devices, their mesh, and the processes of a multi-process run."""
  parser.add_argument(
    "--devices",
    type=at_least(1),
    help="data-parallel devices: forced on CPU (default 8); in a multi-process run, all of "
    "the job's (the default)",
  )
  parser.add_argument(
    "--mesh",
    type=parse_mesh,
    help="named axes and sizes, e.g. replica=2,data=4 (hybrid sharding), node=2,data=4 "
    "(sharded over both), data=4,model=2 (tensor parallelism) or stage=2,data=4 (pipeline "
    "stages); the default is data=--devices",
  )
  parser.add_argument(
    "--schedule",
    choices=("gpipe", "1f1b"),
    help="with a stage axis: gpipe (every forward pass, then every backward pass) or 1f1b "
    "(backward passes interleaved, at most 2 x stages - 1 micro-batches held; the loss is "
    "computed in the last stage); default gpipe",
  )
  parser.add_argument(
    "--secondary-axis",
    choices=("data",),
    help="ZeRO++'s hpZ (stage 3, with a node axis in --mesh): keep each layer's forward gather "
    "also split over this intra-node axis, so that the backward gathers stay inside the node",
  )
  parser.add_argument("--coordinator", help="host:port of process 0, for a multi-process run")
  parser.add_argument("--num-processes", type=int, help="processes in a multi-process run")
  parser.add_argument("--process-id", type=int, help="this process's index in the run")
  parser.add_argument(
    "--detect-cluster",
    action="store_true",
    help="find the processes from SLURM, Open MPI or a Cloud TPU pod slice",
  )


def add_precision_flags(parser: argparse.ArgumentParser) -> None:
  """The compute dtype, and ZeRO++'s quantized communication."""
  parser.add_argument(
    "--precision",
    choices=("fp32", "bf16", "fp16"),
    default="fp32",
    help="compute dtype; master weights, optimizer state and gradient reductions stay fp32, "
    "and fp16 adds dynamic loss scaling (stages 1-3)",
  )
  for what, collectives, stages in (
    ("weights", "all-gathers", "stage 3"),
    ("gradients", "reductions", "stages 1-3"),
  ):
    parser.add_argument(
      f"--quantized-{what}",
      choices=("int8", "int4"),
      help=f"move the {what[:-1]} {collectives} as block-quantized integers, as ZeRO++ does "
      f"({stages})",
    )
  parser.add_argument(
    "--quantization-block-size",
    type=at_least(1),
    default=256,
    help="elements per scale of the quantized weights and gradients",
  )
  parser.add_argument(
    "--offload",
    choices=("optimizer", "optimizer+master"),
    help="keep the optimizer state (and, with --precision bf16/fp16, the fp32 master copy) in "
    "host memory between steps (stages 1-3)",
  )


def add_checkpoint_flags(parser: argparse.ArgumentParser) -> None:
  """Where and how often to save, and whether to resume."""
  parser.add_argument("--checkpoint-dir", type=pathlib.Path, help="save checkpoints here")
  parser.add_argument(
    "--save-every", type=at_least(1), default=100, help="steps between checkpoints"
  )
  parser.add_argument("--keep", type=at_least(1), default=3, help="checkpoints to keep")
  parser.add_argument(
    "--resume", action="store_true", help="continue from the latest checkpoint, if there is one"
  )


def at_least(least: int) -> Callable[[str], int]:
  """An argparse type: a whole number of at least ``least``."""

  def whole_number(text: str) -> int:
    value = int(text)  # argparse reports a ValueError as "invalid whole_number value"
    if value < least:
      raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value

  return whole_number


def positive_number(text: str) -> float:
  """An argparse type: a finite number above 0."""
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
  if not (math.isfinite(value) and value > 0):
    raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
  return value


def parse_mesh(text: str) -> dict[str, int]:
  """``"replica=2,data=4"`` -> ``{"replica": 2, "data": 4}``, in mesh order.

  Example:
    >>> parse_mesh("data=4,model=2")
    {'data': 4, 'model': 2}
  """
  try:
    pairs = [(name, int(size)) for name, size in (part.split("=") for part in text.split(","))]
  except ValueError:
    raise argparse.ArgumentTypeError(
      f"{text!r} is not axis=size,...; e.g. data=4,model=2"
    ) from None
  sizes = dict(pairs)
  if len(sizes) < len(pairs):
    raise argparse.ArgumentTypeError(f"--mesh {text!r} names an axis twice; name each once")
  unknown = [name for name in sizes if name not in configs.MESH_AXES]
  if unknown or "data" not in sizes or min(sizes.values()) < 1:
    raise argparse.ArgumentTypeError(
      f"--mesh {text!r}: name axes among {configs.MESH_AXES}, data among them, each of size >= 1"
    )
  return {name: sizes[name] for name in configs.MESH_AXES if name in sizes}


if __name__ == "__main__":
  main()
