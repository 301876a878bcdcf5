"""Activations offloaded to host memory by the layer's own checkpoint policy, on H100 and v5e.

The layer of tests/accelerator_worker.py's first model names its up-projection
``"hidden"`` (``jax.ad_checkpoint.checkpoint_name``) and runs under its own
``jax.checkpoint`` whose policy offloads it to pinned host memory
(``save_and_offload_only_these_names``), or keeps it on the device. The worker
compiles the zero3 training step (``zerojax.scan``) and GSPMD FSDP's
(``jax.lax.scan`` of the same layer) for 8 x H100 and a TPU v5e-8 without them,
and profiles them with ``zerojax.diagnostics.profile``. XLA:CPU reports no host
memory (its host memory is its device memory), so only these compilers can
show the offload: buffers in memory space 5 (``S(5)``) and
``memory_analysis()`` 's host temporaries. docs/offload.md ("Activations to host
memory") has the numbers.
"""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import accelerator_worker as worker
from zerojax.diagnostics import deviceless_environment

#: The named activation of one layer on one device, in bytes: its share of the tokens x F, fp32.
HIDDEN = {
  target: worker.TOKENS[platform] // 8 * worker.F * 4
  for target, platform in (("h100x8", "cuda"), ("v5e-8", "tpu"))
}
SETUPS = tuple(f"{name} ({keep})" for keep in worker.NAMED for name in ("GSPMD FSDP", "zero3 scan"))


@functools.cache
def compiled(target: str) -> dict:
  """What the worker reports for the offloading setups compiled for ``target``."""
  cache = Path(os.environ.get("ZEROJAX_TESTS_JAX_CACHE", "/tmp"))
  out = cache / f"activation-offload-{target}.json"
  root = str(Path(__file__).parent.parent)
  # The compiler's own environment, and this checkout's zerojax (not an installed one).
  path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
  env = {**os.environ, **deviceless_environment(target), "PYTHONPATH": path}
  command = [sys.executable, str(Path(worker.__file__)), target, str(out), *SETUPS]
  done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-5000:]
  return json.loads(out.read_text())


@pytest.mark.parametrize("target", ["h100x8", "v5e-8"])
def test_gspmd_fsdp_offloads_every_layers_activation(target):
  # The reference: jax.lax.scan of the layer holds each layer's named activation in host
  # memory from the forward pass to the backward pass, and the profile counts it.
  found = compiled(target)["GSPMD FSDP (offloaded)"]
  assert found["host_buffers"] > 0  # S(5) in the compiled program
  assert found["profile"]["host_temp_bytes"] == worker.LAYERS * HIDDEN[target]
  assert found["profile"]["host_peak_bytes"] == found["profile"]["host_temp_bytes"]


@pytest.mark.parametrize("target", ["h100x8", "v5e-8"])
def test_zero3_scan_offloads_the_named_activation(target):
  # zerojax.scan's backward pass waits for the cotangent before it reads the last layer's
  # activations, as it does for the layers in its loop: XLA:GPU keeps all L layers' in host
  # memory, as it does GSPMD FSDP's. XLA:TPU's buffer assignment holds L layers' in host memory
  # (one buffer of L - 1 and one of 1), and memory_analysis() reports L + 1 layers of host
  # temporaries.
  found = compiled(target)["zero3 scan (offloaded)"]
  layers = {"h100x8": worker.LAYERS, "v5e-8": worker.LAYERS + 1}[target]
  assert found["host_buffers"] > 0
  assert found["profile"]["host_temp_bytes"] == layers * HIDDEN[target]
  assert found["profile"]["host_argument_bytes"] == found["profile"]["host_output_bytes"] == 0


@pytest.mark.parametrize("target", ["h100x8", "v5e-8"])
@pytest.mark.parametrize("name", ["GSPMD FSDP", "zero3 scan"])
def test_a_step_that_keeps_its_activations_on_the_device_uses_no_host_memory(target, name):
  found = compiled(target)[f"{name} (named saved)"]
  assert found["host_buffers"] == 0
  assert found["profile"]["host_temp_bytes"] == found["profile"]["host_peak_bytes"] == 0


@pytest.mark.parametrize("name", ["GSPMD FSDP", "zero3 scan"])
def test_gpu_offloading_lowers_the_device_temporaries(name):
  # What offloading is for. XLA:TPU is left out: at this size it keeps GSPMD FSDP's
  # temporaries in on-chip memory, and reports 0 bytes of them.
  found = compiled("h100x8")
  offloaded = found[f"{name} (offloaded)"]["profile"]["temp_bytes"]
  assert offloaded < found[f"{name} (named saved)"]["profile"]["temp_bytes"]


def test_the_cpu_compiler_reports_no_host_memory():
  # Why the tests above compile for accelerators: XLA:CPU places the offloaded activations
  # in the same memory and reports no host bytes.
  import jax
  import jax.numpy as jnp

  import zerojax

  layer = worker.named_block("offloaded")
  params = {"up": jnp.ones((2, 8, 16)), "down": jnp.ones((2, 16, 8))}

  def loss(params, x):
    return jnp.sum(jax.lax.scan(layer, x, params)[0])

  found = zerojax.diagnostics.profile(jax.grad(loss), params, jnp.ones((4, 8)))
  assert found.host_temp_bytes == found.host_peak_bytes == 0
  assert "host memory" not in str(found)


@pytest.mark.parametrize("target", ["h100x8", "v5e-8"])
def test_the_estimate_is_what_jax_lax_scan_offloads(target):
  import zerojax

  estimate = zerojax.estimate_memory(
    worker.LAYERS * 2 * worker.D * worker.F,
    num_devices=8,
    stage=3,
    offloaded_activation_bytes=HIDDEN[target],
    num_layers=worker.LAYERS,
  )
  found = compiled(target)
  assert estimate.host_activations == found["GSPMD FSDP (offloaded)"]["profile"]["host_temp_bytes"]
  zero3 = found["zero3 scan (offloaded)"]["profile"]["host_temp_bytes"]
  assert abs(zero3 - estimate.host_activations) <= HIDDEN[target]  # a layer's, either way
