"""Export's leaf reads (export._read) swapped: a leak of one leaf shows in the peak memory, and a
read that fails leaves no partial file (the rest of export: tests/test_export.py)."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from tests import environment
from tests.helpers import read_safetensors, save_for_export
from zerojax import export_safetensors
from zerojax._src.checkpoint import export as export_lib


@pytest.fixture
def mesh():
  return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


# Run in a fresh process: how far the export's peak resident memory (VmHWM,
# reset just before it) rises above the resident memory before it, once as the
# export is and once with a mutation that keeps the first leaf read alive (a
# leak of one leaf). MALLOC_MMAP_THRESHOLD_ (set by the test) makes glibc map
# every buffer over 128 KiB on its own and unmap it when freed, so resident
# memory counts the bytes held (XLA's and Orbax's buffers too, which tracemalloc
# cannot see), not what the allocator keeps for reuse.
MEASURE_EXPORT = """
import gc, json, sys
import zerojax
from zerojax._src.checkpoint import export as export_lib

def status(field):
  with open("/proc/self/status") as file:
    return next(int(line.split()[1]) * 1024 for line in file if line.startswith(field + ":"))

def peak_rise(directory, path):
  gc.collect()  # what an earlier export left to the collector is not this one's
  before = status("VmRSS")
  with open("/proc/self/clear_refs", "w") as file:
    file.write("5")  # resets VmHWM to the current resident size
  zerojax.export_safetensors(directory, path)
  return status("VmHWM") - before

directory, path = sys.argv[1:]
zerojax.export_safetensors(directory, path)  # loads code and starts Orbax's threads
rises = {"export": peak_rise(directory, path)}
read, kept = export_lib._read, []

def read_and_keep_the_first(*args):  # the mutation
  array = read(*args)
  if not kept:
    kept.append(array)
  return array

export_lib._read = read_and_keep_the_first
rises["export keeping one leaf"] = peak_rise(directory, path)
print(json.dumps(rises))
"""


def test_export_holds_about_two_leaves_in_host_memory(tmp_path, mesh):
  # 12 leaves of 4 MiB each once widened from bf16 to float32: 48 MiB in all.
  leaf = (1024, 1024)
  full = {f"layer{i}": jnp.full(leaf, i, jnp.bfloat16) for i in range(12)}
  tx = zerojax.zero3(optax.sgd(1e-3), mesh=mesh)
  save_for_export(tmp_path / "checkpoints", tx, full)
  arguments = [tmp_path / "checkpoints", tmp_path / "model.safetensors"]
  measured = subprocess.run(
    [sys.executable, "-c", MEASURE_EXPORT, *arguments],
    capture_output=True,
    text=True,
    check=True,
    env=environment.subprocess_env(MALLOC_MMAP_THRESHOLD_=str(128 << 10)),
  )
  rises = json.loads(measured.stdout.splitlines()[-1])
  largest = np.prod(leaf) * 4  # float32 once exported
  # At once: Orbax's read of a leaf, the array read and its float32 copy (about
  # 2.1 leaves measured); a leaf kept beyond its write adds one more.
  limit = 2.5 * largest
  shown = {what: f"{rise / 2**20:.1f} MiB" for what, rise in rises.items()}
  assert rises["export"] < limit < rises["export keeping one leaf"], shown
  written = read_safetensors(tmp_path / "model.safetensors")
  for i in range(12):
    assert written[f"layer{i}"].shape == leaf and (written[f"layer{i}"] == i).all()


def test_a_failed_export_leaves_no_partial_file_and_keeps_the_old_one(tmp_path, mesh, monkeypatch):
  full = {f"layer{i}": jnp.full((64, 64), i, jnp.float32) for i in range(3)}
  save_for_export(tmp_path / "checkpoints", zerojax.zero3(optax.sgd(1e-3), mesh=mesh), full)
  target = tmp_path / "model.safetensors"
  export_safetensors(tmp_path / "checkpoints", target)
  before = target.read_bytes()

  reads = []

  def failing_read(*args):
    reads.append(args)
    if len(reads) == 2:
      raise OSError("disk gone")
    return export_lib._read(*args)

  monkeypatch.setattr(export_lib, "_read", failing_read)
  with pytest.raises(OSError, match="disk gone"):
    export_safetensors(tmp_path / "checkpoints", target)
  assert target.read_bytes() == before
  assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoints", "model.safetensors"]
