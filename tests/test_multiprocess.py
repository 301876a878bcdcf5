"""Multi-process runs: 2 processes x 4 CPU devices against this 1 process x 8, and the launcher.

The 2-process job runs ``tests/multiprocess_worker.py`` under ``python -m
zerojax_launch`` on loopback; this process runs the same worker function on its
own 8 devices. Each writes what it saw, and the tests compare.
"""

import io
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import chex
import jax
import numpy as np
import optax
import pytest

from tests import environment, models, multiprocess_worker
from tests.environment import ROOT
from tests.helpers import ROUNDING, launch_code
from zerojax import launch
from zerojax_launch import launcher as launch_lib

WORKER = "tests/multiprocess_worker.py"
STAGES = (1, 2, 3)


def run_launcher(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
  """``python -m zerojax_launch ARGS`` from the repository root."""
  env = environment.subprocess_env()
  return subprocess.run(
    [sys.executable, "-m", "zerojax_launch", *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def load(out: Path, process: int):
  with np.load(out / f"p{process}.npz") as arrays:
    return dict(arrays), json.loads((out / f"p{process}.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """``{1: [process 0's results], 2: [process 0's, process 1's]}``.

  This process trains first and saves a checkpoint; the 2-process job restores
  it (1 -> 2) and saves its own, which this process then restores (2 -> 1).
  """
  one, two = tmp_path_factory.mktemp("1x8"), tmp_path_factory.mktemp("2x4")
  multiprocess_worker.train(one)
  done = run_launcher(
    "-n", "2", "--devices-per-process", "4", "--timeout", "120", WORKER, "train", str(two), str(one)
  )
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
  arrays, report = load(one, 0)
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  arrays.update(multiprocess_worker.restore_from(mesh, two))
  return {1: [(arrays, report)], 2: [load(two, 0), load(two, 1)]}


def under(prefix: str, arrays: dict) -> dict:
  """The arrays a worker saved under ``prefix`` (there must be some)."""
  selected = {key: value for key, value in arrays.items() if key.startswith(prefix)}
  assert selected, f"nothing saved under {prefix}"
  return selected


@pytest.mark.parametrize("stage", STAGES)
def test_two_processes_train_like_one(runs, stage):
  (one_arrays, one), (two_arrays, two) = runs[1][0], runs[2][0]
  assert (one["process_count"], two["process_count"]) == (1, 2)
  np.testing.assert_allclose(
    two["stages"][str(stage)]["losses"], one["stages"][str(stage)]["losses"], rtol=0, atol=1e-6
  )
  chex.assert_trees_all_close(
    under(f"{stage}/to_zero", two_arrays), under(f"{stage}/to_zero", one_arrays), rtol=0, atol=1e-6
  )


@pytest.mark.parametrize("stage", STAGES)
def test_two_processes_train_like_one_under_hybrid_sharding(runs, stage):
  # A replica per process, the data axis inside each: equal to one process of
  # 8 devices on the same mesh, and to the flat 8-device mesh within rounding.
  (one_arrays, one), (two_arrays, two) = runs[1][0], runs[2][0]
  np.testing.assert_allclose(
    two["stages"][str(stage)]["hybrid_losses"],
    one["stages"][str(stage)]["hybrid_losses"],
    rtol=0,
    atol=1e-6,
  )
  chex.assert_trees_all_close(
    under(f"hybrid/{stage}/to_all", two_arrays),
    under(f"hybrid/{stage}/to_all", one_arrays),
    rtol=0,
    atol=1e-6,
  )
  flat = {k.replace(f"{stage}/to_zero", f"hybrid/{stage}/to_all"): v for k, v in one_arrays.items()}
  chex.assert_trees_all_close(
    under(f"hybrid/{stage}/to_all", one_arrays),
    under(f"hybrid/{stage}/to_all", flat),
    rtol=0,
    atol=2e-5,
  )


def test_two_processes_train_like_one_with_quantized_communication(runs):
  # Hybrid stage 3 with int8 gathers and reductions, the replica axis across
  # the processes: the same codes move, so the same numbers come out; and they
  # stay within quantization's error of the unquantized run.
  (one_arrays, one), (two_arrays, two) = runs[1][0], runs[2][0]
  np.testing.assert_allclose(
    two["stages"]["3"]["quantized_losses"], one["stages"]["3"]["quantized_losses"], atol=1e-6
  )
  chex.assert_trees_all_close(
    under("quantized/3/to_all", two_arrays),
    under("quantized/3/to_all", one_arrays),
    rtol=0,
    atol=1e-6,
  )
  plain = {k.replace("hybrid/3", "quantized/3"): v for k, v in one_arrays.items()}
  chex.assert_trees_all_close(
    under("quantized/3/to_all", one_arrays), under("quantized/3/to_all", plain), rtol=0, atol=5e-3
  )
  assert one["stages"]["3"]["quantized_losses"][1:] != one["stages"]["3"]["hybrid_losses"][1:]


def test_two_processes_train_like_one_with_the_optimizer_state_in_host_memory(runs):
  # Hybrid stage 3 with offload="optimizer": the same numbers on 2 processes as
  # on one, and, on each, the numbers of the same run without offload (another
  # program, so to rounding).
  (one_arrays, one), (two_arrays, two) = runs[1][0], runs[2][0]
  for arrays, report in (*runs[1], *runs[2]):
    stage3 = report["stages"]["3"]
    assert stage3["offloaded_state_in"] == ["pinned_host"]
    chex.assert_trees_all_close(stage3["offloaded_losses"], stage3["hybrid_losses"], **ROUNDING)
    plain = {k.replace("hybrid/3", "offloaded/3"): v for k, v in arrays.items()}
    chex.assert_trees_all_close(
      under("offloaded/3/to_all", arrays), under("offloaded/3/to_all", plain), **ROUNDING
    )
  np.testing.assert_allclose(
    two["stages"]["3"]["offloaded_losses"], one["stages"]["3"]["offloaded_losses"], atol=1e-6
  )
  chex.assert_trees_all_close(
    under("offloaded/3/to_all", two_arrays),
    under("offloaded/3/to_all", one_arrays),
    rtol=0,
    atol=1e-6,
  )


def test_two_processes_train_like_one_with_hpz(runs):
  # Stage 3 over (node, data), a node per process: the same numbers on 2 processes as on
  # one, with hpZ as without it (to rounding); hpZ's only all-gathers between the processes
  # gather each device's secondary partition, in the forward pass.
  (one_arrays, one), (two_arrays, two) = runs[1][0], runs[2][0]
  for name in ("full", "hpz"):
    np.testing.assert_allclose(
      two["stages"]["3"][f"{name}_losses"], one["stages"]["3"][f"{name}_losses"], atol=1e-6
    )
    chex.assert_trees_all_close(
      under(f"{name}/3/to_all", two_arrays), under(f"{name}/3/to_all", one_arrays), atol=1e-6
    )
    assert two["stages"]["3"][f"{name}_bytes"] == one["stages"]["3"][f"{name}_bytes"]
  full = {k.replace("full/3", "hpz/3"): v for k, v in one_arrays.items()}
  chex.assert_trees_all_close(
    under("hpz/3/to_all", one_arrays), under("hpz/3/to_all", full), **ROUNDING
  )
  hpz, plain = two["stages"]["3"]["hpz_bytes"], two["stages"]["3"]["full_bytes"]
  assert "all-gather" not in hpz["node data"] and "all-gather" in plain["node data"]
  assert set(hpz["node"]) == {"all-gather"}
  whole = hpz["data"]["all-gather"]  # forward and backward, inside the process
  assert whole == plain["node data"]["all-gather"] and 4 * hpz["node"]["all-gather"] < whole


@pytest.mark.parametrize("stage", STAGES)
def test_two_processes_train_like_one_on_the_drop_in_path(runs, stage):
  (one_arrays, one), (two_arrays, two) = runs[1][0], runs[2][0]
  np.testing.assert_allclose(
    two["stages"][str(stage)]["drop_in_losses"],
    one["stages"][str(stage)]["drop_in_losses"],
    rtol=0,
    atol=1e-6,
  )
  chex.assert_trees_all_close(
    under(f"drop-in/{stage}/to_all", two_arrays),
    under(f"drop-in/{stage}/to_all", one_arrays),
    rtol=0,
    atol=1e-6,
  )
  # And the drop-in path trains like the explicit one.
  explicit = {
    k.replace(f"{stage}/to_zero", f"drop-in/{stage}/to_all"): v for k, v in one_arrays.items()
  }
  chex.assert_trees_all_close(
    under(f"drop-in/{stage}/to_all", one_arrays),
    under(f"drop-in/{stage}/to_all", explicit),
    rtol=0,
    atol=2e-5,
  )


def test_global_batch_joins_the_processes_rows_in_order(runs):
  for arrays, _ in (*runs[1], *runs[2]):
    chex.assert_trees_all_equal(
      under("batch", arrays), under("batch", multiprocess_worker.flat("batch", models.make_batch()))
    )


def test_one_process_trains_like_plain_optax(runs):
  arrays, _ = runs[1][0]
  expected = models.reference(
    optax.adam(1e-2), models.make_params(), models.make_batch(), multiprocess_worker.STEPS
  )
  expected = multiprocess_worker.flat("3/to_zero", expected)
  chex.assert_trees_all_close(under("3/to_zero", arrays), expected, **ROUNDING)


@pytest.mark.parametrize("stage", STAGES)
def test_gathers_agree_and_reach_only_their_process(runs, stage):
  (first, first_report), (second, second_report) = runs[2]
  chex.assert_trees_all_equal(under(f"{stage}/to_all", second), under(f"{stage}/to_all", first))
  for arrays in (first, second):
    to_all = {k.replace("to_all", "tx.gather"): v for k, v in arrays.items() if "/to_all" in k}
    chex.assert_trees_all_equal(
      under(f"{stage}/tx.gather", to_all), under(f"{stage}/tx.gather", arrays)
    )
  renamed = {k.replace("to_zero", "to_all"): v for k, v in first.items()}
  chex.assert_trees_all_equal(under(f"{stage}/to_all", renamed), under(f"{stage}/to_all", first))
  assert first_report["stages"][str(stage)]["received_to_zero"]
  assert not second_report["stages"][str(stage)]["received_to_zero"]
  assert not [k for k in second if "to_zero" in k]


@pytest.mark.parametrize("stage", STAGES)
def test_profile_is_the_same_per_device(runs, stage):
  one, two = runs[1][0][1]["stages"][str(stage)], runs[2][0][1]["stages"][str(stage)]
  assert two["argument_bytes"] == one["argument_bytes"]
  assert two["collectives"] == one["collectives"]
  assert two["collectives"]["reduce-scatter"][0] > 0


def test_checkpoints_move_between_one_and_two_processes(runs):
  one, two = runs[1][0][0], runs[2][0][0]
  # Saved by this process, restored by the 2-process job; and back.
  restored_by_two = {k.replace("restored", "saved"): v for k, v in two.items()}
  chex.assert_trees_all_equal(
    under("checkpoint/saved", restored_by_two), under("checkpoint/saved", one)
  )
  restored_by_one = {k.replace("restored", "saved"): v for k, v in one.items()}
  chex.assert_trees_all_equal(
    under("checkpoint/saved", restored_by_one), under("checkpoint/saved", two)
  )


def test_global_batch_names_what_is_wrong(runs):
  for process in (0, 1):
    errors = runs[2][process][1]["errors"]
    assert "must divide by the 4 devices this process has" in errors["indivisible"]
    assert "process(es) [1] passed another structure, shapes or dtypes" in errors["mismatch"]
    assert (
      f"Process {process} passed {{(root): ({4 * (1 + process)}, 3) float32}}"
      in (errors["mismatch"])
    )


def test_processes_with_different_models_are_refused_before_a_collective_of_them(runs):
  # Without the check, placing parameters of different sizes aborts in gloo ("Received data
  # size doesn't match") on one process and leaves the other to the heartbeat timeout.
  for process in (0, 1):
    error = runs[2][process][1]["errors"]["models"]
    assert "the processes' parameters differ: process(es) [1] passed another structure" in error
    assert "Every process must build the same model" in error
    assert f"Process {process} passed {{['w']: (4, {1024 * (1 + process)}) float32}}" in error


def started_alone(process_id: int, port: int, *args: str, **env: str) -> subprocess.Popen:
  """``python ARGS`` as process ``process_id`` of 2 at ``127.0.0.1:port``, started on its own."""
  variables = {
    "ZEROJAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
    "ZEROJAX_NUM_PROCESSES": "2",
    "ZEROJAX_PROCESS_ID": str(process_id),
    "JAX_PLATFORMS": "cpu",
    **env,
  }
  return subprocess.Popen(
    [sys.executable, *args],
    cwd=ROOT,
    env=environment.subprocess_env(**variables),
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )


def test_a_process_whose_peer_never_starts_says_what_it_waits_for_and_exits():
  # ZEROJAX_INITIALIZATION_TIMEOUT of 3 s instead of 300: each process is started without its
  # peer (on ports of their own), says what it waits for, then names who is missing and exits
  # with initialize's status, instead of a silent wait and JAX's C++ abort.
  code = "import zerojax; zerojax.distributed.initialize(); print('joined')"
  ports = launch_lib.free_port(), launch_lib.free_port()
  begin = time.monotonic()
  alone = [
    started_alone(p, port, "-c", code, ZEROJAX_INITIALIZATION_TIMEOUT="3")
    for p, port in enumerate(ports)
  ]
  errors = [process.communicate(timeout=60)[1] for process in alone]
  # initialize's NOT_JOINED_EXIT_CODE, 3 (docs/fault_tolerance.md's exit statuses).
  assert [process.returncode for process in alone] == [3, 3]
  for process, (port, err) in enumerate(zip(ports, errors, strict=True)):
    assert (
      f"zerojax.distributed.initialize: process {process} of 2 is waiting for the others to join "
      f"at 127.0.0.1:{port} (up to initialization_timeout=3 s)." in err
    )
    assert f"waited initialization_timeout=3 s at 127.0.0.1:{port}, and " in err
    assert "Check failure stack trace" not in err
  assert "process 1 never joined" in errors[0]
  assert "process 0, the coordinator, never started there (nothing listens at" in errors[1]
  assert time.monotonic() - begin < 40


def test_train_lm_processes_with_different_flags_are_refused():
  # Their models differ, and so would the sizes of every collective between them.
  port = launch_lib.free_port()
  flags = ["examples/train_lm.py", "--steps", "2", "--no-report", "--model"]
  started = [started_alone(p, port, *flags, model) for p, model in enumerate(("tiny", "small"))]
  errors = [process.communicate(timeout=90)[1] for process in started]
  assert [process.returncode for process in started] == [2, 2], errors
  for process, (model, err) in enumerate(zip(("tiny", "small"), errors, strict=True)):
    assert (
      "train_lm.py: error: process(es) [1] were started with other flags than process 0, and "
      f"every process of a run needs the same ones; process {process} has: --steps 2 "
      f"--no-report --model {model}" in err
    ), err


def test_train_lm_under_the_launcher_ends_with_its_report(tmp_path):
  # The README's multi-process command, small: each process holds only its devices' sampled
  # rows, and process 0 prints the report and writes its files, once.
  done = run_launcher(
    *("-n", "2", "--devices-per-process", "1", "examples/train_lm.py", "--model", "tiny"),
    *("--steps", "2", "--batch-size", "8", "--seq-len", "32", "--out", str(tmp_path)),
  )
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
  assert done.stdout.count("sample:\n") == 1 and "[p0] sample:\n[p0] def " in done.stdout
  assert done.stdout.count(f"wrote {tmp_path}/metrics.json and {tmp_path}/loss.png") == 1
  assert json.loads((tmp_path / "metrics.json").read_text())["sample"].startswith("def ")
  assert (tmp_path / "loss.png").stat().st_size > 0


def test_launcher_stops_everyone_when_one_process_dies():
  # Killed, process 1 leaves process 0 running: the launcher stops it and exits as the killed
  # process did. (Process 0 blocked in a collective on its lost peer, with restarts:
  # tests/test_fault_tolerance.py's kill.)
  code = "import os, signal, time; p = os.environ['ZEROJAX_PROCESS_ID']; "
  code += "os.kill(os.getpid(), signal.SIGKILL) if p == '1' else time.sleep(60)"
  begin = time.monotonic()
  status, err = launch_code(code)
  assert status == 128 + signal.SIGKILL, err
  assert "process 1 (pid" in err and "was killed by signal SIGKILL" in err
  assert time.monotonic() - begin < 30


def test_launcher_reports_the_first_failure():
  code = "import os, sys, time; p = os.environ['ZEROJAX_PROCESS_ID']; "
  code += "sys.exit(3) if p == '1' else time.sleep(60)"
  begin = time.monotonic()
  status, err = launch_code(code, num_processes=3)
  assert status == 3
  assert "process 1 (pid" in err and "exited with code 3" in err
  assert "stopping the 2 other running process(es)" in err
  assert time.monotonic() - begin < 30


def test_launcher_times_out():
  err = io.StringIO()
  code = "import time; time.sleep(60)"
  status = launch.launch(
    [sys.executable, "-c", code], num_processes=2, timeout=1, stdout=io.StringIO(), stderr=err
  )
  assert status == 124
  assert "timed out after 1 s" in err.getvalue()


def test_launcher_forwards_ctrl_c(tmp_path):
  script = tmp_path / "wait.py"
  script.write_text("import time\nprint('ready', flush=True)\ntime.sleep(60)\n")
  launcher = subprocess.Popen(
    [sys.executable, "-m", "zerojax_launch", "-n", "2", str(script)],
    cwd=ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  ready = [launcher.stdout.readline() for _ in range(2)]
  assert sorted(ready) == ["[p0] ready\n", "[p1] ready\n"]
  launcher.send_signal(signal.SIGINT)
  _, stderr = launcher.communicate(timeout=30)
  assert launcher.returncode == 130
  assert "got SIGINT; stopping all 2 processes" in stderr


def test_launcher_gives_up_after_max_restarts_with_the_last_attempts_status():
  code = "import os, sys; sys.exit(2 + int(os.environ['ZEROJAX_ATTEMPT']))"
  status, err = launch_code(code, max_restarts=2)
  assert status == 5  # attempt 3's
  for attempt, left in [(1, 2), (2, 1), (3, 0)]:
    assert f"attempt {attempt}: started 2 process(es) (pids " in err
    assert f"); {left} restart(s) after failures left." in err
    assert f"exited with code {2 + attempt}; stopping" in err
  assert "restarting after attempt 1 failed (restart 1 of --max-restarts 2)" in err
  assert "restarting after attempt 2 failed (restart 2 of --max-restarts 2)" in err
  assert "giving up: attempt 3 failed and all 2 restart(s) (--max-restarts 2) are used; " in err
  assert "exit status 5." in err and "attempt 4" not in err


def test_launcher_stops_what_the_processes_left_behind(tmp_path):
  # A helper a script starts (a data loader, an uploader) lives in the script's
  # session: it must neither survive the attempt nor hold the launcher open
  # through the stdout it inherited.
  # Each process records its helper as "<attempt>-<pid>" and waits for the
  # other's record before exiting: otherwise, on a busy machine, the first
  # process of attempt 1 to exit got the second stopped before it started its
  # helper, and 3 helpers were found instead of 4.
  code = (
    "import os, subprocess, sys, time\n"
    "helper = subprocess.Popen(['sleep', '60'])\n"
    "attempt = os.environ['ZEROJAX_ATTEMPT']\n"
    f"records = {str(tmp_path)!r}\n"
    "open(os.path.join(records, f'{attempt}-{helper.pid}'), 'w').close()\n"
    "deadline = time.monotonic() + 20\n"
    "while sum(n.startswith(attempt + '-') for n in os.listdir(records)) < 2:\n"
    "  assert time.monotonic() < deadline, 'the other process never started its helper'\n"
    "  time.sleep(0.05)\n"
    "sys.exit(3 if attempt == '1' else 0)\n"
  )
  begin = time.monotonic()
  status, err = launch_code(code, max_restarts=1)
  assert status == 0, err
  assert time.monotonic() - begin < 30
  helpers = [int(path.name.split("-")[1]) for path in tmp_path.iterdir()]
  assert len(helpers) == 4  # 2 processes x 2 attempts
  deadline = time.monotonic() + 10
  while any(map(running, helpers)) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not any(map(running, helpers))


def running(pid: int) -> bool:
  """Whether ``pid`` exists and is not a zombie (Linux ``/proc``)."""
  try:
    with open(f"/proc/{pid}/stat") as stat:
      return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
  except FileNotFoundError:
    return False


def test_launcher_restarts_a_preempted_group_without_counting_it():
  code = "import os, sys; sys.exit(75 if int(os.environ['ZEROJAX_ATTEMPT']) < 3 else 0)"
  status, err = launch_code(code, max_restarts=0)
  assert status == 0
  assert err.count("restarting. Preemptions do not count against --max-restarts.") == 2
  assert "attempt 3: started 2 process(es)" in err and "0 restart(s) after failures left" in err


def test_a_preempted_exit_beside_a_failure_is_a_failure():
  code = "import os, sys, time; p = os.environ['ZEROJAX_PROCESS_ID']; "
  code += "sys.exit(75) if p == '0' else (time.sleep(0.5), sys.exit(4))"
  status, err = launch_code(code, max_restarts=0)
  assert status == 4
  assert "process 0 (pid" in err and "exited with code 75 (preempted); waiting up to" in err
  assert "process 1 (pid" in err and "exited with code 4" in err
  assert "attempt 2" not in err


def test_launcher_passes_sigterm_on_and_exits_preempted(tmp_path):
  script = tmp_path / "save_on_sigterm.py"
  script.write_text(
    "import signal, sys, time\n"
    "def stop(*_):\n"
    "  print('saved', flush=True)\n"
    "  sys.exit(75)\n"
    "signal.signal(signal.SIGTERM, stop)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
  )
  launcher = subprocess.Popen(
    [sys.executable, "-m", "zerojax_launch", "-n", "2", "--max-restarts", "3", str(script)],
    cwd=ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  assert sorted(launcher.stdout.readline() for _ in range(2)) == ["[p0] ready\n", "[p1] ready\n"]
  launcher.send_signal(signal.SIGTERM)
  stdout, stderr = launcher.communicate(timeout=30)
  assert launcher.returncode == 75
  assert sorted(stdout.splitlines()) == ["[p0] saved", "[p1] saved"]
  assert "got SIGTERM; passing it on to all 2 processes so that they save" in stderr
  assert "attempt 2" not in stderr


def test_launcher_refuses_bad_restart_and_heartbeat_settings(capsys):
  for flag, value in [("--max-restarts", "-1"), ("--heartbeat-timeout", "0")]:
    with pytest.raises(SystemExit):
      launch.main(["-n", "2", flag, value, "script.py"])
    assert f"{flag} must be at least" in capsys.readouterr().err
  with pytest.raises(ValueError, match="max_restarts must be at least 0, got -1"):
    launch.launch(["true"], num_processes=1, max_restarts=-1)


def test_a_process_that_raises_fails_the_job_at_once(tmp_path):
  # The worker's shutdown timeout is 120 s and its collective timeout 60 s: without
  # initialize's exception hook, the raising process would wait at exit for the other one, in
  # JAX's exit barrier and in Orbax's commit of the save in flight (which then fails, printing
  # two long tracebacks), while the other waits for it in a collective.
  begin = time.monotonic()
  args = ["-n", "2", "--devices-per-process", "4", WORKER, "raise", str(tmp_path)]
  done = run_launcher(*args, timeout=110)
  assert done.returncode == 1, done.stderr[-3000:]
  assert "RuntimeError: injected fault at step 2" in done.stderr
  assert "process 1 (pid" in done.stderr and "exited with code 1; stopping" in done.stderr
  assert "cannot schedule new futures after shutdown" not in done.stderr
  assert "[p0] Traceback" not in done.stderr  # one line at most: it lost its peer
  assert time.monotonic() - begin < 60


def test_processes_agree_on_a_preemption_step_without_jax_preemption_service():
  done = run_launcher("-n", "2", "--devices-per-process", "4", WORKER, "preempt", timeout=110)
  assert done.returncode == 0, done.stderr[-3000:]
  # Process 1 alone got SIGTERM, at step 3; both stopped after it.
  assert "[p0] stopped after step 3" in done.stdout and "[p1] stopped after step 3" in done.stdout
  assert "attempt 1 was preempted" in done.stderr and "attempt 2: started" in done.stderr
