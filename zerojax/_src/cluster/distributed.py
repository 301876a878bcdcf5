"""Multi-process runs: joining the processes, building global batches, gathering to a host.

When the mesh spans several processes (hosts), every process runs the same
program on its own devices. Three things differ from one process: the
processes must find each other before JAX touches a device (``initialize``);
each process loads only its share of the batch, which becomes one global array
(``global_batch``); and a full copy of the parameters should land only where it
is needed (``gather_to_host``).
"""

from __future__ import annotations

import functools
import os
import socket
import sys
import threading
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._src.core import checks
from zerojax._src.core.transformation import ZeroTransformation
from zerojax._src.sharding import layout as layout_lib
from zerojax._src.sharding import mesh as mesh_lib
from zerojax_launch.job import (
  COORDINATOR_ADDRESS,
  HEARTBEAT_TIMEOUT,
  NUM_PROCESSES,
  PEER_LOST_EXIT_CODE,
  PROCESS_ID,
)

#: Optional: the ``initialization_timeout`` (seconds) for ``initialize`` calls that do not pass one.
INITIALIZATION_TIMEOUT = "ZEROJAX_INITIALIZATION_TIMEOUT"

#: Seconds a process waits for all others to join before failing.
DEFAULT_INITIALIZATION_TIMEOUT = 300
#: The exit status of a process whose peers did not all join within ``initialization_timeout``.
NOT_JOINED_EXIT_CODE = 3
#: Seconds of waiting to join after which a process says what it waits for.
_SAY_WAITING_AFTER = 10
#: Seconds without a heartbeat after which a process counts as dead and every
#: other process is terminated by the JAX distributed service.
DEFAULT_HEARTBEAT_TIMEOUT = 60
#: Seconds a CPU (gloo) collective waits for a live but silent peer before failing.
DEFAULT_COLLECTIVE_TIMEOUT = 600
#: Seconds a finishing process waits at exit for the others to finish too.
DEFAULT_SHUTDOWN_TIMEOUT = 60

_COLLECTIVE_TIMEOUT_FLAG = "--xla_cpu_collective_timeout_seconds"


