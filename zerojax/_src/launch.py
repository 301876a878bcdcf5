"""A local launcher: N CPU processes of one script on loopback, stopped together when one dies.

For development and tests only: on a cluster, the cluster's own launcher
(``srun``, ``gcloud ... --worker=all``) starts the processes and
``zerojax._src.distributed.initialize`` finds them. The launcher itself never
touches a device.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import TextIO

from zerojax._src import distributed

#: Seconds between SIGTERM and SIGKILL when stopping processes.
DEFAULT_GRACE_PERIOD = 5.0
_POLL_SECONDS = 0.05
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on right now."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def process_env(
  base: dict[str, str],
  *,
  process_id: int,
  num_processes: int,
  coordinator_address: str,
  devices_per_process: int | None,
) -> dict[str, str]:
  """The environment of one launched process: ``base`` plus where to find the others.

  Example:
    >>> env = process_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
    ...                   process_id=1, num_processes=2, coordinator_address="127.0.0.1:1234",
    ...                   devices_per_process=4)
    >>> env["ZEROJAX_PROCESS_ID"], env["XLA_FLAGS"], env["JAX_PLATFORMS"]
    ('1', '--xla_force_host_platform_device_count=4', 'cpu')
  """
  env = dict(base)
  env.update(
    {
      distributed.COORDINATOR_ADDRESS: coordinator_address,
      distributed.NUM_PROCESSES: str(num_processes),
      distributed.PROCESS_ID: str(process_id),
      "JAX_PLATFORMS": "cpu",
      "PYTHONUNBUFFERED": "1",
    }
  )
  if devices_per_process is not None:
    # Replace, not append to, a device count inherited from the parent (a test
    # process forcing 8 devices must not give each child 8).
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT_FLAG)]
    env["XLA_FLAGS"] = " ".join([*flags, f"{_DEVICE_COUNT_FLAG}={devices_per_process}"])
  return env


def describe_exit(returncode: int) -> str:
  """How a process ended, in words.

  Example:
    >>> describe_exit(3), describe_exit(-9)
    ('exited with code 3', 'was killed by signal SIGKILL')
  """
  if returncode < 0:
    return f"was killed by signal {signal.Signals(-returncode).name}"
  return f"exited with code {returncode}"


class _InterruptError(Exception):
  """The launcher itself got SIGINT or SIGTERM."""

  def __init__(self, signum: int):
    super().__init__(signum)
    self.signum = signum


def launch(
  command: Sequence[str],
  *,
  num_processes: int,
  devices_per_process: int | None = None,
  timeout: float | None = None,
  grace_period: float = DEFAULT_GRACE_PERIOD,
  stdout: TextIO | None = None,
  stderr: TextIO | None = None,
) -> int:
  """Runs ``num_processes`` copies of ``command`` as one multi-process JAX job on loopback.

  Each process gets ``ZEROJAX_COORDINATOR_ADDRESS`` (127.0.0.1 and a free
  port), ``ZEROJAX_NUM_PROCESSES`` and ``ZEROJAX_PROCESS_ID``, which
  ``initialize`` reads, and ``JAX_PLATFORMS=cpu`` with
  ``devices_per_process`` CPU devices. Their output is streamed line by line,
  each line prefixed with ``[p<id>] ``. As soon as one process fails (non-zero
  exit or a signal), or ``timeout`` passes, or the launcher is interrupted, the
  others get SIGTERM and, ``grace_period`` seconds later, SIGKILL.

  Args:
    command: the program and its arguments, e.g. ``[sys.executable, "train.py"]``.
    num_processes: how many processes to start.
    devices_per_process: CPU devices each process fakes
      (``--xla_force_host_platform_device_count``); ``None`` keeps the
      inherited ``XLA_FLAGS``.
    timeout: seconds after which every process is stopped; ``None`` waits.
    grace_period: seconds between SIGTERM and SIGKILL.
    stdout: where the processes' prefixed stdout goes (``sys.stdout``).
    stderr: where their prefixed stderr and the launcher's messages go
      (``sys.stderr``).

  Returns:
    0 if every process exited with 0; otherwise the first failure's exit code
    (128 + the signal number if it was killed), 124 on timeout, 130 on an
    interrupt.

  Example:
    >>> import io, sys
    >>> out, err = io.StringIO(), io.StringIO()
    >>> code = "import os; print('hello from', os.environ['ZEROJAX_PROCESS_ID'])"
    >>> launch([sys.executable, "-c", code], num_processes=2, stdout=out, stderr=err)
    0
    >>> sorted(out.getvalue().splitlines())
    ['[p0] hello from 0', '[p1] hello from 1']
  """
  if num_processes < 1:
    raise ValueError(f"num_processes must be at least 1, got {num_processes}.")
  stdout = stdout or sys.stdout
  stderr = stderr or sys.stderr
  coordinator = f"127.0.0.1:{free_port()}"
  lock = threading.Lock()
  processes, readers = [], []
  for process_id in range(num_processes):
    env = process_env(
      dict(os.environ),
      process_id=process_id,
      num_processes=num_processes,
      coordinator_address=coordinator,
      devices_per_process=devices_per_process,
    )
    # Own session: a Ctrl-C in the terminal reaches the launcher only, which
    # forwards it, and stopping a session also stops what the process started.
    process = subprocess.Popen(
      command,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      start_new_session=True,
      text=True,
      errors="replace",
    )
    processes.append(process)
    for pipe, sink in ((process.stdout, stdout), (process.stderr, stderr)):
      reader = threading.Thread(target=_stream, args=(pipe, sink, f"[p{process_id}] ", lock))
      reader.start()
      readers.append(reader)

  def say(message: str) -> None:
    with lock:
      print(f"zerojax.launch: {message}", file=stderr, flush=True)

  with _signals_raise():
    try:
      status = _wait(processes, timeout, grace_period, say)
    except _InterruptError as interrupted:
      name = signal.Signals(interrupted.signum).name
      say(f"got {name}; stopping all {num_processes} processes.")
      _stop(processes, grace_period, first=signal.SIGINT)
      status = 130
  for reader in readers:
    reader.join(timeout=grace_period)
  return status


def _wait(
  processes: list[subprocess.Popen], timeout: float | None, grace_period: float, say
) -> int:
  """Waits for every process to succeed, or for the first failure; returns the exit status."""
  deadline = None if timeout is None else time.monotonic() + timeout
  while True:
    codes = [process.poll() for process in processes]
    for process_id, code in enumerate(codes):
      if code:
        others = [p for p, c in zip(processes, codes, strict=True) if c is None]
        say(
          f"process {process_id} (pid {processes[process_id].pid}) {describe_exit(code)}; "
          f"stopping the {len(others)} other running process(es)."
        )
        _stop(others, grace_period)
        return code if code > 0 else 128 - code
    if all(code == 0 for code in codes):
      return 0
    if deadline is not None and time.monotonic() > deadline:
      say(f"timed out after {timeout:g} s; stopping all {len(processes)} processes.")
      _stop(processes, grace_period)
      return 124
    time.sleep(_POLL_SECONDS)


def _stop(
  processes: list[subprocess.Popen], grace_period: float, first: int = signal.SIGTERM
) -> None:
  """Sends ``first`` to each process's session, then SIGKILL to what is left after the grace."""
  for process in processes:
    _signal_session(process, first)
  deadline = time.monotonic() + grace_period
  for process in processes:
    try:
      process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      _signal_session(process, signal.SIGKILL)
      process.wait()


