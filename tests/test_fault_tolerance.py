"""Fault tolerance: the main job survives a kill, a preemption, a hang and a damaged checkpoint.

``test_the_main_job_survives_...`` runs ``examples/train_lm.py`` (tiny model, 2
processes x 1 CPU device on loopback) under ``python -m zerojax_launch
--max-restarts 2`` and hits it, one attempt after the other, at random steps:

1. ``kill -9`` of process 1: the launcher stops process 0 and restarts the
   group, which resumes from the latest checkpoint;
2. SIGTERM to process 0 (a preemption notice): both processes stop after the
   same step, save it and exit with 75; the launcher restarts them without
   counting it, and they resume from exactly that step;
3. SIGSTOP of process 0, and, while it is stopped, a truncated file in the
   latest checkpoint: the heartbeat timeout ends the attempt; the restart finds
   the latest checkpoint damaged, sets it aside and resumes from the one before.

The job then finishes on its own, with the final parameters and the logged loss
of every step (re-done steps included) of an uninterrupted run, bit for bit.
The uninterrupted run is this process on 2 devices: with 2 devices every sum
across devices has two operands, so the order of a reduction cannot change a bit
(and 1 x 2 and 2 x 1 agree exactly).

The other tests use ``tests/checkpoint_worker.py`` (one process, a fast model)
under the launcher: a crash inside the first save, and a crash that recurs on
every attempt.
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import chex

import zerojax
from examples import train_lm
from tests import environment
from tests.environment import ROOT
from tests.helpers import final_params, run_checkpoint_worker

STEPS = 60
FLAGS = [
  *("--model", "tiny", "--steps", str(STEPS), "--batch-size", "8", "--seq-len", "32"),
  *("--eval-every", str(STEPS), "--save-every", "5", "--keep", "100", "--no-report"),
]
HEARTBEAT = 5  # --heartbeat-timeout, seconds
GRACE = 3  # --grace-period, seconds


class Job:
  """``python -m zerojax_launch ARGS`` running, its output lines collected with their times."""

  def __init__(self, *args: str, env: dict | None = None):
    self.lines: list[tuple[float, str]] = []
    self._lock = threading.Lock()
    self.process = subprocess.Popen(
      [sys.executable, "-m", "zerojax_launch", *args],
      cwd=ROOT,
      env=environment.subprocess_env(**(env or {})),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      errors="replace",
    )
    self._readers = [
      threading.Thread(target=self._read, args=(pipe,), daemon=True)
      for pipe in (self.process.stdout, self.process.stderr)
    ]
    for reader in self._readers:
      reader.start()

  def _read(self, pipe) -> None:
    for line in pipe:
      with self._lock:
        self.lines.append((time.monotonic(), line.rstrip("\n")))

  def text(self) -> str:
    with self._lock:
      return "\n".join(line for _, line in self.lines)

  def when(self, pattern: str, after: float = 0) -> float | None:
    """When the first line matching ``pattern`` (a regex) came after ``after``, or ``None``."""
    with self._lock:
      return next((t for t, x in self.lines if t > after and re.search(pattern, x)), None)

  def wait_for(self, condition, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
      assert self.process.poll() is None, f"the job ended waiting for {what}:\n{self.tail()}"
      assert time.monotonic() < deadline, f"no {what} after {timeout} s:\n{self.tail()}"
      time.sleep(0.02)

  def pids(self, attempt: int) -> list[int]:
    self.wait_for(lambda: self.when(f"attempt {attempt}: started"), f"attempt {attempt}")
    pattern = rf"attempt {attempt}: started \d+ process\(es\) \(pids ([\d, ]+)\)"
    found = re.search(pattern, self.text())
    return [int(pid) for pid in found.group(1).split(", ")]

  def finish(self, timeout: float) -> int:
    """The launcher's exit status, once it has exited by itself within ``timeout`` seconds."""
    return self.process.wait(timeout=timeout)

  def stop(self, log: Path) -> None:
    """Interrupts the launcher if it still runs (it stops its processes), then kills it.

    Writes every line it printed, with the seconds since it started, to ``log``.
    """
    if self.process.poll() is None:
      self.process.send_signal(signal.SIGINT)
      try:
        self.process.wait(timeout=GRACE + 30)
      except subprocess.TimeoutExpired:
        self.process.kill()
        self.process.wait()
    for reader in self._readers:
      reader.join(timeout=10)
    self.process.stdout.close()
    self.process.stderr.close()
    start = self.lines[0][0] if self.lines else 0
    log.write_text("".join(f"{t - start:8.2f} {line}\n" for t, line in self.lines))

  def tail(self) -> str:
    return self.text()[-6000:]


