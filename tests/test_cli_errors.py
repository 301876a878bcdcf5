"""A mistake on a command line ends in argparse's usage message and exit status 2: no traceback.

Each case calls the command's ``main`` in this process (the mistakes are caught before anything
is computed or launched, or, for those that need the run's files, before any training); one runs
``examples/train_lm.py`` as the script it is. ``{tmp}`` in a case's arguments is a directory that
``files`` fills with what the mistakes need.
"""

import io
import json
import subprocess
import sys

import pytest

from examples import train_lm
from tests.environment import ROOT
from zerojax import estimate, export, launch

MAINS = {
  "train_lm": train_lm.main,
  "launch": launch.main,
  "estimate": estimate.main,
  "export": export.main,
}
# train_lm runs that get as far as reading their files: the tiny model, two steps.
TINY = ["--model", "tiny", "--steps", "2", "--no-report", "--out", "{tmp}/out"]

CASES = [
  # examples/train_lm.py (its defaults: the small model, a batch of 32, 8 devices)
  ("train_lm", ["--steps", "0"], "argument --steps: must be at least 1, got 0"),
  ("train_lm", ["--steps", "-5"], "argument --steps: must be at least 1, got -5"),
  ("train_lm", ["--microbatches", "0"], "argument --microbatches: must be at least 1, got 0"),
  (
    "train_lm",
    ["--microbatches", "3"],
    "--batch-size 32 must be a multiple of the 8 devices the batch is split over (replica x "
    "data) times --microbatches 3",
  ),
  ("train_lm", ["--devices", "0"], "argument --devices: must be at least 1, got 0"),
  ("train_lm", ["--devices", "-2"], "argument --devices: must be at least 1, got -2"),
  ("train_lm", ["--devices", "two"], "argument --devices: invalid whole_number value: 'two'"),
  (
    "train_lm",
    ["--mesh", "data=4,model=3"],
    "--mesh model=3 does not divide the small model's d_model 128, which tensor parallelism "
    "splits; take model= one of 2, 4, 8, 16",
  ),
  ("train_lm", ["--mesh", "data=4,model"], "'data=4,model' is not axis=size"),
  ("train_lm", ["--schedule", "1f1b"], "--schedule 1f1b runs pipeline stages: add stage=N"),
  (
    "train_lm",
    ["--mesh", "stage=8,data=1"],
    "--mesh stage=8 does not divide the small model's 4 layers among the pipeline stages",
  ),
  ("train_lm", ["--mesh", "data=16"], "--devices 16, but JAX has 8 devices"),
  ("train_lm", ["--devices", "4", "--mesh", "data=2"], "--devices 4 but --mesh has 2"),
  ("train_lm", ["--stage", "2", "--quantized-weights", "int8"], "--quantized-weights applies"),
  (
    "train_lm",
    ["--stage", "2", "--mesh", "node=2,data=4", "--secondary-axis", "data"],
    "--secondary-axis applies to stage 3",
  ),
  ("train_lm", ["--secondary-axis", "data"], "give the mesh a node axis too"),
  ("train_lm", ["--stage", "0", "--precision", "bf16"], "--precision, --microbatches and"),
  ("train_lm", ["--resume"], "--resume needs --checkpoint-dir"),
  ("train_lm", ["--quantization-block-size", "3"], "--quantization-block-size 3: make it even"),
  ("train_lm", ["--stage", "0", "--offload", "optimizer"], "--offload applies to stages 1-3"),
  ("train_lm", ["--offload", "optimizer+master"], "under fp32 the parameters are the master"),
  ("train_lm", ["--per-device-batch", "0"], "argument --per-device-batch: must be at least 1"),
  ("train_lm", ["--log-every", "0"], "argument --log-every: must be at least 1, got 0"),
  (
    "train_lm",
    ["--per-device-batch", "4", "--devices", "3"],
    "--batch-size 32 on 3 devices: a global batch of 32 cannot be split",
  ),
  (
    "train_lm",
    ["--per-device-batch", "4", "--microbatches", "2"],
    "--microbatches and --per-device-batch: pass one",
  ),
  (
    "train_lm",
    ["--per-device-batch", "4", "--stage", "0", "--devices", "4"],
    "--per-device-batch 4 needs 2 micro-batches on 4",
  ),
  ("train_lm", ["--lr", "-1"], "argument --lr: must be a finite number above 0, got -1"),
  ("train_lm", ["--lr", "nan"], "argument --lr: must be a finite number above 0, got nan"),
  ("train_lm", ["--lr", "fast"], "argument --lr: 'fast' is not a number"),
  ("train_lm", ["--mesh", "data=8,data=2"], "--mesh 'data=8,data=2' names an axis twice"),
  ("train_lm", ["--out", "{tmp}/a_file"], "--out {tmp}/a_file: {tmp}/a_file is a file; --out"),
  (
    "train_lm",
    ["--checkpoint-dir", "{tmp}/a_file/ckpt"],
    "--checkpoint-dir {tmp}/a_file/ckpt: {tmp}/a_file (in {tmp}/a_file/ckpt) is a file",
  ),
  ("train_lm", ["--num-processes", "2"], "a multi-process run needs coordinator_address"),
  ("train_lm", ["--model", "tiny", "--seq-len", "10000000"], "--seq-len 10000000 is not shorter"),
  (
    "train_lm",
    [*TINY, "--checkpoint-dir", "{tmp}/earlier_run"],
    "--checkpoint-dir {tmp}/earlier_run holds the checkpoints [2] of an earlier run: pass --resume",
  ),
  (
    "train_lm",
    [*TINY, "--checkpoint-dir", "{tmp}/stranger"],
    "--checkpoint-dir {tmp}/stranger: {tmp}/stranger/2 is in the way of this run's checkpoint of "
    "step 2 (it is not a checkpoint)",
  ),
  (
    "train_lm",
    [*TINY, "--checkpoint-dir", "{tmp}/earlier_run", "--resume", "--lr", "0.1"],
    "--lr 0.1, but the checkpoints in {tmp}/earlier_run were trained with --lr 0.003",
  ),
  (
    "train_lm",
    [*TINY, "--checkpoint-dir", "{tmp}/earlier_run", "--resume"],
    "--resume from {tmp}/earlier_run: checkpoint step 2 in {tmp}/earlier_run does not fit this "
    "manager's spec",
  ),
  # python -m zerojax_launch
  ("launch", ["-n", "2", "nosuch.py"], "nosuch.py: no such script"),
  ("launch", ["-n", "2", "--timeout", "0", "x.py"], "--timeout must be above 0, got 0"),
  ("launch", ["-n", "2", "--grace-period", "-1", "x.py"], "--grace-period must be at least 0"),
  ("launch", ["-n", "2", "--devices-per-process", "0", "x.py"], "--devices-per-process must be"),
  ("launch", ["-n", "2", "--devices-per-process", "-1", "x.py"], "at least 1, got -1"),
  ("launch", ["-n", "0", "x.py"], "--num-processes must be at least 1, got 0"),
  ("launch", ["-n", "2", "--min-processes", "0", "x.py"], "--min-processes must be between 1"),
  ("launch", ["-n", "2", "--min-processes", "3", "x.py"], "and --num-processes (2), got 3"),
  # python -m zerojax.estimate
  ("estimate", ["--params", "0"], "argument --params: must be finite and above 0, got 0"),
  ("estimate", ["--params", "-1"], "argument --params: must be finite and above 0, got -1"),
  ("estimate", ["--params=-7.5e9"], "argument --params: must be finite and above 0"),
  ("estimate", ["--params", "nan"], "argument --params: must be finite and above 0, got nan"),
  ("estimate", ["--params", "1e9", "--devices", "8", "0"], "argument --devices: must be at"),
  ("estimate", ["--params", "1e9", "--state-bytes", "-1"], "must be finite and at least 0"),
  ("estimate", ["--params", "1e9", "--optimizer", "nosuch"], "optax.nosuch(learning_rate) is"),
  ("estimate", ["--params", "1e9", "--optimizer", "lion", "--state-bytes", "8"], "not both"),
  (
    "estimate",
    ["--params", "1e9", "--quantized-gradients", "int8", "--block-size", "3"],
    "quantization_block_size must be a positive even int",
  ),
  # python -m zerojax.export
  ("export", ["{tmp}/earlier_run", "{tmp}"], "{tmp} is a directory; name the .safetensors file"),
  ("export", ["{tmp}/earlier_run", "{tmp}/no/such/model.safetensors"], "{tmp}/no/such does not"),
]


