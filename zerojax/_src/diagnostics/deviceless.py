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
import math
import os
import pathlib
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
from jax.sharding import AxisType, Mesh

_DESCRIPTIONS = pathlib.Path(__file__).parent / "targets"


@dataclasses.dataclass(frozen=True)
class DevicelessTarget:
  """A machine to compile for without it, as ``deviceless_target`` names it.

  Attributes:
    name: how ``DEVICELESS_TARGETS`` and the command lines call it.
    platform: ``"cuda"`` or ``"tpu"``.
    topology: the topology's name, as ``jax.experimental.topologies`` takes it.
    description: for GPUs, the device description file (in ``targets/``).
    hbm_bytes: memory per device.
    slices: for TPUs, how many slices of ``topology`` the data-center network
      joins (multi-slice); 1 for one slice.

  Example:
    >>> from zerojax.diagnostics import deviceless_target
    >>> gpu = deviceless_target("h100x8")
    >>> gpu.platform, gpu.topology, gpu.hbm_bytes / 1e9
    ('cuda', '1x1x8', 80.0)
    >>> deviceless_target("h100x128").topology  # 16 nodes of 8
    '16x1x8'
    >>> deviceless_target("2xv5e-16").slices
    2
  """

  name: str
  platform: str
  topology: str
  description: str | None
  hbm_bytes: int
  slices: int = 1

  @property
  def hosts(self) -> int:
    """How many groups of devices slower links join: GPU nodes, or TPU slices.

    Example:
      >>> from zerojax.diagnostics import deviceless_target
      >>> [deviceless_target(t).hosts for t in ("h100x8", "h100x32", "v5e-256", "4xv5e-16")]
      [1, 4, 1, 4]
    """
    if self.platform == "cuda":
      return int(self.topology.split("x")[0])
    return self.slices

  @property
  def device_count(self) -> int:
    """How many devices the topology has, read from its name (in any process).

    Example:
      >>> from zerojax.diagnostics import deviceless_target
      >>> [deviceless_target(t).device_count for t in ("h100x128", "v5e-256", "2xv5e-16")]
      [128, 256, 32]
    """
    shape = self.topology.rpartition(":")[2]
    return math.prod(int(size) for size in shape.split("x")) * self.slices

  def devices(self) -> list[Any]:
    """The topology's devices, to compile for (never to run on).

    Raises:
      RuntimeError: in a process not started with ``deviceless_environment(self.name)``.
    """
    _check_environment(self)
    from jax.experimental import topologies

    if self.description is not None:  # a GPU
      config = (_DESCRIPTIONS / self.description).read_text()
      topology = topologies.get_topology_desc(
        platform="cuda", topology=self.topology, target_config=config
      )
    else:
      topology = topologies.get_topology_desc(
        topology_name=self.topology, platform="tpu", num_slices=self.slices
      )
    return list(topology.devices)


_H100 = 80 * 10**9
_V5E = 16 * 2**30

#: The machines zerojax is measured on, by name.
TARGETS = {
  target.name: target
  for target in (
    *(
      DevicelessTarget(f"h100x{8 * nodes}", "cuda", f"{nodes}x1x8", "h100_sxm.txtpb", _H100)
      for nodes in (1, 2, 4, 8, 16)
    ),
    DevicelessTarget("v5e-8", "tpu", "v5e:2x4", None, _V5E),
    DevicelessTarget("v5e-64", "tpu", "v5e:8x8", None, _V5E),
    DevicelessTarget("v5e-256", "tpu", "v5e:16x16", None, _V5E),
    *(DevicelessTarget(f"{n}xv5e-16", "tpu", "v5e:4x4", None, _V5E, n) for n in (2, 4)),
  )
}


