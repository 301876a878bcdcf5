"""A local launcher: N processes of one script on loopback, stopped together, restarted.

For development and tests only: on a cluster, the cluster's own launcher
(``srun``, ``gcloud ... --worker=all``) starts the processes and
``zerojax._src.cluster.distributed.initialize`` finds them. The launcher itself never
touches a device, nor imports JAX: what it shares with the processes (their
variables, the exit codes) is in ``zerojax_launch.job``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, TextIO

from zerojax_launch import job
from zerojax_launch import placement as placement_lib

#: Environment variable: which attempt this is, 1 for the first start, 2 after one restart, ...
ATTEMPT = "ZEROJAX_ATTEMPT"
#: Seconds between SIGTERM and SIGKILL when stopping processes.
DEFAULT_GRACE_PERIOD = 5.0
_POLL_SECONDS = 0.05
#: How long a process that lost a peer waits to be explained by that peer's own failure.
_CAUSE_WAIT_SECONDS = 2.0
#: With ``min_processes``: a process that ended this many attempts in a row counts as lost.
DROP_AFTER = 2
#: What gloo prints on stdout for every group of processes it connects (numbers as N): noise,
#: unless asked for.
_GLOO_MESSAGE = (
  "[Gloo] Rank N is connected to N peer ranks. Expected number of connected peer ranks is : N"
)
_GLOO_CONNECTED = re.compile(r"\[Gloo\] Rank|is connected to \d+ peer ranks")
#: The shortest piece of the message taken for one: shorter ones may be a program's own output.
_GLOO_PIECE = 12


def _is_gloo_noise(line: str) -> bool:
  """Whether ``line`` is gloo's connection message, or pieces of it.

  Two threads of a process may print it at once, each cutting into the other's line, so a
  line may hold two messages run together, or be the end of one.
  """
  if _GLOO_CONNECTED.search(line):
    return True
  piece = re.sub(r"\d+", "N", line.strip())
  return len(piece) >= _GLOO_PIECE and piece in _GLOO_MESSAGE


#: The exit status of a usage error (argparse's, Python's for a script it cannot open): a
#: restart would repeat it.
USAGE_EXIT_CODE = 2


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
  placement: placement_lib.Placement,
) -> dict[str, str]:
  """The environment of one launched process: ``base`` plus where to find the others.

  Example:
    >>> from zerojax_launch.placement import Placement
    >>> env = process_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
    ...                   process_id=1, num_processes=2, coordinator_address="127.0.0.1:1234",
    ...                   placement=Placement("cpu", devices_per_process=4))
    >>> env["ZEROJAX_PROCESS_ID"], env["XLA_FLAGS"], env["JAX_PLATFORMS"]
    ('1', '--xla_force_host_platform_device_count=4', 'cpu')

    On a host with GPUs, one each, and no platform forced:

    >>> env = process_env({}, process_id=1, num_processes=2, coordinator_address="127.0.0.1:1234",
    ...                   placement=Placement("gpu", gpus=("0", "1")))
    >>> env["CUDA_VISIBLE_DEVICES"], "JAX_PLATFORMS" in env
    ('1', False)
  """
  env = dict(base)
  env.update(
    {
      job.COORDINATOR_ADDRESS: coordinator_address,
      job.NUM_PROCESSES: str(num_processes),
      job.PROCESS_ID: str(process_id),
      "PYTHONUNBUFFERED": "1",
    }
  )
  env.update(placement.env(process_id, base))
  return env


def describe_exit(returncode: int) -> str:
  """How a process ended, in words.

  Example:
    >>> describe_exit(3), describe_exit(-9), describe_exit(75)
    ('exited with code 3', 'was killed by signal SIGKILL', 'exited with code 75 (preempted)')
  """
  if returncode < 0:
    return f"was killed by signal {signal.Signals(-returncode).name}"
  if returncode == job.PREEMPTED_EXIT_CODE:
    return f"exited with code {returncode} (preempted)"
  return f"exited with code {returncode}"


class _InterruptError(Exception):
  """The launcher itself got SIGINT or SIGTERM."""

  def __init__(self, signum: int):
    super().__init__(signum)
    self.signum = signum


class _Outcome(NamedTuple):
  """How an attempt ended: its exit status, whether to restart (``"failed"``,
  ``"preempted"``) or not (``"succeeded"``, ``"timed out"``), and for a failure
  the process that ended it (``culprit``): one found stopped, else the first to
  fail."""

  status: int
  kind: str
  culprit: int | None = None


class _Suspect:
  """The process that ended the latest failed attempts, and those attempts (in a row)."""

  def __init__(self):
    self.process: int | None = None
    self.attempts: list[int] = []

  def failed(self, process: int | None, attempt: int) -> None:
    """Attempt ``attempt`` failed because of ``process``."""
    if process != self.process:
      self.process, self.attempts = process, []
    self.attempts.append(attempt)

  def clear(self) -> None:
    self.process, self.attempts = None, []

  def lost(self) -> bool:
    """Whether the process counts as lost: ``DROP_AFTER`` failed attempts in a row are its."""
    return self.process is not None and len(self.attempts) >= DROP_AFTER

  def __str__(self) -> str:
    attempts = " and ".join(map(str, self.attempts))
    return f"process {self.process} ended attempts {attempts} in a row, so it counts as lost"


def launch(
  command: Sequence[str],
  *,
  num_processes: int,
  devices_per_process: int | None = None,
  platform: str | None = None,
  max_restarts: int = 0,
  min_processes: int | None = None,
  heartbeat_timeout: int | None = None,
  timeout: float | None = None,
  grace_period: float = DEFAULT_GRACE_PERIOD,
  stdout: TextIO | None = None,
  stderr: TextIO | None = None,
  verbose: bool = False,
) -> int:
  """Runs ``num_processes`` copies of ``command`` as one multi-process JAX job on loopback.

  Each process gets ``ZEROJAX_COORDINATOR_ADDRESS`` (127.0.0.1 and a free
  port), ``ZEROJAX_NUM_PROCESSES`` and ``ZEROJAX_PROCESS_ID``, which
  ``initialize`` reads, ``ZEROJAX_ATTEMPT`` (1, then 2 after the first
  restart, ...), and its devices: on a host with GPUs one each
  (``CUDA_VISIBLE_DEVICES``), on a TPU host (one process) all of them,
  elsewhere ``JAX_PLATFORMS=cpu`` with ``devices_per_process`` CPU devices
  (see ``platform``). Their output is streamed line by line, each line prefixed with
  ``[p<id>] ``, but for gloo's ``[Gloo] Rank N is connected to ...`` lines
  (each process prints them as it connects to the others) unless ``verbose``.
  As soon as one process fails (non-zero exit or a signal), or ``timeout``
  passes, or the launcher is interrupted, the others get SIGTERM (and
  SIGCONT, in case they are stopped) and, ``grace_period`` seconds later,
  SIGKILL. Each process runs in its own session, and what it started (a data
  loader, an uploader) is stopped with it when its attempt ends, even if the
  process itself has exited.

  Restarts: after a failure the whole group is started again with the same
  command, up to ``max_restarts`` times; the script resumes from its latest
  checkpoint. A process that exits with 2 (``USAGE_EXIT_CODE``: argparse's
  status for a mistake in the arguments, Python's for a script it cannot open)
  ends the job without a restart, which would only repeat the mistake. A
  process that exits with ``zerojax.distributed.PREEMPTED_EXIT_CODE`` (75)
  was preempted and saved: the others get ``grace_period`` seconds to do the
  same, and if they all do, the group is restarted without counting against
  ``max_restarts`` (a preemption is not a fault of the job, and on preemptible
  capacity it is routine). If the launcher itself gets SIGTERM, it passes it
  on, so that the processes save and exit, and exits with 75 without
  restarting: the machine is going away; whoever restarts the launcher
  resumes the job.

  Going on with fewer processes (``min_processes``): a process that ends
  ``DROP_AFTER`` (2) failed attempts in a row counts as lost for good (a host
  that does not come back). The process that ends an attempt is one found
  stopped (SIGSTOP, a frozen host), else the first to exit with a failure; an
  attempt ended by another process, or preempted, starts the count again. The
  group is then restarted with one process fewer (a restart like any other,
  counted against ``max_restarts``), as long as at least ``min_processes``
  remain; the processes are numbered from 0 again. Otherwise the launcher
  gives up, naming the lost process. On one machine every process is alike,
  so this plays the part of a cluster's node loss; the script must resume on
  the smaller mesh (``examples/train_lm.py --resume --per-device-batch`` keeps
  the global batch with more micro-batches).

  Args:
    command: the program and its arguments, e.g. ``[sys.executable, "train.py"]``.
    num_processes: how many processes to start.
    devices_per_process: CPU devices each process fakes
      (``--xla_force_host_platform_device_count``), which means the CPU;
      ``None`` keeps the inherited ``XLA_FLAGS``.
    platform: ``"cpu"``, ``"gpu"`` or ``"tpu"``; ``None`` takes the host's
      accelerators as their drivers show them (``/dev/nvidia<N>``,
      ``/dev/accel<N>``), else the CPU. Nothing else forces a platform.
    max_restarts: how many times to restart the group after a failure.
    min_processes: go on without a lost process while at least this many
      remain (``None``: never go on without one, restart the whole group).
    heartbeat_timeout: seconds after which the JAX distributed service
      declares a silent process (dead, stopped, frozen) gone and ends the
      others, which is a failure; passed to ``initialize`` as
      ``ZEROJAX_HEARTBEAT_TIMEOUT``. ``None``: ``initialize``'s default (60).
    timeout: seconds after which every process is stopped, whatever attempt is
      running, and nothing is restarted; ``None`` waits.
    grace_period: seconds between SIGTERM and SIGKILL; also how long the
      others may take to finish saving after one process exits preempted.
    stdout: where the processes' prefixed stdout goes (``sys.stdout``).
    stderr: where their prefixed stderr and the launcher's messages go
      (``sys.stderr``).
    verbose: also relay gloo's connection lines.

  Returns:
    The last attempt's status: 0 if every process exited with 0; otherwise
    the first failure's exit code (128 + the signal number if it was killed),
    124 on timeout, 130 on an interrupt (SIGINT), 75 if the launcher got
    SIGTERM.

  Raises:
    ValueError: if ``num_processes``, ``devices_per_process`` or
      ``heartbeat_timeout`` is below 1, ``max_restarts`` or ``grace_period``
      below 0, ``timeout`` not above 0, or ``min_processes`` not between 1 and
      ``num_processes``; or if the processes do not fit the host's devices
      (more than its GPUs, more than one on a TPU host).

  Example:
    >>> import io, sys
    >>> out, err = io.StringIO(), io.StringIO()
    >>> code = "import os; print('hello from', os.environ['ZEROJAX_PROCESS_ID'])"
    >>> launch([sys.executable, "-c", code], num_processes=2, stdout=out, stderr=err)
    0
    >>> sorted(out.getvalue().splitlines())
    ['[p0] hello from 0', '[p1] hello from 1']

    A process that fails on the first attempt only:

    >>> code = "import os, sys; sys.exit(3 if os.environ['ZEROJAX_ATTEMPT'] == '1' else 0)"
    >>> launch([sys.executable, "-c", code], num_processes=2, max_restarts=2, stderr=err)
    0
    >>> "restarting after attempt 1 failed (restart 1 of --max-restarts 2)" in err.getvalue()
    True

    Process 1 fails at every start, as a host gone for good would; the job goes on without it:

    >>> code = "import os, sys; sys.exit(3 if os.environ['ZEROJAX_PROCESS_ID'] == '1' else 0)"
    >>> launch([sys.executable, "-c", code], num_processes=2, max_restarts=2, min_processes=1,
    ...        stderr=err)
    0
    >>> "shrinking from 2 to 1 process(es): process 1 ended attempts 1 and 2 in a row" in (
    ...   err.getvalue())
    True
  """
  problem = _check(
    num_processes,
    devices_per_process,
    max_restarts,
    heartbeat_timeout,
    min_processes,
    timeout=timeout,
    grace_period=grace_period,
  )
  if problem:
    raise ValueError(f"{problem}.")
  accelerators = placement_lib.local_accelerators()
  place = lambda count: placement_lib.place(
    count, devices_per_process, platform, os.environ, accelerators
  )
  place(num_processes)  # refused now rather than at the first start
  stdout = stdout or sys.stdout
  stderr = stderr or sys.stderr
  lock = threading.Lock()

  def say(message: str) -> None:
    with lock:
      print(f"zerojax_launch: {message}", file=stderr, flush=True)

  deadline = None if timeout is None else time.monotonic() + timeout
  base_env = dict(os.environ)
  if heartbeat_timeout is not None:
    base_env[job.HEARTBEAT_TIMEOUT] = str(heartbeat_timeout)
  policy = _Restarts(num_processes, max_restarts, min_processes, say)
  attempt = 0
  with _signals_raise():
    while True:
      attempt += 1
      env = {**base_env, ATTEMPT: str(attempt)}
      group = _Group(command, env, stdout, stderr, lock, hide=None if verbose else _is_gloo_noise)
      try:
        group.start(policy.num_processes, place(policy.num_processes))
        say(
          f"attempt {attempt}: started {policy.num_processes} process(es) (pids "
          f"{', '.join(str(p.pid) for p in group.processes)}); "
          f"{policy.left} restart(s) after failures left."
        )
        outcome = _wait(group, deadline, timeout, grace_period, say)
        _stop(group.processes, grace_period)  # what they started and left behind
        group.join(grace_period)
        if not policy.again(attempt, outcome):
          return outcome.status
      except _InterruptError as interrupted:
        status = _interrupted(group.processes, interrupted.signum, grace_period, say)
        group.join(grace_period)
        return status


def _check(
  num_processes: int,
  devices_per_process: int | None,
  max_restarts: int,
  heartbeat_timeout: int | None,
  min_processes: int | None,
  name: Callable[[str], str] = str,
  *,
  timeout: float | None = None,
  grace_period: float = DEFAULT_GRACE_PERIOD,
) -> str | None:
  """The first thing wrong with the launcher's arguments, each called ``name(argument)``."""
  for argument, value, least in [
    ("num_processes", num_processes, 1),
    ("max_restarts", max_restarts, 0),
    ("devices_per_process", devices_per_process, 1),
    ("heartbeat_timeout", heartbeat_timeout, 1),
    ("grace_period", grace_period, 0),
  ]:
    if value is not None and value < least:
      return f"{name(argument)} must be at least {least}, got {value:g}"
  if timeout is not None and not timeout > 0:
    return f"{name('timeout')} must be above 0, got {timeout:g}"
  if min_processes is not None and not 1 <= min_processes <= num_processes:
    return (
      f"{name('min_processes')} must be between 1 and {name('num_processes')} "
      f"({num_processes}), got {min_processes}"
    )
  return None


class _Restarts:
  """What follows an attempt: a restart, a restart with one process fewer, or the end."""

  def __init__(self, num_processes: int, max_restarts: int, min_processes: int | None, say):
    self.num_processes = num_processes
    self.max_restarts = max_restarts
    self.min_processes = min_processes
    self.restarts = 0
    self.suspect = _Suspect()
    self.say = say

  @property
  def left(self) -> int:
    """Restarts after failures still allowed."""
    return self.max_restarts - self.restarts

  def again(self, attempt: int, outcome: _Outcome) -> bool:
    """Whether to start another attempt after ``outcome`` (maybe with fewer processes)."""
    if outcome.kind == "preempted":
      self.suspect.clear()
      self.say(
        f"attempt {attempt} was preempted (its processes saved and exited with "
        f"{job.PREEMPTED_EXIT_CODE}); restarting. Preemptions do not count against "
        "--max-restarts."
      )
      return True
    if outcome.kind == "failed" and outcome.status == USAGE_EXIT_CODE:
      self.say(
        f"not restarting: attempt {attempt} exited with {USAGE_EXIT_CODE}, a usage error (the "
        "script's arguments, or a script Python cannot open), which every restart would repeat; "
        f"fix the command. Exit status {USAGE_EXIT_CODE}."
      )
      return False
    if outcome.kind == "failed":
      self.suspect.failed(outcome.culprit, attempt)
    if self.min_processes is not None and self.suspect.lost():
      if self.num_processes - 1 < self.min_processes:
        self.say(
          f"giving up: {self.suspect}, and without it {self.num_processes - 1} process(es) "
          f"would remain, fewer than --min-processes {self.min_processes}; exit status "
          f"{outcome.status}."
        )
        return False
      if self.left:
        return self._shrink()
    if outcome.kind == "failed" and self.left:
      self.restarts += 1
      self.say(
        f"restarting after attempt {attempt} failed (restart {self.restarts} of "
        f"--max-restarts {self.max_restarts})."
      )
      return True
    if outcome.kind == "failed" and self.max_restarts:
      self.say(
        f"giving up: attempt {attempt} failed and all {self.max_restarts} restart(s) "
        f"(--max-restarts {self.max_restarts}) are used; exit status {outcome.status}."
      )
    return False

  def _shrink(self) -> bool:
    """Restarts without the lost process."""
    self.restarts += 1
    self.num_processes -= 1
    self.say(
      f"shrinking from {self.num_processes + 1} to {self.num_processes} process(es): "
      f"{self.suspect}; restarting without it (restart {self.restarts} of --max-restarts "
      f"{self.max_restarts}, --min-processes {self.min_processes}), the processes numbered "
      "from 0 again."
    )
    self.suspect.clear()
    return True


class _Group:
  """One attempt's processes, and the threads that stream their prefixed output.

  Output lines for which ``hide`` (if given) is true are dropped.
  """

  def __init__(self, command, env, stdout, stderr, lock, hide: Callable[[str], bool] | None):
    self.command, self.env, self.sinks, self.lock = command, env, (stdout, stderr), lock
    self.hide = hide
    self.processes: list[subprocess.Popen] = []
    # Process ids in the order the processes exited, as threads waiting on each saw it: two
    # exits between two polls are still told apart (the first to die is the one to blame).
    self.exit_order: list[int] = []
    self._readers: list[threading.Thread] = []

  def start(self, num_processes: int, placement: placement_lib.Placement) -> None:
    coordinator = f"127.0.0.1:{free_port()}"  # a fresh one: the last may linger in TIME_WAIT
    for process_id in range(num_processes):
      env = process_env(
        self.env,
        process_id=process_id,
        num_processes=num_processes,
        coordinator_address=coordinator,
        placement=placement,
      )
      # Own session: a Ctrl-C in the terminal reaches the launcher only, which
      # forwards it, and stopping a session also stops what the process started.
      process = subprocess.Popen(
        self.command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        text=True,
        errors="replace",
      )
      self.processes.append(process)
      threading.Thread(target=self._reap, args=(process_id, process), daemon=True).start()
      for pipe, sink in zip((process.stdout, process.stderr), self.sinks, strict=True):
        prefix = f"[p{process_id}] "
        # Daemon threads: a pipe held open by something the process left behind
        # must not keep the launcher from exiting.
        reader = threading.Thread(
          target=_stream, args=(pipe, sink, prefix, self.lock, self.hide), daemon=True
        )
        reader.start()
        self._readers.append(reader)

  def _reap(self, process_id: int, process: subprocess.Popen) -> None:
    process.wait()
    self.exit_order.append(process_id)

  def codes(self) -> list[int | None]:
    """Each process's return code, ``None`` while it runs (or is not reaped yet)."""
    codes: list[int | None] = [None] * len(self.processes)
    for process_id in list(self.exit_order):
      codes[process_id] = self.processes[process_id].returncode
    return codes

  def join(self, timeout: float) -> None:
    for reader in self._readers:
      reader.join(timeout=timeout)


def _interrupted(processes: list[subprocess.Popen], signum: int, grace_period: float, say) -> int:
  """Stops ``processes`` after the launcher got ``signum``; the launcher's exit status."""
  name = signal.Signals(signum).name
  count = len(processes)
  if signum == signal.SIGTERM:
    say(
      f"got SIGTERM; passing it on to all {count} processes so that they save, and exiting "
      f"with {job.PREEMPTED_EXIT_CODE} (preempted: restart me) without restarting."
    )
    _stop(processes, grace_period, first=signal.SIGTERM)
    return job.PREEMPTED_EXIT_CODE
  say(f"got {name}; stopping all {count} processes.")
  _stop(processes, grace_period, first=signal.SIGINT)
  return 130


def _wait(
  group: _Group, deadline: float | None, timeout: float | None, grace_period: float, say
) -> _Outcome:
  """Waits for every process to succeed, or for the first failure, preemption or the deadline."""
  processes = group.processes
  while True:
    codes = group.codes()
    for process_id in list(group.exit_order):  # the first to fail, not the lowest id
      code = codes[process_id]
      if code:
        if code == job.PREEMPTED_EXIT_CODE:
          return _preempted(group, process_id, grace_period, say)
        if code == job.PEER_LOST_EXIT_CODE:
          process_id = _cause(group, process_id)
        return _failed(processes, group.codes(), process_id, grace_period, say)
    if all(code == 0 for code in codes):
      return _Outcome(0, "succeeded")
    if deadline is not None and time.monotonic() > deadline:
      say(f"timed out after {timeout:g} s; stopping all {len(processes)} processes.")
      _stop(processes, grace_period)
      return _Outcome(124, "timed out")
    time.sleep(_POLL_SECONDS)


def _cause(group: _Group, consequence: int) -> int:
  """The process whose death made ``consequence`` exit with ``PEER_LOST_EXIT_CODE``.

  The one that went away has died by the time the others notice, but the
  thread that waits on it may not have seen it yet: so wait a moment for a
  failure other than a lost peer, and blame ``consequence`` only if none comes.
  """
  until = time.monotonic() + _CAUSE_WAIT_SECONDS
  while True:
    codes = group.codes()
    for process_id in list(group.exit_order):
      if codes[process_id] not in (0, None, job.PEER_LOST_EXIT_CODE):
        return process_id
    if time.monotonic() > until:
      return consequence
    time.sleep(_POLL_SECONDS)


def _preempted(group: _Group, first: int, grace_period: float, say) -> _Outcome:
  """After process ``first`` exited preempted: do the others follow within the grace period?"""
  processes = group.processes
  say(
    f"process {first} (pid {processes[first].pid}) {describe_exit(processes[first].returncode)}; "
    f"waiting up to {grace_period:g} s for the others to save and exit too."
  )
  deadline = time.monotonic() + grace_period
  while time.monotonic() < deadline and None in group.codes():
    time.sleep(_POLL_SECONDS)
  codes = group.codes()
  expected = (0, job.PREEMPTED_EXIT_CODE)
  exited = [p for p in group.exit_order if codes[p] not in expected]
  late = [p for p, code in enumerate(codes) if code is None]
  if exited:
    return _failed(processes, codes, exited[0], grace_period, say)
  if late:
    say(f"process {late[0]} (pid {processes[late[0]].pid}) did not exit in time.")
    _stop([processes[p] for p in late], grace_period)
    return _Outcome(job.PREEMPTED_EXIT_CODE, "failed", culprit=late[0])
  return _Outcome(job.PREEMPTED_EXIT_CODE, "preempted")


def _failed(
  processes: list[subprocess.Popen], codes: list, failed: int, grace_period: float, say
) -> _Outcome:
  """Says which process failed and how, and stops the others; the attempt's ``_Outcome``.

  A process found stopped is named too, and it is the culprit: the others
  failed because it went silent (the JAX distributed service ends them).
  """
  running = [p for p, c in enumerate(codes) if c is None]
  stopped = [p for p in running if _is_stopped(processes[p].pid)]
  note = "".join(
    f"; process {p} (pid {processes[p].pid}) is stopped (SIGSTOP or SIGTSTP)" for p in stopped
  )
  say(
    f"process {failed} (pid {processes[failed].pid}) {describe_exit(codes[failed])}{note}; "
    f"stopping the {len(running)} other running process(es)."
  )
  _stop([processes[p] for p in running], grace_period)
  return _Outcome(_status(codes[failed]), "failed", culprit=(stopped or [failed])[0])


def _status(returncode: int) -> int:
  """A process's return code as a shell exit status (128 + N for signal N)."""
  return returncode if returncode > 0 else 128 - returncode


def _is_stopped(pid: int) -> bool:
  """Whether ``pid`` is stopped by a signal (Linux ``/proc``; ``False`` where there is none)."""
  try:
    with open(f"/proc/{pid}/stat") as stat:
      # "pid (command name) state ...": the name may hold spaces and parentheses.
      return stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
  except (OSError, IndexError):
    return False


def _stop(
  processes: list[subprocess.Popen], grace_period: float, first: int = signal.SIGTERM
) -> None:
  """Sends ``first`` to each process's session, then SIGKILL to what is left after the grace.

  A session also holds what its process started (a data loader, an uploader),
  which may outlive the process: it is stopped too.
  """
  for process in processes:
    _signal_session(process, first)
    _signal_session(process, signal.SIGCONT)  # a stopped process acts on ``first`` only once woken
  deadline = time.monotonic() + grace_period
  for process in processes:
    with contextlib.suppress(subprocess.TimeoutExpired):
      process.wait(timeout=max(0.0, deadline - time.monotonic()))
  while time.monotonic() < deadline and any(_signal_session(p, 0) for p in processes):
    time.sleep(_POLL_SECONDS)
  for process in processes:
    _signal_session(process, signal.SIGKILL)
    process.wait()


def _signal_session(process: subprocess.Popen, signum: int) -> bool:
  """Sends ``signum`` to the process's session; whether anything in it was left to get it.

  The session outlives its leader while what the leader started runs, and its
  id is not reused until the last of those exits.
  """
  try:
    os.killpg(process.pid, signum)
  except ProcessLookupError:
    return False
  return True


def _stream(
  pipe: TextIO,
  sink: TextIO,
  prefix: str,
  lock: threading.Lock,
  hide: Callable[[str], bool] | None,
) -> None:
  for line in pipe:
    if hide is not None and hide(line):
      continue
    with lock:
      sink.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
      sink.flush()
  pipe.close()


@contextlib.contextmanager
def _signals_raise():
  """Within the block, SIGINT and SIGTERM raise ``_InterruptError`` (main thread only).

  Only the first one raises: the processes are being stopped by then, and a second
  signal must not interrupt that half way.
  """
  raised = []

  def interrupt(signum, frame):
    del frame
    if not raised:
      raised.append(signum)
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
  """The command line: ``python -m zerojax_launch -n 2 [options] script.py [script args]``.

  Example:
    From a shell (installed as ``zerojax-launch`` too)::

      python -m zerojax_launch -n 2 --devices-per-process 4 examples/train_lm.py --model tiny
  """
  parser = _parser()
  args = parser.parse_args(argv)
  problem = _check(
    args.num_processes,
    args.devices_per_process,
    args.max_restarts,
    args.heartbeat_timeout,
    args.min_processes,
    name=lambda argument: "--" + argument.replace("_", "-"),
    timeout=args.timeout,
    grace_period=args.grace_period,
  )
  if problem:
    parser.error(problem)
  if not os.path.isfile(args.script):
    parser.error(f"{args.script}: no such script (every process would run python {args.script})")
  try:
    placement_lib.place(args.num_processes, args.devices_per_process, args.platform)
  except ValueError as error:
    parser.error(str(error).replace("devices_per_process", "--devices-per-process"))
  return launch(
    [sys.executable, args.script, *args.args],
    num_processes=args.num_processes,
    devices_per_process=args.devices_per_process,
    platform=args.platform,
    max_restarts=args.max_restarts,
    min_processes=args.min_processes,
    heartbeat_timeout=args.heartbeat_timeout,
    timeout=args.timeout,
    grace_period=args.grace_period,
    verbose=args.verbose,
  )


def _parser() -> argparse.ArgumentParser:
  """The command line's arguments."""
  parser = argparse.ArgumentParser(
    prog="python -m zerojax_launch",
    description="Run N processes of a Python script as one multi-process JAX job on this "
    "machine: one GPU each on a host with GPUs, the TPUs of a TPU host (one process), else "
    "CPU devices with gloo collectives; loopback between them. Every output line is prefixed with "
    "[p<process id>]; if any process fails, the others are stopped and, with --max-restarts, "
    "the whole group is started again; the exit status is the last attempt's.",
  )
  parser.add_argument("-n", "--num-processes", type=int, required=True)
  parser.add_argument(
    "--devices-per-process",
    type=int,
    default=None,
    help="CPU devices per process, on the CPU (default: whatever XLA_FLAGS already gives)",
  )
  parser.add_argument(
    "--platform",
    choices=placement_lib.PLATFORMS,
    help="what the processes compute on (default: the host's GPUs or TPUs, as /dev shows "
    "them, else the CPU)",
  )
  parser.add_argument(
    "--max-restarts",
    type=int,
    default=0,
    help="restart the whole group after a failure up to this many times (default %(default)s); "
    f"a group whose processes exit with {job.PREEMPTED_EXIT_CODE} (preempted, after "
    f"saving) is restarted without counting, one that exits with {USAGE_EXIT_CODE} (a usage "
    "error) is not restarted",
  )
  parser.add_argument(
    "--min-processes",
    type=int,
    default=None,
    help=f"go on with fewer processes: one that ends {DROP_AFTER} failed attempts in a row "
    "counts as lost, and the group is restarted without it while at least this many remain "
    "(default: never, the whole group is restarted)",
  )
  parser.add_argument(
    "--heartbeat-timeout",
    type=int,
    default=None,
    help="seconds after which a silent process (dead, stopped, frozen) counts as gone, which "
    "fails the attempt (sets ZEROJAX_HEARTBEAT_TIMEOUT for zerojax.distributed.initialize; "
    "default 60)",
  )
  parser.add_argument(
    "--timeout",
    type=float,
    default=None,
    help="stop everything after this many seconds, whatever attempt is running (exit 124)",
  )
  parser.add_argument(
    "--grace-period",
    type=float,
    default=DEFAULT_GRACE_PERIOD,
    help="seconds between SIGTERM and SIGKILL when stopping processes (default %(default)s)",
  )
  parser.add_argument(
    "--verbose",
    action="store_true",
    help="also show gloo's '[Gloo] Rank N is connected to ...' lines, which every process "
    "prints when it connects to the others",
  )
  parser.add_argument("script", help="the Python script every process runs")
  parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
  return parser
