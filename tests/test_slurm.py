"""SLURM for real: srun and sbatch on the one-node cluster that .ci/slurm_up.sh stands up.

1. ``srun -n 2 python examples/train_lm.py --detect-cluster`` (2 processes x 4 CPU devices;
   JAX reads SLURM_* itself) trains like 1 process x 8 devices.
2. ``examples/slurm/train.sbatch``, the batch script docs/multiprocess.md shows, runs to
   completion under ``sbatch --wait``, on 2 tasks of 1 CPU device.
3. That job is preempted as SLURM does it: ``scancel --signal=TERM`` sends SIGTERM to its tasks,
   which save and exit with 75; the script requeues the job, the requeued job resumes from the
   saved step and ends bit for bit where this process, training the same steps on 2 devices
   without a break, ends.

Where ``sinfo`` is missing or the cluster does not answer these tests skip, saying why; under
CI (``CI`` set, as CI does when it runs .ci/run, which stands the cluster up first) they fail
instead: the recipe users copy must be the one that is tested. The batch logs are checked for
plain progress lines (no progress bar in a file); a test here shows the bar stays on terminals.
"""

import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import chex
import numpy as np
import pytest

import zerojax
from examples import train_lm
from examples.lm import configs, report
from tests import environment, lm_reference
from tests.environment import ROOT

SBATCH = "examples/slurm/train.sbatch"
# The sbatch job: 2 tasks of 1 device, 40 steps of the tiny model, a checkpoint every 5.
JOB_STEPS = 40
JOB_FLAGS = [
  *("--model", "tiny", "--steps", str(JOB_STEPS), "--batch-size", "8", "--seq-len", "32"),
  *("--save-every", "5", "--keep", "100", "--eval-every", str(JOB_STEPS), "--no-report"),
  *("--log-every", "10"),
]


def cluster_problem() -> str | None:
  """Why the SLURM tests cannot run here, or ``None``."""
  if shutil.which("sinfo") is None:
    return "sinfo is missing: SLURM is not installed (as root, .ci/slurm_up.sh stands one up)"
  done = subprocess.run(
    ["sinfo", "--noheader", "--format=%T"], capture_output=True, text=True, timeout=60
  )
  states = done.stdout.split()
  if done.returncode or not {"idle", "mixed", "allocated"} & set(states):
    return (
      f"SLURM does not answer with a usable node (sinfo: {done.stdout.strip() or 'nothing'}; "
      f"{done.stderr.strip()}); as root, .ci/slurm_up.sh starts it"
    )
  return None


def require_slurm() -> None:
  """Skips the calling test where SLURM cannot run it, saying why; under CI, fails instead."""
  problem = cluster_problem()
  if problem and os.environ.get("CI", "").lower() not in ("", "0", "false"):
    pytest.fail(f"under CI the SLURM tests must run, but {problem}")
  if problem:
    pytest.skip(problem)


@pytest.fixture(scope="module")
def slurm():
  require_slurm()


def test_without_slurm_the_tests_skip_saying_why_and_under_ci_they_fail(monkeypatch, tmp_path):
  monkeypatch.setenv("PATH", str(tmp_path))  # no sinfo there
  monkeypatch.delenv("CI", raising=False)
  with pytest.raises(pytest.skip.Exception, match="sinfo is missing: SLURM is not installed"):
    require_slurm()
  monkeypatch.setenv("CI", "true")
  with pytest.raises((pytest.fail.Exception, pytest.skip.Exception)) as stopped:
    require_slurm()
  assert stopped.type is pytest.fail.Exception  # not skipped
  assert "under CI the SLURM tests must run, but sinfo is missing" in str(stopped.value)


def job_env(devices_per_process: int) -> dict[str, str]:
  """The environment srun and sbatch pass on to the tasks (sbatch's --export=ALL).

  This process's, XLA flags included (the same compiler settings, so that the same steps give
  the same bits), with the tasks' device count instead of 8.
  """
  return environment.subprocess_env(devices=devices_per_process, JAX_PLATFORMS="cpu")