#: The names of the machines zerojax compiles for without them, for ``deviceless_target``,
#: ``deviceless_environment`` and ``deviceless_mesh``: 1, 2, 4, 8 and 16 nodes of 8 H100 SXM
#: (``"h100x8"`` to ``"h100x128"``), TPU v5e slices of 2 x 4, 8 x 8 and 16 x 16 chips
#: (``"v5e-8"``, ``"v5e-64"``, ``"v5e-256"``), and 2 and 4 slices of 4 x 4 joined by the
#: data-center network (``"2xv5e-16"``, ``"4xv5e-16"``).
DEVICELESS_TARGETS = tuple(TARGETS)


def find_target(target: DevicelessTarget | str) -> DevicelessTarget:
  """The machine ``target`` names: its platform, topology and memory per device.

  Args:
    target: one of ``DEVICELESS_TARGETS`` (``"h100x8"``, ``"v5e-64"``, ...),
      or a ``DevicelessTarget``, returned as it is.

  Returns:
    The ``DevicelessTarget``.

  Raises:
    ValueError: for a target zerojax does not know, listing those it does.

  Example:
    >>> from zerojax.diagnostics import DEVICELESS_TARGETS, deviceless_target
    >>> DEVICELESS_TARGETS[:5]
    ('h100x8', 'h100x16', 'h100x32', 'h100x64', 'h100x128')
    >>> DEVICELESS_TARGETS[5:]
    ('v5e-8', 'v5e-64', 'v5e-256', '2xv5e-16', '4xv5e-16')
    >>> [deviceless_target(name).platform for name in ("h100x64", "v5e-256")]
    ['cuda', 'tpu']
    >>> deviceless_target("v5e-64").hbm_bytes // 2**30
    16
  """
  if isinstance(target, DevicelessTarget):
    return target
  if target not in TARGETS:
    raise ValueError(f"unknown target {target!r}: choose one of {sorted(TARGETS)}.")
  return TARGETS[target]


#: XLA:GPU compiled without a GPU cannot autotune the tiling of its Triton GEMM fusions (there is
#: nothing to time them on) and keeps a default one, which its cost model prices at up to 30
#: times a tuned kernel, differently from one fusion to the next (a GEMM with a fused float32
#: epilogue, say). cuBLAS GEMMs it prices from their shapes, so XLA's estimates of two setups
#: compare their schedules rather than their untuned tilings.
GPU_FLAGS = "--xla_gpu_enable_triton_gemm=false"


def environment(target: str, *, scheduler_log: bool = True, xla_flags: str = "") -> dict[str, str]:
  """The environment variables a process compiling for ``target`` must start with.

  The compilers read them when they load, on the process's first use of a
  device: start a new process with them.

  Args:
    target: one of ``DEVICELESS_TARGETS`` (see ``deviceless_target``).
    scheduler_log: on GPU, make XLA log its latency-hiding scheduler's
      statistics (read them with ``capture_stderr`` and ``scheduler_estimate``).
    xla_flags: ``XLA_FLAGS`` to compile with, as on the accelerator's host. On
      GPU they come after ``--xla_gpu_enable_triton_gemm=false``: without a GPU
      to tune them on, Triton GEMMs keep a default tiling that XLA's cost model
      prices far from a tuned kernel's, so GEMMs compile as cuBLAS calls.

  Returns:
    Variables to add to the environment (``subprocess.run(env={**os.environ, **env})``).

  Raises:
    ValueError: for a target zerojax does not know.

  Example:
    >>> from zerojax.diagnostics import deviceless_environment
    >>> sorted(deviceless_environment("v5e-8"))
    ['ALLOW_MULTIPLE_LIBTPU_LOAD', 'JAX_PLATFORMS', 'TPU_SKIP_MDS_QUERY', 'XLA_FLAGS']
    >>> env = deviceless_environment("h100x8", xla_flags="--xla_dump_to=/tmp/hlo")
    >>> env["CUDA_VISIBLE_DEVICES"], env["XLA_FLAGS"]
    ('-1', '--xla_gpu_enable_triton_gemm=false --xla_dump_to=/tmp/hlo')
  """
  if find_target(target).platform == "cuda":
    env = {
      "JAX_PLATFORMS": "cuda,cpu",
      "CUDA_VISIBLE_DEVICES": "-1",  # there is no GPU to find
      "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1",  # it looks for CUDA libraries only running needs
    }
    if scheduler_log:
      env |= {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "latency_hiding_scheduler=1"}
    return env | {"XLA_FLAGS": f"{GPU_FLAGS} {xla_flags}".strip()}
  return {
    "JAX_PLATFORMS": "tpu,cpu",
    "TPU_SKIP_MDS_QUERY": "1",  # no cloud metadata server to ask
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",  # another process may hold libtpu (its lock is per host)
    "XLA_FLAGS": xla_flags,
  }