def initialize(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  *,
  detect_cluster: bool = False,
  local_device_count: int | None = None,
  initialization_timeout: int | None = None,
  heartbeat_timeout: int | None = None,
  collective_timeout: int = DEFAULT_COLLECTIVE_TIMEOUT,
  shutdown_timeout: int = DEFAULT_SHUTDOWN_TIMEOUT,
) -> bool:
  """Joins this process to a multi-process JAX job, or does nothing in a single-process run.

  Call it first, before anything touches a device. Arguments left ``None``
  are read from ``ZEROJAX_COORDINATOR_ADDRESS``, ``ZEROJAX_NUM_PROCESSES`` and
  ``ZEROJAX_PROCESS_ID`` (which ``python -m zerojax_launch`` sets). If none of
  the three is given anywhere, the run is a single process and nothing
  happens, unless ``detect_cluster`` asks ``jax.distributed.initialize`` to find
  them in the environment that SLURM (``srun``), Open MPI or a Cloud TPU pod
  slice sets up.

  Every wait is bounded: joining fails after ``initialization_timeout``
  (a process still waiting after 10 s says on stderr for what and how long; at
  the timeout it names the process that did not join and exits with status
  ``NOT_JOINED_EXIT_CODE``, 3, since JAX's own timeout aborts the process
  from C++); a process that dies or stops (SIGSTOP, a frozen host) is noticed after
  ``heartbeat_timeout`` and the JAX distributed service then terminates every
  other process (instead of leaving them in a collective); a CPU collective
  whose peer is alive but silent fails after ``collective_timeout``
  (``--xla_cpu_collective_timeout_seconds``; GPU and TPU collectives have their
  own). CPU collectives use gloo over TCP.

  A process that dies of an uncaught exception prints its traceback and exits
  with status 1 at once: neither JAX's exit-time barrier (up to
  ``shutdown_timeout``) nor a checkpoint save in flight, which would wait for
  the others while they wait for it in a collective, holds it. A launcher
  (``python -m zerojax_launch``, ``srun --kill-on-bad-exit``) then sees the
  failure right away. One whose collective failed because another process
  went away says so in one line instead of its traceback.

  Args:
    coordinator_address: ``host:port`` of process 0, where the coordination
      service listens (any free port, the same for every process).
    num_processes: how many processes the job has.
    process_id: this process's index, ``0 <= process_id < num_processes``.
    detect_cluster: with none of the three given, let
      ``jax.distributed.initialize`` detect them (SLURM, Open MPI, Cloud TPU).
    local_device_count: CPU only: how many devices this process fakes (as
      ``--xla_force_host_platform_device_count`` does).
    initialization_timeout: seconds to wait for every process to join;
      ``None`` reads ``ZEROJAX_INITIALIZATION_TIMEOUT``, or takes
      ``DEFAULT_INITIALIZATION_TIMEOUT`` (300).
    heartbeat_timeout: seconds of silence after which a process counts as dead;
      ``None`` reads ``ZEROJAX_HEARTBEAT_TIMEOUT``, or takes
      ``DEFAULT_HEARTBEAT_TIMEOUT``.
    collective_timeout: seconds a CPU collective waits for its peers. Applied
      through ``XLA_FLAGS`` unless that already sets it.
    shutdown_timeout: seconds a process waits at exit for the others.

  Returns:
    Whether this is a multi-process run (``jax.distributed`` was initialized).

  Raises:
    ValueError: if some but not all of the three are given (and
      ``detect_cluster`` is off), or they (or ``ZEROJAX_HEARTBEAT_TIMEOUT``)
      are not valid numbers.

  Example:
    >>> import os
    >>> [os.environ.get(name) for name in (COORDINATOR_ADDRESS, NUM_PROCESSES, PROCESS_ID)]
    [None, None, None]
    >>> initialize()  # a single process: nothing to join
    False
  """
  given = {
    "coordinator_address": _from_env(coordinator_address, COORDINATOR_ADDRESS, str),
    "num_processes": _from_env(num_processes, NUM_PROCESSES, int),
    "process_id": _from_env(process_id, PROCESS_ID, int),
  }
  missing = [name for name, value in given.items() if value is None]
  if len(missing) == len(given) and not detect_cluster:
    return False
  if missing and not detect_cluster:
    raise ValueError(
      f"a multi-process run needs {', '.join(given)}, but {', '.join(missing)} "
      f"{'is' if len(missing) == 1 else 'are'} not given: pass "
      f"{', '.join(f'{name}=...' for name in missing)} to initialize (or set "
      f"{', '.join(_ENV_NAMES[name] for name in missing)}), or pass detect_cluster=True "
      "under SLURM, Open MPI or on a Cloud TPU pod slice."
    )
  heartbeat_timeout = _from_env(heartbeat_timeout, HEARTBEAT_TIMEOUT, int)
  if heartbeat_timeout is None:
    heartbeat_timeout = DEFAULT_HEARTBEAT_TIMEOUT
  initialization_timeout = _from_env(initialization_timeout, INITIALIZATION_TIMEOUT, int)
  if initialization_timeout is None:
    initialization_timeout = DEFAULT_INITIALIZATION_TIMEOUT
  if local_device_count is not None:
    jax.config.update("jax_num_cpu_devices", local_device_count)
  # Explicit, so that a multi-process CPU run never falls back to no collectives.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  xla_flags = os.environ.get("XLA_FLAGS", "")
  if _COLLECTIVE_TIMEOUT_FLAG not in xla_flags:
    # Read when the backend starts, which is after this.
    os.environ["XLA_FLAGS"] = f"{xla_flags} {_COLLECTIVE_TIMEOUT_FLAG}={collective_timeout}".strip()
  with _Joining(given, initialization_timeout):
    jax.distributed.initialize(
      **given,
      # Past ours: JAX's own timeout aborts the process without saying who is missing.
      initialization_timeout=2 * initialization_timeout + 60,
      heartbeat_timeout_seconds=heartbeat_timeout,
      shutdown_timeout_seconds=shutdown_timeout,
    )
  _exit_at_once_on_uncaught_exceptions()
  return True


