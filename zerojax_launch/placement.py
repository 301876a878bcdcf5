"""Which devices each process ``zerojax.launch`` starts computes on: CPUs, a GPU, or a TPU host.

The launcher never starts JAX itself, so it finds the host's accelerators the
way their drivers show them: ``/dev/nvidia<N>`` for NVIDIA GPUs,
``/dev/accel<N>`` or ``/dev/vfio/<N>`` for TPU chips. On a host with GPUs each
process gets one (``CUDA_VISIBLE_DEVICES``); on a TPU host one process drives
every chip; elsewhere the processes run on the CPU (``JAX_PLATFORMS=cpu``),
each faking ``devices_per_process`` devices, with gloo collectives between
them.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

#: The platforms a launched job can run on.
PLATFORMS = ("cpu", "gpu", "tpu")
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


@dataclasses.dataclass(frozen=True)
class Placement:
  """What each process of a launched job computes on.

  Attributes:
    platform: ``"cpu"``, ``"gpu"`` or ``"tpu"``.
    devices_per_process: CPU devices each process fakes (``"cpu"`` only;
      ``None`` keeps the inherited ``XLA_FLAGS``).
    gpus: the GPU each process takes, by process id (``"gpu"`` only).

  Example:
    >>> from zerojax_launch.placement import Placement
    >>> Placement("gpu", gpus=("0", "1")).env(1, {})
    {'CUDA_VISIBLE_DEVICES': '1'}
    >>> Placement("cpu", devices_per_process=4).env(0, {"XLA_FLAGS": "--a"})
    {'JAX_PLATFORMS': 'cpu', 'XLA_FLAGS': '--a --xla_force_host_platform_device_count=4'}
  """

  platform: str
  devices_per_process: int | None = None
  gpus: tuple[str, ...] = ()

  def env(self, process_id: int, base: Mapping[str, str]) -> dict[str, str]:
    """The variables process ``process_id`` gets on top of ``base`` (the launcher's)."""
    if self.platform == "gpu":
      return {"CUDA_VISIBLE_DEVICES": self.gpus[process_id]}
    if self.platform == "tpu":
      return {}
    env = {"JAX_PLATFORMS": "cpu"}
    if self.devices_per_process is not None:
      # Replace, not append to, a device count inherited from the launcher (a test
      # process forcing 8 devices must not give each child 8).
      flags = [f for f in base.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT_FLAG)]
      env["XLA_FLAGS"] = " ".join([*flags, f"{_DEVICE_COUNT_FLAG}={self.devices_per_process}"])
    return env


def local_accelerators(dev: Path = Path("/dev")) -> tuple[str, int]:
  """``("gpu", count)``, ``("tpu", count)`` or ``("cpu", 0)``: what this host's drivers show.

  Example:
    >>> import pathlib, tempfile
    >>> from zerojax_launch.placement import local_accelerators
    >>> dev = pathlib.Path(tempfile.mkdtemp())
    >>> local_accelerators(dev)
    ('cpu', 0)
    >>> for name in ("nvidia0", "nvidia1", "nvidiactl"):
    ...   (dev / name).touch()
    >>> local_accelerators(dev)
    ('gpu', 2)
  """
  gpus = _numbered(dev, "nvidia")
  if gpus:
    return "gpu", gpus
  chips = _numbered(dev, "accel") or _numbered(dev / "vfio", "")
  return ("tpu", chips) if chips else ("cpu", 0)


def _numbered(directory: Path, prefix: str) -> int:
  pattern = re.compile(rf"{prefix}\d+")
  try:
    return sum(bool(pattern.fullmatch(entry.name)) for entry in directory.iterdir())
  except OSError:
    return 0


def place(
  num_processes: int,
  devices_per_process: int | None,
  platform: str | None = None,
  environ: Mapping[str, str] = os.environ,
  accelerators: tuple[str, int] | None = None,
) -> Placement:
  """Where ``num_processes`` launched processes compute.

  Args:
    num_processes: how many processes the launcher starts.
    devices_per_process: CPU devices each fakes; giving it means the CPU.
    platform: ``"cpu"``, ``"gpu"`` or ``"tpu"``; ``None`` picks the host's
      accelerators (``local_accelerators``), else the CPU.
    environ: the launcher's environment (its ``CUDA_VISIBLE_DEVICES`` limits
      the GPUs handed out).
    accelerators: what ``local_accelerators`` would say (for tests).

  Returns:
    The ``Placement``.

  Raises:
    ValueError: for an unknown platform, more processes than GPUs, more than
      one process on a TPU host, or CPU devices asked of an accelerator.

  Example:
    >>> from zerojax_launch.placement import place
    >>> place(2, None, accelerators=("gpu", 8))
    Placement(platform='gpu', devices_per_process=None, gpus=('0', '1'))
    >>> place(2, 4, accelerators=("gpu", 8)).platform  # CPU devices asked for: the CPU
    'cpu'
  """
  if platform is not None and platform not in PLATFORMS:
    raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}.")
  found, count = accelerators or local_accelerators()
  if platform is None:
    platform = "cpu" if devices_per_process is not None else found
  if platform != "cpu" and devices_per_process is not None:
    raise ValueError(
      f"devices_per_process fakes CPU devices; on {platform} each process uses the host's "
      "accelerators: drop it, or pass platform='cpu'."
    )
  if platform == "cpu":
    return Placement("cpu", devices_per_process)
  if platform != found:
    raise ValueError(
      f"platform {platform!r} asked for, but this host shows {found} devices"
      f"{f' ({count})' if count else ''}: pass platform={found!r} or leave it out."
    )
  if platform == "tpu":
    if num_processes != 1:
      raise ValueError(
        f"a TPU host runs one process, which drives all {count} of its chips; got "
        f"num_processes={num_processes}. On a pod slice, start one process per host "
        "(gcloud compute tpus tpu-vm ssh --worker=all, or GKE)."
      )
    return Placement("tpu")
  gpus = _visible_gpus(environ, count)
  if num_processes > len(gpus):
    raise ValueError(
      f"{num_processes} processes, one GPU each, but this host has {len(gpus)} "
      f"({', '.join(gpus)}): start at most {len(gpus)}."
    )
  return Placement("gpu", gpus=tuple(gpus[:num_processes]))


def _visible_gpus(environ: Mapping[str, str], count: int) -> Sequence[str]:
  visible = environ.get("CUDA_VISIBLE_DEVICES")
  if visible is None:
    return [str(i) for i in range(count)]
  return [gpu for gpu in visible.split(",") if gpu and gpu != "-1"]