def _check_environment(target: DevicelessTarget) -> None:
  needed = environment(target.name, scheduler_log=False).items()
  missing = {k: v for k, v in needed if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
  wrong = sorted(k for k, v in missing.items() if os.environ.get(k) != v)
  if wrong:
    raise RuntimeError(
      f"compiling for {target.name} needs a process started with "
      f"zerojax.diagnostics.deviceless_environment({target.name!r}) in its environment "
      f"({', '.join(f'{k}={missing[k]}' for k in wrong)} missing): the compilers read it when "
      "they load, so start a new process with it."
    )


def mesh(
  target: str,
  shape: tuple[int, ...],
  axis_names: tuple[str, ...],
  axis_types: tuple[AxisType, ...] | None = None,
) -> Mesh:
  """A ``jax.sharding.Mesh`` over ``target``'s devices, to compile for (never to run on).

  Nothing can be placed on these devices: give ``jax.jit(...).lower`` abstract
  arguments, ``jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh,
  spec))``, and the abstract outputs of zerojax's placement with
  ``jax.eval_shape(tx.shard, ...)``.

  Args:
    target: one of ``DEVICELESS_TARGETS``: ``"h100x8"`` (8 x H100 SXM) to
      ``"h100x128"`` (16 such nodes), ``"v5e-8"`` (TPU v5e, 2 x 4) to
      ``"v5e-256"`` (16 x 16), ``"2xv5e-16"`` (two slices of 4 x 4), ...
    shape: the mesh's shape; its product must be the target's device count.
    axis_names: the mesh's axis names.
    axis_types: as for ``jax.sharding.Mesh`` (``Auto`` by default).

  Returns:
    The mesh.

  Raises:
    RuntimeError: in a process not started with ``deviceless_environment(target)``.

  Example:
    In a process started with ``deviceless_environment("h100x8")`` in its
    environment (``benchmarks/accelerators.py`` does this)::

      import jax, jax.numpy as jnp, optax, zerojax
      from jax.sharding import NamedSharding, PartitionSpec as P
      mesh = zerojax.diagnostics.deviceless_mesh("h100x8", (8,), ("data",))
      tx = zerojax.zero3(optax.adam(1e-3), mesh=mesh)
      full = {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)}
      shardings = tx.param_shardings(full)
      params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        jax.eval_shape(tx.shard, full), shardings)
      compiled = jax.jit(step).lower(params, ...).compile()
      compiled.memory_analysis().temp_size_in_bytes  # what an H100 would need
  """
  devices = find_target(target).devices()
  if math.prod(shape) != len(devices):
    raise ValueError(
      f"a mesh of shape {shape} needs {math.prod(shape)} devices; {target} has "
      f"{len(devices)}: pass a shape whose product is {len(devices)}."
    )
  return Mesh(np.array(devices).reshape(shape), axis_names, axis_types=axis_types)


@contextlib.contextmanager
def capture_stderr() -> Iterator[list[str]]:
  """Collects what the process writes to its standard error meanwhile, C++ logs included.

  XLA logs its scheduler's statistics from C++, straight to file descriptor
  2, where Python's ``sys.stderr`` redirection cannot see them; this
  redirects the descriptor itself.

  Yields:
    A list that holds the captured text once the block ends.

  Example:
    >>> import os
    >>> from zerojax.diagnostics import capture_stderr
    >>> with capture_stderr() as log:
    ...   _ = os.write(2, b"written by C++, say\\n")
    >>> log[0]
    'written by C++, say\\n'
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