def assert_plain_progress(log: str, last_step: int) -> None:
  """A batch log has progress lines, and no progress bar (carriage returns)."""
  assert "\r" not in log
  assert f"step {last_step}/{last_step}: loss " in log, log[-2000:]


def test_srun_two_processes_find_each_other_and_train_like_one(slurm, tmp_path):
  # With the end-of-run report (memory table, sample, metrics.json and loss.png), which reads
  # rows that each process holds only part of.
  flags = [flag for flag in lm_reference.FLAGS if flag != "--no-report"]
  begin = time.monotonic()
  done = subprocess.run(
    [
      *("srun", "--ntasks=2", "--kill-on-bad-exit=1", "--time=10", sys.executable),
      *("examples/train_lm.py", "--detect-cluster", *flags, "--out", str(tmp_path)),
    ],
    cwd=ROOT,
    env=job_env(devices_per_process=4),
    capture_output=True,
    text=True,
    timeout=300,
  )
  print(f"srun -n 2: {time.monotonic() - begin:.1f} s")
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
  assert "8 cpu devices (mesh data=8) in 2 processes" in done.stdout
  assert_plain_progress(done.stdout + done.stderr, last_step=12)
  assert done.stdout.count("sample:\ndef ") == 1 and done.stdout.count("wrote ") == 1
  two = json.loads((tmp_path / "metrics.json").read_text())
  assert two["sample"].startswith("def ") and (tmp_path / "loss.png").is_file()
  one = lm_reference.eight_devices()
  assert two["config"]["devices"] == one["config"]["devices"] == 8
  np.testing.assert_allclose(two["train_loss"], one["train_loss"], rtol=1e-6)


def logged(out: Path) -> list[dict]:
  path = out / "losses.jsonl"
  return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def job_state(job: str) -> str:
  """``PENDING``, ``RUNNING``, ... (``gone`` once SLURM has forgotten the job)."""
  done = subprocess.run(["scontrol", "show", "job", "--oneliner", job], capture_output=True)
  found = re.search(r"JobState=(\S+)", done.stdout.decode())
  return found.group(1) if found else "gone"


def wait_for(condition, what: str, job: subprocess.Popen, log: Path, timeout: float = 180):
  deadline = time.monotonic() + timeout
  while not condition():
    text = log.read_text() if log.exists() else ""
    assert job.poll() is None, f"sbatch ended waiting for {what}:\n{text[-4000:]}"
    assert time.monotonic() < deadline, f"no {what} after {timeout} s:\n{text[-4000:]}"
    time.sleep(0.1)