@pytest.fixture
def tmp(tmp_path):
  """The directory ``{tmp}`` stands for: a file, an earlier run's checkpoints, and a checkpoint
  directory with something that is not a checkpoint where step 2's would go."""
  (tmp_path / "a_file").write_text("not a directory")
  # A checkpoint of another model, as far as listing the directory and reading its layout
  # record go (reading its arrays would fail).
  (tmp_path / "earlier_run" / "2" / "layout").mkdir(parents=True)
  (tmp_path / "earlier_run" / "2" / "_CHECKPOINT_METADATA").write_text("{}")
  w = {"keys": ["params", "w"], "shape": [3], "dtype": "float32"}
  layout = {"leaves": {"['params']['w']": w}, "master_path": ["params"]}
  (tmp_path / "earlier_run" / "2" / "layout" / "metadata").write_text(json.dumps(layout))
  (tmp_path / "earlier_run" / "schedule.json").write_text(json.dumps({"lr": 3e-3, "steps": 2}))
  (tmp_path / "stranger" / "2").mkdir(parents=True)
  return tmp_path


@pytest.mark.parametrize(
  "command, argv, message", CASES, ids=[f"{c}:{' '.join(a)}" for c, a, _ in CASES]
)
@pytest.mark.filterwarnings("ignore:.*named like a checkpoint but not one:UserWarning")
def test_a_mistake_is_a_usage_error(command, argv, message, capsys, tmp):
  with pytest.raises(SystemExit) as exit_:
    MAINS[command]([arg.format(tmp=tmp) for arg in argv])
  err = capsys.readouterr().err
  assert exit_.value.code == 2, err
  assert err.startswith("usage: "), err
  assert message.format(tmp=tmp) in err, err