class _Joining:
  """While inside, a process that waits to join says so after a while, and at the timeout names
  what is missing on stderr and exits with ``NOT_JOINED_EXIT_CODE``.

  A thread does it: the main thread is inside JAX's C++ client, which Python cannot interrupt.
  """

  def __init__(self, given: dict[str, Any], timeout: int):
    self.address = given["coordinator_address"]
    self.count, self.index = given["num_processes"], given["process_id"]
    self.timeout = timeout
    self._timers = [
      threading.Timer(min(_SAY_WAITING_AFTER, timeout / 2), self._say_waiting),
      threading.Timer(timeout, self._give_up),
    ]

  def __enter__(self) -> None:
    for timer in self._timers:
      timer.daemon = True
      timer.start()

  def __exit__(self, *exc_info: Any) -> None:
    for timer in self._timers:
      timer.cancel()

  def _say_waiting(self) -> None:
    _say(
      f"process {self.index} of {self.count} is waiting for the others to join at "
      f"{self.address} (up to initialization_timeout={self.timeout} s)."
    )

  def _give_up(self) -> None:
    _say(
      f"process {self.index} of {self.count} waited initialization_timeout={self.timeout} s at "
      f"{self.address}, and {self.missing()} Start every process with the same coordinator "
      "address and process count, each with its own process id (python -m zerojax_launch, "
      "srun, or ZEROJAX_COORDINATOR_ADDRESS / ZEROJAX_NUM_PROCESSES / ZEROJAX_PROCESS_ID), "
      f"or raise initialization_timeout (ZEROJAX_INITIALIZATION_TIMEOUT). Exiting with status "
      f"{NOT_JOINED_EXIT_CODE}."
    )
    os._exit(NOT_JOINED_EXIT_CODE)

  def missing(self) -> str:
    """Which process did not join, as far as this one can tell, in words."""
    others = [p for p in range(self.count) if p != self.index]
    if self.index != 0 and not _listening(self.address):
      return f"process 0, the coordinator, never started there (nothing listens at {self.address})."
    if len(others) == 1:
      return f"process {others[0]} never joined."
    return f"not all of processes {', '.join(map(str, others))} joined."


def _listening(address: str) -> bool:
  """Whether something accepts TCP connections at ``host:port``."""
  host, _, port = address.rpartition(":")
  try:
    with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
      return True
  except (OSError, ValueError):
    return False


def _say(message: str) -> None:
  print(f"zerojax.distributed.initialize: {message}", file=sys.stderr, flush=True)


def _exit_at_once_on_uncaught_exceptions() -> None:
  """Makes a process that dies of an uncaught exception exit at once, with status 1.

  Python's own exit would wait first for threads that wait for the other
  processes, which wait for this one in a collective: Orbax's background
  checkpoint commit (which then fails, ``cannot schedule new futures after
  shutdown``, and prints two long tracebacks), and JAX's exit-time barrier
  with the distributed service (up to the shutdown timeout). A crash would
  then take that long, or forever, to become an exit status. A save that was
  in flight is abandoned, as in any crash: it was not committed, and the
  checkpoints before it are whole.

  A process whose collective failed because another process went away says
  so in one line instead of its traceback, which only repeats that, and exits
  with ``PEER_LOST_EXIT_CODE`` (76): the process that failed first prints the
  cause, and ``zerojax.launch`` reports that one.
  """
  previous = sys.excepthook

  def excepthook(kind, error, traceback):
    status = 1
    if any(sign in str(error) for sign in _PEER_LOST):
      first = str(error).strip().splitlines()[0]
      print(
        f"zerojax: process {jax.process_index()} stopped: a collective lost another process "
        f"({kind.__name__}: {first}); the process that failed first says why.",
        file=sys.stderr,
      )
      status = PEER_LOST_EXIT_CODE
    else:
      previous(kind, error, traceback)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)

  sys.excepthook = excepthook


