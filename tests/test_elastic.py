"""Going on with fewer hosts: the batch arithmetic, the data order, and a job that loses a process.

The job: ``examples/train_lm.py`` (tiny model, a global batch of 32, at most 4 sequences per
device) as 2 processes x 4 devices under ``python -m zerojax_launch --max-restarts 3``, with
``tests/lost_host_worker.py`` making process 1 a host lost for good: it vanishes once the first
checkpoint is complete and fails at every start after that. Run with ``--min-processes 2`` the
launcher gives up, naming process 1; resubmitted with ``--min-processes 1`` the job goes on
without it, on 1 process x 4 devices with twice the micro-batches, and finishes.
"""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from examples import train_lm
from examples.lm import data as lm_data
from tests import environment, lm_reference
from tests.environment import ROOT
from tests.helpers import launch_code
from zerojax import launch

WORKER = "tests/lost_host_worker.py"
# Where the docs show which device counts reach the main job's batch.
DOCS = ROOT / "docs" / "fault_tolerance.md"


def test_micro_batches_keep_the_global_batch():
  for devices, per_device, expected in [(8, 4, 1), (4, 4, 2), (2, 4, 4), (1, 4, 8), (16, 4, 1)]:
    microbatches = zerojax.distributed.elastic_microbatches(32, devices, per_device)
    assert microbatches == expected, devices
    assert 32 // (devices * microbatches) <= per_device
  # The fewest micro-batches whose per-device share is whole and small enough: 6 = 3 x 2.
  assert zerojax.distributed.elastic_microbatches(12, 2, max_per_device=4) == 2
  assert zerojax.distributed.elastic_microbatches(12, 2, max_per_device=5) == 2
  assert zerojax.distributed.elastic_microbatches(12, 2, max_per_device=6) == 1


def test_a_device_count_that_cannot_reach_the_batch_is_refused_with_those_that_can():
  with pytest.raises(ValueError, match=r"cannot be split evenly over 3 devices") as refused:
    zerojax.distributed.elastic_microbatches(32, 3, 4)
  assert "The device counts that reach it: 1, 2, 4, 8, 16, 32." in str(refused.value)
  for bad in [(0, 8, 4), (32, 0, 4), (32, 8, 0)]:
    with pytest.raises(ValueError, match="must be a whole number of at least 1"):
      zerojax.distributed.elastic_microbatches(*bad)


def test_the_docs_table_of_device_counts_is_the_helpers():
  # The main job: examples/train_lm.py's default (small) model, a batch of 32 on 8 devices.
  table = re.search(r"\| devices \| micro-batches .*?\n\n", DOCS.read_text(), re.DOTALL).group(0)
  rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in table.split("\n")[2:-2]]
  documented = {int(devices): int(micro) for devices, micro, _ in rows if micro.isdigit()}
  refused = [int(devices) for devices, micro, _ in rows if not micro.isdigit()]
  assert documented == zerojax.distributed.elastic_device_counts(32, max_per_device=4)
  for devices, micro, per_device in rows:
    if micro.isdigit():
      assert int(per_device) * int(devices) * int(micro) == 32, devices
  for devices in refused:
    with pytest.raises(ValueError):
      zerojax.distributed.elastic_microbatches(32, devices, 4)


def config_and_mesh(devices: int):
  args = train_lm.build_parser().parse_args([*lm_reference.FLAGS, "--devices", str(devices)])
  config = train_lm.make_config(args, multi_process=False)
  return config, jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])


def test_eight_devices_and_four_with_two_micro_batches_see_the_same_samples_every_step():
  # What each call of the loss sees, through train_lm's data and zerojax.value_and_grad: the
  # calls' inputs stacked in batch order (aux), per step.
  seen = {}
  for devices in (8, 4):
    config, mesh = config_and_mesh(devices)
    tx = zerojax.zero3(optax.sgd(0.1), mesh=mesh)
    params = tx.shard({"w": jnp.zeros((8,))})

    def loss(params, x, y):
      return jnp.mean(params["w"]) + jnp.mean((x - y) * 0.0), x

    grad = jax.jit(zerojax.value_and_grad(loss, tx, has_aux=True, microbatches=config.microbatches))
    batches = lm_data.Batches(config, mesh)
    seen[devices] = [np.asarray(grad(params, *batches.train(step))[0][1]) for step in range(1, 13)]
    assert (config.microbatches, config.device_batch) == ({8: 1, 4: 2}[devices], 4)
  for step, (eight, four) in enumerate(zip(seen[8], seen[4], strict=True), start=1):
    # 8 calls of 4 sequences each way: 8 devices x 1, or 4 devices x 2 micro-batches.
    assert eight.shape == four.shape == (8, 4, 32), step
    np.testing.assert_array_equal(eight, four, err_msg=f"step {step}")
  assert not np.array_equal(seen[8][0], seen[8][1])  # and the steps do differ