def test_the_batch_script_is_preempted_requeued_and_ends_as_if_never_stopped(slurm, tmp_path):
  out, checkpoints, log = tmp_path / "out", tmp_path / "ckpt", tmp_path / "job.log"
  begin = time.monotonic()
  job = subprocess.Popen(
    [
      *("sbatch", "--wait", "--parsable", "--nodes=1", "--ntasks-per-node=2"),
      *("--gpus-per-node=0", "--time=15", f"--output={log}", SBATCH, *JOB_FLAGS),
      *("--checkpoint-dir", str(checkpoints), "--out", str(out)),
    ],
    cwd=ROOT,
    env=job_env(devices_per_process=1),
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    job_id = job.stdout.readline().strip().split(";")[0]
    # SIGTERM to every task, as SLURM sends it to a preempted job or at --signal=TERM@120.
    wait_for(lambda: len(logged(out)) >= 8, "step 8", job, log)
    subprocess.run(["scancel", "--signal=TERM", job_id], check=True, timeout=60)
    signalled = logged(out)[-1]["step"]
    # The script requeues the job, which starts again once its old credentials expire (5 s on
    # this cluster, AuthInfo=cred_expire; SLURM's default is 120) and ends; so does sbatch.
    wait_for(lambda: job_state(job_id) == "PENDING", "the requeued job", job, log)
    requeued = time.monotonic()
    status = job.wait(timeout=300)
  finally:
    if job.poll() is None:
      subprocess.run(["scancel", job_id], timeout=60)
      job.kill()
    job.communicate()
  text = log.read_text()
  seconds = time.monotonic() - begin
  print(f"sbatch job {job_id}: {seconds:.1f} s, requeued at {requeued - begin:.1f} s")
  assert status == 0, text[-4000:]

  # 2. The batch script ran to completion, and its log reads as a log.
  assert_plain_progress(text, last_step=JOB_STEPS)
  assert re.search(rf"checkpoints \[5, .*, {JOB_STEPS}\] in {checkpoints}", text)

  # 3. Stopped after one step on both tasks, saved, requeued, resumed from that step.
  stopped = int(re.search(r"preempted: stopped after step (\d+) \(saved it to", text).group(1))
  # JAX spreads the notice in the background: a few more short steps may finish first.
  assert signalled <= stopped < JOB_STEPS, (signalled, stopped)
  assert (checkpoints / str(stopped)).is_dir()
  assert f"attempt 1 was preempted and saved; requeueing job {job_id}" in text
  assert f"job {job_id} on " in text and ", run 2" in text
  assert f"resumed from step {stopped} in {checkpoints} onto mesh data=2" in text

  # Bit for bit what 2 devices trained without a break give: every logged loss (the steps
  # after the save are not trained twice) and the final parameters.
  reference = train_lm.main(
    [
      *JOB_FLAGS,
      "--devices",
      "2",
      "--checkpoint-dir",
      str(tmp_path / "ref"),
      "--out",
      str(tmp_path),
    ]
  )
  lines = logged(out)
  assert [line["step"] for line in lines] == list(range(1, JOB_STEPS + 1))
  assert [line["loss"] for line in lines] == reference["train_loss"]
  final = zerojax.load_params(checkpoints, step=JOB_STEPS)
  expected = zerojax.load_params(tmp_path / "ref", step=JOB_STEPS)
  chex.assert_trees_all_equal(final, expected, strict=True)


class Terminal(io.StringIO):
  """A stream that says it is a terminal."""

  def isatty(self) -> bool:
    return True


def run_progress(stderr: io.StringIO, steps: int, log_every: int, monkeypatch) -> str:
  """What ``report.Progress`` prints for ``steps`` steps, stdout and stderr together."""
  args = train_lm.build_parser().parse_args(["--model", "tiny", "--log-every", str(log_every)])
  config = train_lm.make_config(args, multi_process=False)
  config = configs.dataclasses.replace(config, steps=steps)
  stdout = io.StringIO()
  monkeypatch.setattr(sys, "stdout", stdout)
  monkeypatch.setattr(sys, "stderr", stderr)
  progress = report.Progress(config, first_step=1, enabled=True)
  for step in range(1, steps + 1):
    progress.step(step, {"loss": f"{10 - step / 10:.3f}"})
  progress.write("step 25: a validation line")
  progress.close()
  return stdout.getvalue() + stderr.getvalue()


def test_a_batch_log_gets_plain_lines_and_a_terminal_keeps_the_bar(monkeypatch):
  plain = run_progress(io.StringIO(), steps=25, log_every=10, monkeypatch=monkeypatch)
  assert plain.splitlines() == [
    "step 1/25: loss 9.900",
    "step 10/25: loss 9.000",
    "step 20/25: loss 8.000",
    "step 25/25: loss 7.500",
    "step 25: a validation line",
  ]
  bar = run_progress(Terminal(), steps=25, log_every=10, monkeypatch=monkeypatch)
  assert "\r" in bar and "25/25" in bar and "loss=7.500" in bar
  assert "step 25: a validation line" in bar and "step 10/25" not in bar