#: What gloo's errors say when the process at the other end of a collective went away.
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


_ENV_NAMES = {
  "coordinator_address": COORDINATOR_ADDRESS,
  "num_processes": NUM_PROCESSES,
  "process_id": PROCESS_ID,
}


def _from_env(value: Any, name: str, kind: type) -> Any:
  if value is not None or name not in os.environ:
    return value
  try:
    return kind(os.environ[name])
  except ValueError:
    raise ValueError(
      f"environment variable {name}={os.environ[name]!r} is not a valid {kind.__name__}; "
      "unset it or fix it."
    ) from None


def global_batch(
  local_batch: Any,
  mesh: Mesh,
  *,
  axis_name: str | tuple[str, ...] = "data",
  check_processes: bool = True,
) -> Any:
  """Turns each process's share of a batch into global arrays split over ``axis_name``.

  Every process calls it with its own rows; the global batch is the
  processes' rows in the order of their devices along ``axis_name`` (process
  order, for a mesh from ``jax.make_mesh``). Pass the result to
  ``zerojax.value_and_grad`` or a drop-in step as the batch. With one process
  it places the batch like ``jax.device_put(batch, NamedSharding(mesh,
  P(axis_name)))``. Under hybrid sharding the batch is split over the replica
  and the data axes: pass ``axis_name=tx.batch_axes``.

  Args:
    local_batch: a pytree of host arrays (numpy, or anything ``np.asarray``
      takes), each with a leading batch dimension that divides by the number
      of this process's devices along ``axis_name``.
    mesh: the mesh, spanning every process.
    axis_name: the mesh axis the batch is split over, or a tuple of axes
      (major first).
    check_processes: first check (one tiny all-gather between processes, which
      waits for the devices) that every process passes the same structure,
      shapes and dtypes, and raise otherwise, instead of building arrays that
      disagree across processes. Turn it off once the input pipeline is known
      to be right, to keep host and devices running ahead of each other.

  Returns:
    The pytree of global ``jax.Array`` s, each leaf's leading dimension
    ``num_processes`` times the local one.

  Raises:
    ValueError: if a leaf has no leading dimension, or it does not divide by the
      process's devices along ``axis_name``, or the processes disagree.

  Example:
    >>> import jax, numpy as np
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> x = global_batch({"tokens": np.zeros((16, 4), np.int32)}, mesh)["tokens"]
    >>> x.shape, x.sharding.spec
    ((16, 4), P('data',))
  """
  if check_processes:
    checks.same_on_every_process(
      local_batch, "local batches", "Every process must pass its equal share of the global batch."
    )
  shards = _local_shard_count(mesh, axis_name)
  for path, x in jax.tree_util.tree_flatten_with_path(local_batch)[0]:
    shape = np.shape(x)
    if not shape or shape[0] % shards:
      raise ValueError(
        f"local batch leaf {jax.tree_util.keystr(path) or '(root)'} has shape {shape}: its "
        f"leading dimension must divide by the {shards} devices this process has along mesh "
        f"axes {axis_name!r}. Give each process a multiple of {shards} rows (the global batch "
        "is every process's rows together)."
      )
  sharding = NamedSharding(mesh, P(axis_name))
  return jax.tree.map(
    lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), local_batch
  )


def _local_shard_count(mesh: Mesh, axis_name: str | tuple[str, ...]) -> int:
  """How many positions along the ``axis_name`` axes this process's devices occupy."""
  mesh_lib.resolve_mesh(mesh, axis_name)
  axes = [mesh.axis_names.index(name) for name in layout_lib.axes(axis_name)]
  here = jax.process_index()
  positions = {
    tuple(index[a] for a in axes)
    for index, device in np.ndenumerate(mesh.devices)
    if device.process_index == here
  }
  if not positions:
    raise ValueError(
      f"process {here} has no device in this mesh: build the mesh from every process's "
      "devices, e.g. jax.make_mesh((jax.device_count(),), ('data',))."
    )
  return len(positions)


#: Leaves bigger than this are gathered a block of leading rows at a time.
DEFAULT_MAX_PIECE_BYTES = 64 * 2**20


