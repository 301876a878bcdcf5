"""What ``zerojax.launch`` gives each process to compute on, read from the environment it gets."""

import io
import json
import subprocess
import sys

import pytest

from tests import environment
from zerojax_launch import launcher as launch
from zerojax_launch import placement

#: A process that prints what the launcher told it about its devices.
SHOW_ENV = (
  "import json, os; print(json.dumps({k: os.environ.get(k) for k in "
  "('ZEROJAX_PROCESS_ID', 'JAX_PLATFORMS', 'CUDA_VISIBLE_DEVICES', 'XLA_FLAGS')}))"
)


def launched_envs(monkeypatch, accelerators, **options):
  """The variables each launched process saw, on a host showing ``accelerators``."""
  monkeypatch.setattr(placement, "local_accelerators", lambda *_: accelerators)
  # The launcher adds what the host needs to the environment it was given (the test's forces
  # the CPU): start from one that names no platform.
  monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  out = io.StringIO()
  status = launch.launch(
    [sys.executable, "-c", SHOW_ENV], stdout=out, stderr=io.StringIO(), **options
  )
  assert status == 0
  lines = [json.loads(line.split("] ", 1)[1]) for line in out.getvalue().splitlines()]
  return sorted(lines, key=lambda env: env["ZEROJAX_PROCESS_ID"])


def test_on_a_gpu_host_each_process_gets_one_gpu_and_no_platform_forced(monkeypatch):
  envs = launched_envs(monkeypatch, ("gpu", 8), num_processes=2)
  assert [env["CUDA_VISIBLE_DEVICES"] for env in envs] == ["0", "1"]
  assert all(env["JAX_PLATFORMS"] is None for env in envs)


def test_on_a_tpu_host_one_process_gets_every_chip(monkeypatch):
  (env,) = launched_envs(monkeypatch, ("tpu", 8), num_processes=1)
  assert env["JAX_PLATFORMS"] is None and env["CUDA_VISIBLE_DEVICES"] is None


def test_without_accelerators_or_with_cpu_devices_asked_for_the_processes_run_on_the_cpu(
  monkeypatch,
):
  for accelerators in [("cpu", 0), ("gpu", 8)]:
    envs = launched_envs(monkeypatch, accelerators, num_processes=2, devices_per_process=4)
    assert all(env["JAX_PLATFORMS"] == "cpu" for env in envs)
    assert all(
      env["XLA_FLAGS"].endswith("--xla_force_host_platform_device_count=4") for env in envs
    )
    assert all(env["CUDA_VISIBLE_DEVICES"] is None for env in envs)


def test_the_launchers_visible_gpus_are_the_ones_handed_out():
  chosen = placement.place(
    2, None, environ={"CUDA_VISIBLE_DEVICES": "3,5,6"}, accelerators=("gpu", 8)
  )
  assert chosen.gpus == ("3", "5")


@pytest.mark.parametrize(
  ("arguments", "message"),
  [
    ((3, None, None, ("gpu", 2)), "3 processes, one GPU each, but this host has 2"),
    ((2, None, None, ("tpu", 4)), "a TPU host runs one process"),
    ((1, 4, "gpu", ("gpu", 2)), "devices_per_process fakes CPU devices"),
    ((1, None, "tpu", ("gpu", 2)), "platform 'tpu' asked for, but this host shows gpu"),
    ((1, None, "mps", ("cpu", 0)), "platform must be one of"),
  ],
)
def test_processes_that_do_not_fit_the_host_are_refused(arguments, message):
  num_processes, devices_per_process, platform, accelerators = arguments
  with pytest.raises(ValueError, match=message):
    placement.place(num_processes, devices_per_process, platform, {}, accelerators)


@pytest.mark.skipif(
  placement.local_accelerators()[0] != "cpu", reason="a host with accelerators keeps them"
)
def test_use_cpu_devices_chooses_the_cpu_on_a_host_without_accelerators():
  # Installed accelerator plugins (the test extra installs jax[cuda12-local] and libtpu, to
  # compile for them) are not started on a host without their devices, only to fail loudly.
  show = (
    "import jax, zerojax; zerojax.distributed.use_cpu_devices(2); "
    "print(jax.config.jax_platforms, jax.device_count())"
  )
  env = environment.subprocess_env()
  env.pop("JAX_PLATFORMS", None)
  done = subprocess.run(
    [sys.executable, "-c", show], env=env, capture_output=True, text=True, timeout=120
  )
  assert done.returncode == 0, done.stderr
  assert done.stdout.split() == ["cpu", "2"]
  assert "Traceback" not in done.stderr