def launch_elastic(code: str, **options) -> tuple[int, str]:
  """``python -c code`` as 2 processes under the launcher, restarts allowed: status and messages."""
  return launch_code(code, **{"max_restarts": 3, "min_processes": 1, **options})


# Python run by each process: its id, its attempt, and a place to leave marks for the other.
PREAMBLE = (
  "import os, pathlib, signal, sys, time\n"
  "me, attempt = os.environ['ZEROJAX_PROCESS_ID'], int(os.environ['ZEROJAX_ATTEMPT'])\n"
)


def test_failures_of_different_processes_or_a_preemption_between_them_do_not_shrink():
  # Attempts 1-3 fail because of processes 1, 0, 1; attempt 4 is preempted, attempt 5 fails
  # because of process 1 and attempt 6 succeeds: nobody ended two in a row.
  code = PREAMBLE + (
    "culprit = {1: '1', 2: '0', 3: '1', 5: '1'}.get(attempt)\n"
    "sys.exit(75 if attempt == 4 else 3 if me == culprit else 0 if attempt == 6 else "
    "time.sleep(30))\n"
  )
  status, err = launch_elastic(code, max_restarts=4)
  assert status == 0, err
  assert "shrinking" not in err and "counts as lost" not in err
  assert "attempt 6: started 2 process(es)" in err


def test_the_first_process_to_fail_is_blamed_not_the_lowest_numbered(tmp_path):
  # Process 1 exits first; process 0 follows as soon as the launcher has reaped it (its
  # /proc entry is gone), well before the launcher's next look (every 50 ms), so that the
  # look finds both exited: process 1 is the one that ends both attempts, and is dropped.
  code = PREAMBLE + (
    f"mark = pathlib.Path({str(tmp_path)!r}) / str(attempt)\n"
    "if attempt == 3: sys.exit(0)\n"
    "if me == '1': mark.write_text(str(os.getpid())); sys.exit(3)\n"
    "while not mark.exists() or not mark.read_text(): time.sleep(0.001)\n"
    "while pathlib.Path('/proc', mark.read_text()).exists(): time.sleep(0.001)\n"
    "sys.exit(4)\n"
  )
  status, err = launch_elastic(code)
  assert status == 0, err
  assert "process 1 (pid" in err and "exited with code 3; stopping" in err
  assert "shrinking from 2 to 1 process(es): process 1 ended attempts 1 and 2 in a row" in err


def test_a_stopped_process_is_blamed_not_the_one_that_failed_waiting_for_it(tmp_path):
  # Process 0 stops (a frozen host); process 1 then fails, as the JAX distributed service
  # makes it when a peer goes silent. Process 0 ends the attempt, twice, and is dropped.
  code = PREAMBLE + (
    f"mark = pathlib.Path({str(tmp_path)!r}) / str(attempt)\n"
    "if attempt == 3: sys.exit(0)\n"
    "if me == '0': mark.touch(); os.kill(os.getpid(), signal.SIGSTOP)\n"
    "while not mark.exists(): time.sleep(0.01)\n"
    "time.sleep(0.3)\n"
    "sys.exit(1)\n"
  )
  status, err = launch_elastic(code, grace_period=1)
  assert status == 0, err
  assert "is stopped (SIGSTOP or SIGTSTP)" in err
  assert "shrinking from 2 to 1 process(es): process 0 ended attempts 1 and 2 in a row" in err


