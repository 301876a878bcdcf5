"""Multi-process runs: joining the processes, building global batches, gathering to a host.

When the mesh spans several processes (hosts), every process runs the same
program on its own devices. Three things differ from one process: the
processes must find each other before JAX touches a device (``initialize``);
each process loads only its share of the batch, which becomes one global array
(``global_batch``); and a full copy of the parameters should land only where it
is needed (``gather_to_host``).
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import zlib
from typing import Any

import jax
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._src import layout as layout_lib
from zerojax._src import mesh as mesh_lib
from zerojax._src.zero import ZeroTransformation

#: Environment variables that ``python -m zerojax.launch`` sets for each process.
COORDINATOR_ADDRESS = "ZEROJAX_COORDINATOR_ADDRESS"
NUM_PROCESSES = "ZEROJAX_NUM_PROCESSES"
PROCESS_ID = "ZEROJAX_PROCESS_ID"
#: Optional: the ``heartbeat_timeout`` (seconds) for ``initialize`` calls that do not pass one
#: (``python -m zerojax.launch --heartbeat-timeout`` sets it).
HEARTBEAT_TIMEOUT = "ZEROJAX_HEARTBEAT_TIMEOUT"

#: Seconds a process waits for all others to join before failing.
DEFAULT_INITIALIZATION_TIMEOUT = 300
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
  initialization_timeout: int = DEFAULT_INITIALIZATION_TIMEOUT,
  heartbeat_timeout: int | None = None,
  collective_timeout: int = DEFAULT_COLLECTIVE_TIMEOUT,
  shutdown_timeout: int = DEFAULT_SHUTDOWN_TIMEOUT,
) -> bool:
  """Joins this process to a multi-process JAX job, or does nothing in a single-process run.

  Call it first, before anything touches a device. Arguments left ``None``
  are read from ``ZEROJAX_COORDINATOR_ADDRESS``, ``ZEROJAX_NUM_PROCESSES`` and
  ``ZEROJAX_PROCESS_ID`` (which ``python -m zerojax.launch`` sets). If none of
  the three is given anywhere, the run is a single process and nothing
  happens, unless ``detect_cluster`` asks ``jax.distributed.initialize`` to find
  them in the environment that SLURM (``srun``), Open MPI or a Cloud TPU pod
  slice sets up.

  Every wait is bounded: joining fails after ``initialization_timeout``; a
  process that dies or stops (SIGSTOP, a frozen host) is noticed after
  ``heartbeat_timeout`` and the JAX distributed service then terminates every
  other process (instead of leaving them in a collective); a CPU collective
  whose peer is alive but silent fails after ``collective_timeout``
  (``--xla_cpu_collective_timeout_seconds``; GPU and TPU collectives have their
  own). CPU collectives use gloo over TCP.

  A process that dies of an uncaught exception exits at once: JAX's exit-time
  barrier, where it would otherwise wait up to ``shutdown_timeout`` for the
  others (which wait for it in a collective), is skipped for it. A launcher
  (``python -m zerojax.launch``, ``srun --kill-on-bad-exit``) then sees the
  failure right away.

  Args:
    coordinator_address: ``host:port`` of process 0, where the coordination
      service listens (any free port, the same for every process).
    num_processes: how many processes the job has.
    process_id: this process's index, ``0 <= process_id < num_processes``.
    detect_cluster: with none of the three given, let
      ``jax.distributed.initialize`` detect them (SLURM, Open MPI, Cloud TPU).
    local_device_count: CPU only: how many devices this process fakes (as
      ``--xla_force_host_platform_device_count`` does).
    initialization_timeout: seconds to wait for every process to join.
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
  if local_device_count is not None:
    jax.config.update("jax_num_cpu_devices", local_device_count)
  # Explicit, so that a multi-process CPU run never falls back to no collectives.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  xla_flags = os.environ.get("XLA_FLAGS", "")
  if _COLLECTIVE_TIMEOUT_FLAG not in xla_flags:
    # Read when the backend starts, which is after this.
    os.environ["XLA_FLAGS"] = f"{xla_flags} {_COLLECTIVE_TIMEOUT_FLAG}={collective_timeout}".strip()
  jax.distributed.initialize(
    **given,
    initialization_timeout=initialization_timeout,
    heartbeat_timeout_seconds=heartbeat_timeout,
    shutdown_timeout_seconds=shutdown_timeout,
  )
  _exit_at_once_on_uncaught_exceptions()
  return True


def _exit_at_once_on_uncaught_exceptions() -> None:
  """Makes a process that dies of an uncaught exception skip JAX's exit-time shutdown barrier.

  At exit JAX disconnects from the distributed service, which waits up to the
  shutdown timeout for every other process to disconnect too. The others are
  waiting for this one in a collective, so a crash would otherwise take that
  long to become an exit status. ``jax._src.api.clean_up`` is that exit hook;
  if a later JAX moves it, crashes take the slow way again, nothing worse.
  """
  try:
    from jax._src import api as jax_api
  except ImportError:
    return
  clean_up = getattr(jax_api, "clean_up", None)
  if clean_up is None:
    return
  previous = sys.excepthook

  def excepthook(*exc_info):
    previous(*exc_info)
    atexit.unregister(clean_up)

  sys.excepthook = excepthook


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
  if check_processes and jax.process_count() > 1:
    _check_same_on_every_process(local_batch)
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


def _check_same_on_every_process(local_batch: Any) -> None:
  leaves, treedef = jax.tree_util.tree_flatten_with_path(local_batch)
  described = [
    f"{jax.tree_util.keystr(path) or '(root)'}: {np.shape(x)} {np.result_type(x)}"
    for path, x in leaves
  ]
  signature = zlib.crc32(repr((str(treedef), described)).encode())
  everyone = np.asarray(multihost_utils.process_allgather(np.uint32(signature))).ravel()
  differ = [int(p) for p in np.flatnonzero(everyone != everyone[0])]
  if differ:
    raise ValueError(
      f"the processes' local batches differ: process(es) {differ} passed another "
      "structure, shapes or dtypes than process 0. Every process must pass its equal share "
      f"of the global batch. Process {jax.process_index()} passed {{{', '.join(described)}}}."
    )


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