def test_train_lm_as_a_script_says_what_is_wrong_and_exits_2():
  done = subprocess.run(
    [sys.executable, "examples/train_lm.py", "--microbatches", "3"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert done.returncode == 2, done.stderr
  assert "train_lm.py: error: --batch-size 32 must be a multiple of" in done.stderr
  assert "Traceback" not in done.stderr and not done.stdout


def test_the_old_launcher_command_says_where_the_launcher_went():
  # It ran nothing and exited 0: a job script would go on as if its processes had trained.
  done = subprocess.run(
    [sys.executable, "-m", "zerojax.launch", "-n", "2", "train.py"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert done.returncode == 2, done.stderr
  assert (
    "python -m zerojax.launch: the launcher's command line moved to its own package, which "
    "imports no JAX: run `python -m zerojax_launch -n 2 train.py` (or `zerojax-launch -n 2 "
    "train.py`)" in done.stderr
  )
  assert "Traceback" not in done.stderr and not done.stdout


def test_launch_refuses_devices_per_process_below_1():
  with pytest.raises(ValueError, match="devices_per_process must be at least 1, got 0"):
    launch.launch(["true"], num_processes=1, devices_per_process=0)


@pytest.mark.parametrize("verbose", [False, True])
def test_launcher_shows_gloo_connection_lines_only_when_verbose(verbose):
  # What gloo prints on stdout in each process as it connects to the others; two threads of a
  # process may print it at the same time, one line cut into the other.
  gloo = [
    "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1",
    "[Gloo] Rank [Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer "
    "ranks is : 1",
    "0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1",
    "[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected [Gloo] Rank 0",
    "Expected number of connected peer ranks is : 1",
    "peer ranks is : 1",
  ]
  # A program's own short lines stay, even where they are pieces of that message too.
  code = f"print(*{gloo!r}, sep='\\n'); print('trained'); print('Rank 1'); print(': 1')"
  out = io.StringIO()
  status = launch.launch(
    [sys.executable, "-c", code], num_processes=1, stdout=out, stderr=io.StringIO(), verbose=verbose
  )
  assert status == 0
  assert out.getvalue().splitlines() == [f"[p0] {line}" for line in gloo] * verbose + [
    "[p0] trained",
    "[p0] Rank 1",
    "[p0] : 1",
  ]


def test_launcher_does_not_restart_a_usage_error():
  # Exit status 2 is argparse's for a mistake in the arguments: every restart would repeat it.
  err = io.StringIO()
  code = "import sys; sys.exit(2)"
  status = launch.launch(
    [sys.executable, "-c", code], num_processes=2, max_restarts=3, stderr=err, stdout=io.StringIO()
  )
  assert status == 2
  assert "not restarting: attempt 1 exited with 2, a usage error" in err.getvalue()
  assert "attempt 2" not in err.getvalue()