def logged(out: Path) -> list[dict]:
  """The job's loss log: every step's loss, in the order the steps finished, attempts included."""
  path = out / "losses.jsonl"
  return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def last_step(out: Path) -> int:
  lines = logged(out)
  return lines[-1]["step"] if lines else 0


def complete_steps(directory: Path) -> list[int]:
  return sorted(int(path.name) for path in directory.iterdir() if path.name.isdigit())


def test_the_main_job_survives_a_kill_a_preemption_a_hang_and_a_damaged_checkpoint(tmp_path):
  seed = random.randrange(2**32)
  rng = random.Random(seed)
  about = f"(random seed {seed}; the job's output: {tmp_path / 'job.log'})"
  # Its last checkpoint is the only one read.
  ref = ["--save-every", str(STEPS), "--checkpoint-dir", str(tmp_path / "ref")]
  reference = train_lm.main([*FLAGS, "--devices", "2", *ref, "--out", str(tmp_path)])
  out, checkpoints = tmp_path / "job", tmp_path / "job" / "ckpt"
  job = Job(
    *("-n", "2", "--devices-per-process", "1", "--max-restarts", "2"),
    *("--heartbeat-timeout", str(HEARTBEAT), "--grace-period", str(GRACE), "--timeout", "400"),
    "examples/train_lm.py",
    *(*FLAGS, "--checkpoint-dir", str(checkpoints), "--resume", "--out", str(out)),
  )
  try:
    # 1. kill -9 of process 1 at a random step.
    target = rng.randint(3, 12)
    pids = job.pids(1)
    job.wait_for(lambda: last_step(out) >= target, f"step {target} {about}")
    os.kill(pids[1], signal.SIGKILL)
    killed_after = last_step(out)
    time.sleep(1)  # a save that process 0 was about to commit has committed by now
    saved_before_kill = complete_steps(checkpoints) if checkpoints.exists() else []

    # 2. SIGTERM to process 0 a few steps after the restart got past the kill.
    pids = job.pids(2)
    target_term = killed_after + rng.randint(2, 6)
    job.wait_for(lambda: last_step(out) >= target_term, f"step {target_term} {about}")
    os.kill(pids[0], signal.SIGTERM)
    target_term = last_step(out)
    job.wait_for(lambda: job.when("attempt 2 was preempted"), f"the preemption {about}")
    stopped = int(re.search(r"\[p0\] preempted: stopped after step (\d+)", job.text()).group(1))
    assert stopped in complete_steps(checkpoints), about

    # 3. SIGSTOP of process 0 as soon as attempt 3's first or second checkpoint is committed
    # (none is in flight then: a save in flight when the process stops would commit only when
    # the launcher lets it go, after the damage below), and a damaged latest checkpoint.
    pids = job.pids(3)
    target = (stopped // 5 + rng.randint(1, 2)) * 5
    job.wait_for(lambda: target in complete_steps(checkpoints), f"checkpoint {target} {about}")
    os.kill(pids[0], signal.SIGSTOP)
    stopped_at = time.monotonic()
    *_, previous, damaged = complete_steps(checkpoints)
    files = [path for path in (checkpoints / str(damaged) / "state").rglob("*") if path.is_file()]
    largest = max((path for path in files if path.parent.name == "d"), key=os.path.getsize)
    os.truncate(largest, largest.stat().st_size // 2)
    job.pids(4)
    status = job.finish(timeout=200)
  finally:
    job.stop(tmp_path / "job.log")
  text = job.text()
  assert status == 0, f"{about}\n{job.tail()}"

  # The launcher's account: two failures restarted, the preemption free.
  assert "process 1 (pid" in text and "was killed by signal SIGKILL" in text
  assert "restarting after attempt 1 failed (restart 1 of --max-restarts 2)" in text
  assert "restarting after attempt 3 failed (restart 2 of --max-restarts 2)" in text
  assert "attempt 2 was preempted" in text and "attempt 5" not in text
  assert f"process 0 (pid {pids[0]}) is stopped (SIGSTOP or SIGTSTP)" in text
  # The hang ended within the documented bound: the heartbeat timeout, then the grace period.
  detected = job.when("restarting after attempt 3 failed") - stopped_at
  assert detected < HEARTBEAT + GRACE + 5, detected
  print(f"SIGSTOP: attempt 3 ended {detected:.1f} s later (--heartbeat-timeout {HEARTBEAT})")
  print(f"SIGTERM after step {target_term}: every process stopped after step {stopped}")
  for attempt in (2, 3, 4):
    started = job.when(f"attempt {attempt}: started")
    resumed = job.when(r"\[p0\] resumed from step", after=started)
    if resumed:  # attempt 2 starts afresh if the kill came before the first save was complete
      print(f"attempt {attempt}: resumed {resumed - started:.1f} s after it started")

  # Each restart resumed where it should.
  attempts = re.split(r"zerojax_launch: attempt \d: started", text)[1:]
  resumed = [re.findall(r"\[p0\] resumed from step (\d+)", attempt) for attempt in attempts]
  assert resumed[1] == [str(step) for step in saved_before_kill[-1:]], (resumed, about)
  assert resumed[2] == [str(stopped)], (resumed, stopped, about)
  assert resumed[3] == [str(previous)], (resumed, previous, about)
  assert f"moved to {checkpoints / f'{damaged}.damaged'}. Restored step {previous}" in text
  assert (checkpoints / f"{damaged}.damaged").is_dir()

  # No step lost, none trained on other data: the same losses and parameters, bit for bit.
  lines = logged(out)
  assert sorted({line["step"] for line in lines}) == list(range(1, STEPS + 1))
  assert len(lines) > STEPS  # steps after a checkpoint were trained again ...
  for line in lines:  # ... on the same data
    assert line["loss"] == reference["train_loss"][line["step"] - 1], (line, about)
  final = zerojax.load_params(checkpoints, step=STEPS)
  expected = zerojax.load_params(tmp_path / "ref", step=STEPS)
  chex.assert_trees_all_equal(final, expected, strict=True)


def test_a_crash_inside_the_first_save_then_on_every_attempt(tmp_path, uninterrupted):
  # Attempt 1 is killed while its first save is being written; attempt 2 starts
  # afresh, saves steps 1-3 and raises at step 4, as every attempt would: with
  # --max-restarts 1 the launcher gives up.
  done = run_checkpoint_worker(tmp_path, "kill-in-first-save,raise-at-4", max_restarts=1)
  assert done.returncode == 1
  first, second = done.stdout.split("[p0] start None")[1:]  # neither found a checkpoint
  assert "[p0] killed while writing ['1.orbax-checkpoint-tmp']" in first
  assert "was killed by signal SIGKILL" in done.stderr
  assert "restarting after attempt 1 failed (restart 1 of --max-restarts 1)" in done.stderr
  assert "[p0] saving 3" in second and "RuntimeError: injected fault at step 4" in done.stderr
  assert "giving up: attempt 2 failed and all 1 restart(s) (--max-restarts 1) are used; " in (
    done.stderr
  )
  # The checkpoints are intact (the worker keeps 2, and the partial save is gone):
  # without the fault, the run continues from them to the uninterrupted result.
  assert sorted(os.listdir(tmp_path)) == ["2", "3"]
  done = run_checkpoint_worker(tmp_path, "", max_restarts=0)
  assert done.returncode == 0 and "[p0] start 3" in done.stdout, done.stderr[-3000:]
  chex.assert_trees_all_equal(final_params(tmp_path), uninterrupted, strict=True)
