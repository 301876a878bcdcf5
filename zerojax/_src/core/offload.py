"""Host offload: which parts of a ``ZeroState`` live in host memory, and moving them.

``offload="optimizer"`` keeps the wrapped optimizer's state in the
``pinned_host`` memory kind between steps, split as it would be on the devices;
``"optimizer+master"`` keeps the master copy of the parameters there too. The
update brings them to device memory, computes there, and writes the results
back, inside the one jitted step (MaxText's ``optimizer_memory_host_offload``).
``init`` places a fresh state in host memory, ``tx.state_shardings`` names the
memory kind (so checkpoints restore into it), and the bookkeeping scalars (the
loss scale, which the gradient path reads every micro-batch; the skipped-step
count; the gradient norm) stay in device memory.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._src.core.state import ZeroState

#: The memory kind offloaded state lives in: page-locked host memory, which a
#: device reads and writes by DMA.
HOST = "pinned_host"

#: What ``offload=`` accepts.
MODES = (None, "optimizer", "optimizer+master")


@dataclasses.dataclass(frozen=True)
class Offload:
  """What a transformation keeps in host memory between steps.

  Attributes:
    mode: ``None``, ``"optimizer"`` or ``"optimizer+master"``, as given.

  Example:
    >>> from zerojax._src.core.offload import Offload
    >>> Offload("optimizer+master").fields
    ('inner_state', 'master')
  """

  mode: str | None = None

  @property
  def moves_master(self) -> bool:
    """Whether the master copy lives in host memory (stage 3 then keeps it apart)."""
    return self.mode == "optimizer+master"

  @property
  def fields(self) -> tuple[str, ...]:
    """The ``ZeroState`` fields kept in host memory."""
    return ("inner_state",) * (self.mode is not None) + ("master",) * self.moves_master

  def shardings(self, mesh: jax.sharding.Mesh, specs: ZeroState) -> ZeroState:
    """The ``NamedSharding`` of every leaf of a ``ZeroState`` whose leaves have ``specs``."""
    placed = lambda tree, kind: jax.tree.map(
      lambda spec: NamedSharding(mesh, spec, memory_kind=kind),
      tree,
      is_leaf=lambda x: isinstance(x, P),
    )
    shardings = placed(specs, None)
    return shardings._replace(**{name: placed(getattr(specs, name), HOST) for name in self.fields})

  def fetch(self, state: ZeroState) -> ZeroState:
    """Inside a jitted step: the offloaded fields of ``state`` copied to device memory."""
    return self._moved(state, jax.memory.Space.Device)

  def store(self, state: ZeroState) -> ZeroState:
    """Inside a jitted step: the offloaded fields of ``state`` placed in host memory."""
    return self._moved(state, jax.memory.Space.Host)

  def _moved(self, state: ZeroState, space: Any) -> ZeroState:
    moved = {name: jax.device_put(getattr(state, name), space) for name in self.fields}
    return state._replace(**moved)

  def host_bytes(self, state_bytes: float, master_bytes: float) -> float:
    """How many of ``state_bytes`` per parameter (``master_bytes`` of them the master copy) move.

    Example:
      >>> from zerojax._src.core.offload import Offload
      >>> Offload("optimizer").host_bytes(12, 4), Offload("optimizer+master").host_bytes(12, 4)
      (8, 12)
    """
    parts = {"inner_state": state_bytes - master_bytes, "master": master_bytes}
    return sum(parts[name] for name in self.fields)

  def check_master(self, has_master: bool) -> None:
    """Raises if ``"optimizer+master"`` finds no master copy apart from the parameters.

    Raises:
      ValueError: saying what to pass instead.
    """
    if self.moves_master and not has_master:
      raise ValueError(
        "offload='optimizer+master' moves the master copy that a mixed-precision policy "
        "keeps apart from the parameters, but under this policy the parameters compute in "
        "their own dtype, so they are the master copy and nothing is apart: pass "
        "offload='optimizer', or a policy with a lower compute dtype (precision='bf16')."
      )


def resolve(mode: Any, mesh: Any) -> Offload:
  """The ``Offload`` that ``offload=mode`` asks for, checked against ``mesh``'s devices.

  Raises:
    ValueError: for an unknown mode, or devices without ``pinned_host`` memory
      (naming their platform and the memory kinds they have).
  """
  if mode not in MODES:
    raise ValueError(
      f"offload must be one of {MODES}, got {mode!r}: 'optimizer' keeps the optimizer "
      "state in host memory, 'optimizer+master' the master copy of the parameters too."
    )
  if mode is not None and isinstance(mesh, jax.sharding.Mesh):
    device = _local_device(mesh)
    kinds = memory_kinds(device)
    if HOST not in kinds:
      raise ValueError(
        f"offload={mode!r} keeps state in {HOST!r} memory, which the {device.platform} "
        f"device {device.device_kind!r} does not have (its memory kinds: {kinds}). Pass "
        "offload=None on this platform; zerojax never falls back to device memory by itself."
      )
  return Offload(mode)


def memory_kinds(device: jax.Device) -> list[str]:  # pyright: ignore[reportInvalidTypeForm]
  """The memory kinds ``device`` offers, sorted."""
  return sorted(memory.kind for memory in device.addressable_memories())


def _local_device(mesh: jax.sharding.Mesh) -> jax.Device:  # pyright: ignore[reportInvalidTypeForm]
  """A device of ``mesh`` that this process can address (the first, in one process)."""
  devices = list(mesh.devices.flat)
  return next((d for d in devices if d.process_index == jax.process_index()), devices[0])
