"""A mistake on a command line ends in argparse's usage message and exit status 2: no traceback.

Each case calls the command's ``main`` in this process (the mistakes are caught before anything
is computed or launched); one runs ``examples/train_lm.py`` as the script it is.
"""

import io
import subprocess
import sys

import pytest

from examples import train_lm
from tests.environment import ROOT
from zerojax import estimate, launch

MAINS = {"train_lm": train_lm.main, "launch": launch.main, "estimate": estimate.main}

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
  ("train_lm", ["--mesh", "data=16"], "--devices 16, but JAX has 8 devices"),
  ("train_lm", ["--devices", "4", "--mesh", "data=2"], "--devices 4 but --mesh has 2"),
  ("train_lm", ["--stage", "2", "--quantized-weights", "int8"], "--quantized-weights applies"),
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
  # python -m zerojax.launch
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
]


@pytest.mark.parametrize(
  "command, argv, message", CASES, ids=[f"{c}:{' '.join(a)}" for c, a, _ in CASES]
)
def test_a_mistake_is_a_usage_error(command, argv, message, capsys):
  with pytest.raises(SystemExit) as exit_:
    MAINS[command](argv)
  err = capsys.readouterr().err
  assert exit_.value.code == 2, err
  assert err.startswith("usage: "), err
  assert message in err, err


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


def test_launch_refuses_devices_per_process_below_1():
  with pytest.raises(ValueError, match="devices_per_process must be at least 1, got 0"):
    launch.launch(["true"], num_processes=1, devices_per_process=0)


@pytest.mark.parametrize("verbose", [False, True])
def test_launcher_shows_gloo_connection_lines_only_when_verbose(verbose):
  # What gloo prints on stdout in each process as it connects to the others.
  gloo = "[Gloo] Rank 0 is connected to 1 peer ranks. "
  gloo += "Expected number of connected peer ranks is : 1"
  code = f"print({gloo!r}); print('trained')"
  out = io.StringIO()
  status = launch.launch(
    [sys.executable, "-c", code], num_processes=1, stdout=out, stderr=io.StringIO(), verbose=verbose
  )
  assert status == 0
  assert out.getvalue().splitlines() == [f"[p0] {gloo}"] * verbose + ["[p0] trained"]
