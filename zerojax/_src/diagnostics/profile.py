"""Profile a training step: per-device memory and communication of its compiled program."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from zerojax._src.diagnostics.hlo import Collective, count_collectives

_MIB = 2**20


@dataclasses.dataclass(frozen=True)
class StepProfile:
  """What one compiled step costs each device.

  Attributes:
    argument_bytes: inputs (parameters, optimizer state, batch shard).
    output_bytes: outputs.
    alias_bytes: outputs that reuse donated inputs' buffers.
    temp_bytes: temporaries: activations, gathered weights, gradients in flight.
    peak_bytes: an upper bound on the step's peak in device memory,
      ``argument + output - alias + temp`` (every buffer live at once; host
      memory is not in it). Backends' own ``peak_memory_in_bytes`` is not
      used: the CPU backend reports less than its temporaries.
    collectives: per kind, executions and bytes per step (see
      ``zerojax.diagnostics.count_collectives``).
    host_argument_bytes: inputs in host memory (``offload=`` 's optimizer
      state, between steps).
    host_output_bytes: outputs in host memory.
    host_alias_bytes: host outputs that reuse donated host inputs' buffers.
    host_temp_bytes: temporaries in host memory: the activations a
      checkpoint policy offloads (``save_and_offload_only_these_names``),
      held from the forward pass to the backward pass.
    host_peak_bytes: the same bound for the host memory the device uses,
      ``host_argument + host_output - host_alias + host_temp``.

  The host fields are the compiler's ``memory_analysis()`` 's ``host_*``
  sizes. XLA:TPU and XLA:GPU report them (an offloaded activation is a
  buffer in memory space 5, ``S(5)`` in the compiled text); XLA:CPU, whose
  host memory is its device memory, reports 0, so compile for an accelerator
  (``zerojax.diagnostics.deviceless_mesh``) to see them.

  Example:
    >>> import jax.numpy as jnp, zerojax
    >>> report = zerojax.diagnostics.profile(lambda x: x @ x, jnp.ones((256, 256)))
    >>> report.argument_bytes, report.output_bytes
    (262144, 262144)
  """

  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  peak_bytes: int
  collectives: dict[str, Collective]
  host_argument_bytes: int = 0
  host_output_bytes: int = 0
  host_alias_bytes: int = 0
  host_temp_bytes: int = 0
  host_peak_bytes: int = 0

  def __str__(self) -> str:
    lines = ["memory per device (MiB)"]
    for name in ("argument", "output", "alias", "temp", "peak"):
      lines.append(f"  {name:<9}{getattr(self, name + '_bytes') / _MIB:>12.3f}")
    if self.host_peak_bytes:  # only where the compiler places something in host memory
      lines.append("host memory per device (MiB)")
      for name in ("argument", "output", "alias", "temp", "peak"):
        lines.append(f"  {name:<9}{getattr(self, 'host_' + name + '_bytes') / _MIB:>12.3f}")
    lines.append("collectives per step      count     MiB")
    for kind, stats in self.collectives.items():
      lines.append(f"  {kind:<20}{stats.count:>8}{stats.bytes / _MIB:>10.3f}")
    return "\n".join(lines)


def profile(step: Callable[..., Any], *args: Any, **kwargs: Any) -> StepProfile:
  """Compiles ``step`` for these arguments and reports its memory and communication.

  Nothing runs: the step is lowered and compiled (arrays or
  ``jax.ShapeDtypeStruct`` s both work), and the numbers come from
  ``compile().memory_analysis()`` and the compiled HLO, where collectives
  inside a ``jax.lax.scan`` count once per iteration.

  Args:
    step: a function, jitted or not (donation and shardings of a ``jax.jit``
      are kept).
    *args: its arguments.
    **kwargs: its keyword arguments.

  Returns:
    A ``StepProfile``; ``print`` it for a table.

  Example:
    >>> import jax, jax.numpy as jnp, zerojax
    >>> report = zerojax.diagnostics.profile(lambda x: jnp.sin(x) * 2, jnp.ones((256, 256)))
    >>> report.argument_bytes, report.collectives["all-gather"].count
    (262144, 0)
  """
  jitted: Any = step if hasattr(step, "lower") else jax.jit(step)
  compiled = jitted.lower(*args, **kwargs).compile()
  memory = compiled.memory_analysis()
  if memory is None:
    raise ValueError(
      f"the {compiled.runtime_executable().client.platform} backend reports no memory analysis "
      "for this step, so it cannot be profiled: profile it on CPU, GPU or TPU."
    )
  peak = (
    memory.argument_size_in_bytes
    + memory.output_size_in_bytes
    - memory.alias_size_in_bytes
    + memory.temp_size_in_bytes
  )
  host = {
    name: getattr(memory, f"host_{name}_size_in_bytes", 0) or 0
    for name in ("argument", "output", "alias", "temp")
  }
  return StepProfile(
    argument_bytes=memory.argument_size_in_bytes,
    output_bytes=memory.output_size_in_bytes,
    alias_bytes=memory.alias_size_in_bytes,
    temp_bytes=memory.temp_size_in_bytes,
    peak_bytes=peak,
    collectives=count_collectives(compiled),
    host_argument_bytes=host["argument"],
    host_output_bytes=host["output"],
    host_alias_bytes=host["alias"],
    host_temp_bytes=host["temp"],
    host_peak_bytes=host["argument"] + host["output"] - host["alias"] + host["temp"],
  )