def _signal_session(process: subprocess.Popen, signum: int) -> None:
  if process.poll() is None:
    with contextlib.suppress(ProcessLookupError):  # exited since the poll
      os.killpg(process.pid, signum)


def _stream(pipe: TextIO, sink: TextIO, prefix: str, lock: threading.Lock) -> None:
  for line in pipe:
    with lock:
      sink.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
      sink.flush()
  pipe.close()


@contextlib.contextmanager
def _signals_raise():
  """Within the block, SIGINT and SIGTERM raise ``_InterruptError`` (main thread only)."""

  def interrupt(signum, frame):
    del frame
    raise _InterruptError(signum)

  previous = {}
  if threading.current_thread() is threading.main_thread():
    previous = {
      signum: signal.signal(signum, interrupt) for signum in (signal.SIGINT, signal.SIGTERM)
    }
  try:
    yield
  finally:
    for signum, handler in previous.items():
      signal.signal(signum, handler)


def main(argv: Sequence[str] | None = None) -> int:
  """The command line: ``python -m zerojax.launch -n 2 [options] script.py [script args]``.

  Example:
    From a shell (installed as ``zerojax-launch`` too)::

      python -m zerojax.launch -n 2 --devices-per-process 4 examples/train_lm.py --model tiny
  """
  parser = argparse.ArgumentParser(
    prog="python -m zerojax.launch",
    description="Run N processes of a Python script as one multi-process JAX job on this "
    "machine (CPU devices, loopback, gloo collectives). Every output line is prefixed with "
    "[p<process id>]; if any process fails, the others are stopped and the exit status is "
    "non-zero.",
  )
  parser.add_argument("-n", "--num-processes", type=int, required=True)
  parser.add_argument(
    "--devices-per-process",
    type=int,
    default=None,
    help="CPU devices per process (default: whatever XLA_FLAGS already gives)",
  )
  parser.add_argument(
    "--timeout", type=float, default=None, help="stop everything after this many seconds"
  )
  parser.add_argument(
    "--grace-period",
    type=float,
    default=DEFAULT_GRACE_PERIOD,
    help="seconds between SIGTERM and SIGKILL when stopping processes (default %(default)s)",
  )
  parser.add_argument("script", help="the Python script every process runs")
  parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
  args = parser.parse_args(argv)
  if args.num_processes < 1:
    parser.error(f"--num-processes must be at least 1, got {args.num_processes}")
  return launch(
    [sys.executable, args.script, *args.args],
    num_processes=args.num_processes,
    devices_per_process=args.devices_per_process,
    timeout=args.timeout,
    grace_period=args.grace_period,
  )
