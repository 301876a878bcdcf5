"""Compiling for GPUs and TPUs this machine does not have (deviceless ahead-of-time compilation).

XLA compiles a program for an 8 x H100 host or a TPU v5e slice from a
description of the devices alone, so the program that those accelerators
would run can be read here: its schedule (which collectives are asynchronous,
what compute runs while they are in flight), its per-device memory
(``compiled.memory_analysis()``) and, on GPU, the latency-hiding scheduler's
own estimate of its time (``zerojax.diagnostics.scheduler_estimate``). The
CPU backend answers none of these questions: its collectives are synchronous
and it lays memory out its own way.

The CUDA and TPU compilers come with ``pip install "zerojax[accelerators]"``.
A compiling process must be started with ``environment(target)`` in its
environment, since the compilers read it when they load: so compile in a
process of its own (one per platform), as ``benchmarks/accelerators.py`` does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
from jax.sharding import Mesh

_DESCRIPTIONS = pathlib.Path(__file__).parent / "targets"


@dataclasses.dataclass(frozen=True)
class Target:
  """A machine to compile for.

  Attributes:
    name: how ``TARGETS`` and the command lines call it.
    platform: ``"cuda"`` or ``"tpu"``.
    topology: the topology's name, as ``jax.experimental.topologies`` takes it.
    description: for GPUs, the device description file (in ``targets/``).
    hbm_bytes: memory per device.
  """

  name: str
  platform: str
  topology: str
  description: str | None
  hbm_bytes: int

  @property
  def device_count(self) -> int:
    return len(self.devices())

  def devices(self) -> list[Any]:
    """The topology's devices (in a process started with ``environment(self)``)."""
    _check_environment(self)
    from jax.experimental import topologies

    if self.platform == "cuda":
      config = (_DESCRIPTIONS / self.description).read_text()
      topology = topologies.get_topology_desc(
        platform="cuda", topology=self.topology, target_config=config
      )
    else:
      topology = topologies.get_topology_desc(topology_name=self.topology, platform="tpu")
    return list(topology.devices)


#: The machines zerojax is measured on, by name.
TARGETS = {
  target.name: target
  for target in (
    Target("h100x8", "cuda", "1x1x8", "h100_sxm.txtpb", 80 * 10**9),
    Target("v5e-8", "tpu", "v5e:2x4", None, 16 * 2**30),
    Target("v5e-64", "tpu", "v5e:8x8", None, 16 * 2**30),
  )
}


def target(name: str) -> Target:
  """The ``Target`` called ``name``, with a clear error for an unknown one."""
  if name not in TARGETS:
    raise ValueError(f"unknown target {name!r}: choose one of {sorted(TARGETS)}.")
  return TARGETS[name]


def environment(target: Target | str, *, scheduler_log: bool = True) -> dict[str, str]:
  """The environment variables a process compiling for ``target`` must start with.

  Args:
    target: a ``Target`` or its name.
    scheduler_log: on GPU, make XLA log its latency-hiding scheduler's
      statistics (read them with ``capture_stderr`` and
      ``zerojax.diagnostics.scheduler_estimate``).

  Returns:
    Variables to add to ``os.environ`` (for ``subprocess.run(env=...)``).

  Example:
    >>> from zerojax._src import deviceless
    >>> sorted(deviceless.environment("v5e-8"))
    ['JAX_PLATFORMS', 'TPU_SKIP_MDS_QUERY']
  """
  target = TARGETS[target] if isinstance(target, str) else target
  if target.platform == "cuda":
    env = {
      "JAX_PLATFORMS": "cuda,cpu",
      "CUDA_VISIBLE_DEVICES": "-1",  # there is no GPU to find
      "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1",  # it looks for CUDA libraries only running needs
    }
    if scheduler_log:
      env |= {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "latency_hiding_scheduler=1"}
    return env
  return {
    "JAX_PLATFORMS": "tpu,cpu",
    "TPU_SKIP_MDS_QUERY": "1",  # no cloud metadata server to ask
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",  # another process may hold libtpu (its lock is per host)
  }


def _check_environment(target: Target) -> None:
  missing = {
    k: v for k, v in environment(target, scheduler_log=False).items() if k != "JAX_PLATFORMS"
  }
  wrong = sorted(k for k, v in missing.items() if os.environ.get(k) != v)
  if wrong:
    raise RuntimeError(
      f"compiling for {target.name} needs a process started with "
      f"zerojax.diagnostics.deviceless_environment({target.name!r}) in its environment "
      f"({', '.join(f'{k}={missing[k]}' for k in wrong)} missing): the compilers read it when "
      "they load, so start a new process with it."
    )


def mesh(
  target: Target | str, shape: tuple[int, ...], axis_names: tuple[str, ...], axis_types=None
) -> Mesh:
  """A ``jax.sharding.Mesh`` over ``target``'s devices, to compile for (never to run on).

  Nothing can be placed on these devices: give ``jax.jit(...).lower`` abstract
  arguments (``jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh,
  spec))``).
  """
  target = TARGETS[target] if isinstance(target, str) else target
  devices = target.devices()
  if np.prod(shape) != len(devices):
    raise ValueError(
      f"a mesh of shape {shape} needs {int(np.prod(shape))} devices; {target.name} has "
      f"{len(devices)}."
    )
  return Mesh(np.array(devices).reshape(shape), axis_names, axis_types=axis_types)


@contextlib.contextmanager
def capture_stderr() -> Iterator[list[str]]:
  """Collects what the process writes to its standard error (C++ logs included) meanwhile.

  Yields a list that holds the text once the block ends.
  """
  captured: list[str] = []
  with tempfile.TemporaryFile(mode="w+b") as sink:
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(sink.fileno(), 2)
    try:
      yield captured
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      sink.seek(0)
      captured.append(sink.read().decode(errors="replace"))