def gather_to_host(
  tx: ZeroTransformation,
  params: optax.Params,
  *,
  process: int | None = 0,
  max_piece_bytes: int = DEFAULT_MAX_PIECE_BYTES,
) -> Any:
  """Full, unpadded parameters as numpy arrays on one process (or every process).

  For export and evaluation on a host. Unlike ``np.asarray(tx.gather(params))``,
  nothing is ever whole on a process that does not receive it, and nothing is
  ever whole at once on the devices: the parameters are gathered leaf by leaf,
  and a leaf bigger than ``max_piece_bytes`` a block of leading rows at a time
  (a layer at a time for stacked layers), each block all-gathered on the
  devices and copied to the receiving hosts' memory only. Every process must
  call it (the all-gathers are collectives).

  Args:
    tx: the ``ZeroTransformation`` that stores ``params``.
    params: the parameters as ``tx`` stores them.
    process: the process that receives the parameters; ``None`` for every
      process.
    max_piece_bytes: the most one all-gather moves into each device. Leaves
      sharded along their first dimension (1-D leaves, or a ``layout`` that
      splits dimension 0) are gathered whole: a block of rows of the
      dimension that is split would cost the whole leaf's all-gather anyway.

  Returns:
    On a receiving process, the pytree of ``numpy.ndarray`` s (logical shapes,
    stored dtypes); on the others, ``None``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, zerojax
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = zerojax.zero3(optax.sgd(0.1), mesh=mesh)
    >>> params = tx.shard({"w": jnp.ones((2, 13, 50))})
    >>> params["w"].shape, gather_to_host(tx, params)["w"].shape
    ((2, 13, 56), (2, 13, 50))
  """
  count = jax.process_count()
  if process is not None and not 0 <= process < count:
    raise ValueError(
      f"process must be None (every process) or a process index in [0, {count}), got {process!r}."
    )
  receives = process is None or process == jax.process_index()
  layout = tx.layout(params)
  with mesh_lib.set_mesh_unless_traced(tx.mesh, params):
    gathered = layout.map(
      lambda leaf, x: _gather_leaf(tx.mesh, leaf, x, receives, max_piece_bytes), params
    )
  return gathered if receives else None


def _gather_leaf(
  mesh: Mesh, leaf: layout_lib.LeafLayout, x: jax.Array, receives: bool, max_piece_bytes: int
) -> np.ndarray | None:
  padded = tuple(x.shape) != leaf.shape
  rows = None
  if x.ndim >= 2 and x.nbytes > max_piece_bytes and leaf.dim != -x.ndim:
    row_bytes = x.nbytes // x.shape[0]
    rows = max(1, max_piece_bytes // row_bytes)
  if rows is None or rows >= x.shape[0]:
    whole = _replicated_rows(x, 0, mesh=mesh, leaf=leaf, padded=padded, rows=None)
    return np.asarray(whole.addressable_data(0)) if receives else None
  blocks = []
  for start in range(0, x.shape[0], rows):
    # dynamic_slice clamps the last block's start, so every block has one shape
    # (one compilation); the overlap is dropped here.
    block = _replicated_rows(x, start, mesh=mesh, leaf=leaf, padded=padded, rows=rows)
    if receives:
      clamped = min(start, x.shape[0] - rows)
      blocks.append(np.asarray(block.addressable_data(0))[start - clamped :])
  return np.concatenate(blocks) if receives else None


@functools.partial(jax.jit, static_argnames=("mesh", "leaf", "padded", "rows"))
def _replicated_rows(x, start, *, mesh, leaf, padded, rows):
  """Rows ``[start, start + rows)`` of ``x`` (all if ``rows`` is None), unpadded, replicated."""

  def block(x):
    x = leaf.unpad(x) if padded else x
    return x if rows is None else jax.lax.dynamic_slice_in_dim(x, start, rows, axis=0)

  # An offloaded master copy (tx.master_params) is read in device memory.
  return mesh_lib.global_view(mesh, block, P())(jax.device_put(x, jax.memory.Space.Device))