def test_launcher_refuses_a_minimum_it_cannot_keep():
  # Its command line's refusals are in test_cli_errors.py.
  with pytest.raises(ValueError, match="min_processes must be between 1 and num_processes"):
    launch.launch(["true"], num_processes=2, min_processes=3)


def run_job(checkpoints: Path, out: Path, min_processes: int) -> tuple[int, str, float]:
  """The 2 x 4 job with ``--min-processes``: its status, its output, and its seconds."""
  begin = time.monotonic()
  done = subprocess.run(
    [
      *(sys.executable, "-m", "zerojax_launch", "-n", "2", "--devices-per-process", "4"),
      *("--max-restarts", "3", "--min-processes", str(min_processes), "--grace-period", "2"),
      *("--timeout", "300", WORKER, str(checkpoints), *lm_reference.FLAGS),
      *("--save-every", "5", "--resume", "--out", str(out)),
    ],
    cwd=ROOT,
    env=environment.subprocess_env(),
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    timeout=400,
  )
  return done.returncode, done.stdout, time.monotonic() - begin


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
  """The job with ``--min-processes 2``, then resubmitted with ``--min-processes 1``."""
  checkpoints, out = tmp_path_factory.mktemp("ckpt"), tmp_path_factory.mktemp("out")
  strict = run_job(checkpoints, out, min_processes=2)
  elastic = run_job(checkpoints, out, min_processes=1)
  for minimum, (_, text, seconds) in [(2, strict), (1, elastic)]:
    (out / f"min{minimum}.log").write_text(text)
    print(f"--min-processes {minimum}: {seconds:.1f} s")
  return {"strict": strict, "elastic": elastic, "out": out}


def test_without_enough_processes_left_the_job_stops_naming_the_lost_one(jobs):
  status, text, _ = jobs["strict"]
  assert status != 0, text[-3000:]
  assert "[p0] tiny model" in text and "8 cpu devices (mesh data=8) in 2 processes" in text
  assert "[p1] tiny model" not in text and "[p1] step" not in text  # process 0 reports
  assert "process 1 (pid" in text and "was killed by signal SIGKILL" in text  # vanished
  assert "restarting after attempt 1 failed (restart 1 of --max-restarts 3)" in text
  assert "lost_host_worker: process 1 is a host lost for good" in text  # and cannot start
  assert (
    "giving up: process 1 ended attempts 1 and 2 in a row, so it counts as lost, and without it "
    "1 process(es) would remain, fewer than --min-processes 2; exit status 1." in text
  )
  assert "attempt 3" not in text


def test_with_fewer_allowed_the_job_goes_on_without_the_lost_process(jobs):
  status, text, _ = jobs["elastic"]
  assert status == 0, text[-3000:]
  assert (
    "shrinking from 2 to 1 process(es): process 1 ended attempts 1 and 2 in a row, so it counts "
    "as lost; restarting without it (restart 2 of --max-restarts 3, --min-processes 1)" in text
  )
  assert "attempt 3: started 1 process(es)" in text and "attempt 4" not in text
  # The restarted run reports its mesh, and keeps the batch with twice the micro-batches.
  resumed = re.search(r"\[p0\] resumed from step (\d+) in .* onto mesh data=4 \(4 devices", text)
  assert resumed, text[-3000:]
  assert "batch 32 = 4 per device x 4 x 2 micro-batches" in text
  metrics = json.loads((jobs["out"] / "metrics.json").read_text())
  assert (metrics["config"]["devices"], metrics["config"]["microbatches"]) == (4, 2)

  # Every step trained, on the batches of an uninterrupted run: the same losses up to the
  # checkpoint (2 x 4 trains like 1 x 8), and after it within 1e-3 (sums in another order).
  reference = lm_reference.eight_devices()["train_loss"]
  lines = [json.loads(line) for line in (jobs["out"] / "losses.jsonl").read_text().splitlines()]
  assert sorted({line["step"] for line in lines}) == list(range(1, 13))
  saved = int(resumed.group(1))
  for line in lines:
    tolerance = 1e-6 if line["step"] <= saved else 1e-3
    np.testing.assert_allclose(line["loss"], reference[line["step"] - 1], rtol=tolerance)
  last = lines[-1]
  assert last["step"] == 12
  print(f"last loss {last['loss']!r}, uninterrupted {reference[-1]!r}")
