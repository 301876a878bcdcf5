"""One candidate compiled: does it fit, what does it hold and move, how long might it take.

``compile_setup`` builds a ``Setup`` 's step for a program on a machine's
mesh, compiles it (for a deviceless target, in a process started with its
environment) and reads the compiled program: the compiler's own refusal or
the memory per device against the device's, the bytes its collectives move
within and across nodes, and an estimated step time: XLA:GPU's scheduler's
on GPUs, a roofline from the compiled program and the chip's published peaks
on TPUs (XLA:TPU prints no estimate).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from zerojax._src.diagnostics import deviceless, gpu_log, hlo, roofline
from zerojax._src.diagnostics.process import LOCAL
from zerojax._src.plan import program as program_lib
from zerojax._src.plan.setup import Setup

#: What the compilers say when a program does not fit the device.
_REFUSALS = ("RESOURCE_EXHAUSTED", "Ran out of memory", "exceeds the memory", "out of memory")


@dataclasses.dataclass(frozen=True)
class Outcome:
  """What compiling one ``Setup`` for a machine showed.

  Attributes:
    setup: the candidate.
    fits: whether the step fits a device: compiled, and its peak memory
      within the device's.
    error: the compiler's refusal, or why the setup could not be built.
    memory: bytes per device by kind: ``arguments`` (parameters, optimizer
      state, batch), ``outputs``, ``aliased`` (outputs in donated inputs),
      ``temporaries``, ``peak`` (their sum less ``aliased``), ``host``
      (host memory the step uses), ``device`` (the device's capacity);
      ``None`` if it did not compile.
    within_bytes: bytes a device sends over the links inside its node per step.
    across_bytes: bytes a device sends across nodes (GPU hosts, TPU slices).
    step_seconds: the estimated step time, or ``None``.
    estimate: where ``step_seconds`` comes from.
    examples: the global batch, in examples.
    tokens_per_second: ``examples`` times the program's tokens an example,
      over ``step_seconds``.
    mfu: model FLOPs utilisation at ``step_seconds``: ``6 x parameters x
      tokens`` over the step time and the devices' peak bf16 FLOP/s.
    compile_seconds: how long compiling took here.

  Example:
    >>> from zerojax.planning import Outcome, Setup
    >>> refused = Outcome(Setup(batch=64), fits=False, error="RESOURCE_EXHAUSTED: 17 GiB")
    >>> refused.out_of_memory, Outcome(Setup(), False, "ValueError: ...").out_of_memory
    (True, False)
  """

  setup: Setup
  fits: bool
  error: str | None = None
  memory: dict[str, int] | None = None
  within_bytes: float = 0.0
  across_bytes: float = 0.0
  step_seconds: float | None = None
  estimate: str = ""
  examples: int = 0
  tokens_per_second: float | None = None
  mfu: float | None = None
  compile_seconds: float = 0.0

  @property
  def out_of_memory(self) -> bool:
    """Whether the step needs more memory than a device has (the compiler refused it, or its
    peak is over the device's), rather than being refused for its options."""
    if self.error is not None:
      return any(refusal in self.error for refusal in _REFUSALS)
    return not self.fits

  def to_json(self) -> dict[str, Any]:
    """The outcome as a JSON object (``Outcome.from_json`` reads it back)."""
    return {**dataclasses.asdict(self), "setup": self.setup.to_json()}

  @classmethod
  def from_json(cls, data: dict[str, Any]) -> Outcome:
    """The outcome ``to_json`` wrote."""
    return cls(**{**data, "setup": Setup(**data["setup"])})


def mesh_shape(target: str, setup: Setup) -> tuple[tuple[int, ...], tuple[str, ...]]:
  """The shape and axis names of the mesh ``setup`` runs on: ``("stage", "data")`` for a
  pipeline, ``("node", "data")`` on a machine of several nodes (GPU hosts, TPU slices), else
  one ``"data"`` axis over every device. Devices are laid out in the target's order, node by
  node, so a pipeline's stages split the nodes between them."""
  devices, nodes = machine(target)
  if setup.pipeline > 1:
    return (setup.pipeline, devices // setup.pipeline), ("stage", "data")
  if nodes > 1:
    return (nodes, devices // nodes), ("node", "data")
  return (devices,), ("data",)


def machine(target: str) -> tuple[int, int]:
  """How many devices and nodes (GPU hosts, TPU slices; processes for ``"local"``) ``target``
  has, read without compiling for it."""
  if target == LOCAL:
    return jax.device_count(), jax.process_count()
  found = deviceless.find_target(target)
  return found.device_count, found.hosts


def _mesh(target: str, setup: Setup) -> Mesh:
  shape, names = mesh_shape(target, setup)
  devices = jax.devices() if target == LOCAL else deviceless.find_target(target).devices()
  grid = np.array(devices, dtype=object).reshape(shape)
  return Mesh(grid, names, axis_types=(AxisType.Explicit,) * len(shape))


def device_bytes(target: str) -> int:
  """A device's memory: the target's, or what this process's first device reports."""
  if target != LOCAL:
    return deviceless.find_target(target).hbm_bytes
  stats = jax.devices()[0].memory_stats() or {}
  return int(stats.get("bytes_limit", 0)) or 2**63


def compile_setup(program: program_lib.Program, setup: Setup, target: str) -> Outcome:
  """Compiles ``setup`` 's training step of ``program`` for ``target`` and reads it.

  Args:
    program: the model.
    setup: the candidate.
    target: one of ``zerojax.diagnostics.DEVICELESS_TARGETS`` (in a process
      started with ``deviceless_environment(target)``), or ``"local"`` for
      this process's devices.

  Returns:
    The ``Outcome``. A setup the compiler refuses, or that zerojax refuses
    to build (a ``ValueError``), is an outcome with ``fits=False`` and the
    refusal in ``error``.

  Example:
    In a process started with ``deviceless_environment("v5e-8")`` (``zerojax.plan``'s
    workers are)::

      from zerojax.planning import Setup, compile_setup
      outcome = compile_setup(program, Setup(remat="dots", batch=4), "v5e-8")
      outcome.fits, outcome.memory["peak"], outcome.step_seconds
  """
  start = time.perf_counter()
  try:
    mesh = _mesh(target, setup)
    tx = program_lib.optimizer(program, setup, mesh)
    step = program_lib.step_function(program, setup, tx)
    with jax.set_mesh(mesh):
      arguments = program_lib.abstract_arguments(program, setup, tx, mesh)
      lowered = jax.jit(step, donate_argnums=(0, 1)).lower(*arguments)
    with deviceless.capture_stderr() as log:
      compiled = lowered.compile()
  except Exception as error:  # the compiler's refusal is the verdict on fitting
    message = str(error).strip().splitlines()[0][:500] if str(error).strip() else repr(error)
    if not isinstance(error, ValueError) and not any(r in str(error) for r in _REFUSALS):
      raise
    return Outcome(setup, False, message, compile_seconds=time.perf_counter() - start)
  return _read(program, setup, target, mesh, compiled, log[0], time.perf_counter() - start)


def _read(program, setup, target, mesh, compiled, log: str, seconds: float) -> Outcome:
  analysis = compiled.memory_analysis()
  memory = {
    "arguments": analysis.argument_size_in_bytes,
    "outputs": analysis.output_size_in_bytes,
    "aliased": analysis.alias_size_in_bytes,
    "temporaries": analysis.temp_size_in_bytes,
    "host": getattr(analysis, "host_temp_size_in_bytes", 0)
    + getattr(analysis, "host_argument_size_in_bytes", 0),
    "device": device_bytes(target),
  }
  memory["peak"] = (
    memory["arguments"] + memory["outputs"] - memory["aliased"] + memory["temporaries"]
  )
  text = compiled.as_text()
  slices = 1 if target == LOCAL else deviceless.find_target(target).slices
  within, across = link_bytes(text, mesh, machine(target)[1], slices)
  examples = setup.batch * mesh.size // setup.pipeline
  seconds_estimate, source = _step_time(target, text, log, compiled, within, across)
  tokens = examples * program.tokens_per_example
  speed = tokens / seconds_estimate if seconds_estimate else None
  mfu = None
  if speed and target != LOCAL:
    peak = roofline.chip(target).bfloat16_flops * mesh.size
    mfu = 6 * program.parameters * speed / peak
  return Outcome(
    setup,
    fits=memory["peak"] <= memory["device"],
    error=None,
    memory=memory,
    within_bytes=within,
    across_bytes=across,
    step_seconds=seconds_estimate,
    estimate=source,
    examples=examples,
    tokens_per_second=speed,
    mfu=mfu,
    compile_seconds=seconds,
  )


def measure_setup(program: program_lib.Program, setup: Setup, steps: int = 3) -> float:
  """The median seconds of ``steps`` training steps of ``setup`` run on this process's devices.

  The parameters are ``program.init`` 's, the batch zeros; one untimed step
  compiles and warms up first.
  """
  mesh = _mesh(LOCAL, setup)
  tx = program_lib.optimizer(program, setup, mesh)
  step = jax.jit(program_lib.step_function(program, setup, tx), donate_argnums=(0, 1))
  with jax.set_mesh(mesh):
    _, _, batch = program_lib.abstract_arguments(program, setup, tx, mesh)
    shardings = jax.tree.map(lambda x: x.sharding, program_lib.placed_params(program, setup, mesh))
    init = lambda key: program_lib.restacked(program.init(key), setup)
    params = tx.shard(jax.jit(init, out_shardings=shardings)(jax.random.key(0)))
    opt_state = tx.init(params)
    arrays = jax.tree.map(lambda x: jax.numpy.zeros(x.shape, x.dtype, device=x.sharding), batch)
    times = []
    for _ in range(steps + 1):
      begin = time.perf_counter()
      params, opt_state, loss = step(params, opt_state, arrays)
      loss.block_until_ready()
      times.append(time.perf_counter() - begin)
  return float(np.median(times[1:]))


#: How many times its logical size (``zerojax.diagnostics.Collective.bytes``) a collective
#: sends from each device over its links, for rings of many devices: an all-reduce is a
#: reduce-scatter and an all-gather.
_SENT = {"all-reduce": 2.0}


def link_bytes(text: str, mesh: Mesh, nodes: int, slices: int = 1) -> tuple[float, float]:
  """Bytes a device sends per step inside its node and across nodes.

  A collective is across nodes if one of the mesh axes it spans crosses
  nodes: the mesh lays the target's devices out in order, ``len // nodes``
  a node (``mesh_shape``), so an axis crosses them where moving along it
  changes node. Compiled for several TPU slices, the program is one slice's:
  its collectives stay inside the slice, and what crosses slices is the
  data-center network's transfers (``count_across_slices``).
  """
  if slices > 1:
    within = sum(c.bytes * _SENT.get(kind, 1.0) for kind, c in hlo.count_collectives(text).items())
    return within, float(sum(hlo.count_across_slices(text, slices).values()))
  position = np.arange(mesh.size).reshape(tuple(mesh.shape.values()))
  node = position // (mesh.size // nodes)
  crossing = {name for k, name in enumerate(mesh.axis_names) if np.any(np.diff(node, axis=k) != 0)}
  within = across = 0.0
  for axes, kinds in hlo.count_collectives_by_axes(text, mesh).items():
    sent = sum(c.bytes * _SENT.get(kind, 1.0) for kind, c in kinds.items())
    if crossing.intersection(axes):
      across += sent
    else:
      within += sent
  return within, across


def _step_time(target, text, log, compiled, within, across) -> tuple[float | None, str]:
  if target == LOCAL:
    return None, ""
  if deviceless.find_target(target).platform == "cuda":
    estimate = gpu_log.scheduler_estimate(log, compiled)
    if not estimate.silent:
      # XLA:GPU's cost model counts in microseconds (docs/planning.md shows the check).
      return estimate.cycles * 1e-6, "XLA:GPU's scheduler"
    # Loops without collectives are not logged: price those from the roofline.
    rest = roofline.roofline(text, target, only=estimate.silent).step_seconds
    return estimate.cycles * 1e-6 + rest, "XLA:GPU's scheduler + roofline of silent loops"
  return roofline.roofline(text, target, within, across).step_seconds, "roofline"
