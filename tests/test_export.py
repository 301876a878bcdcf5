"""Export: a checkpoint's full-precision parameters, unpadded, streamed leaf by leaf."""

import json
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from tests import environment
from zerojax import CheckpointManager, export_safetensors, load_params, train_state_spec
from zerojax._src.checkpoint import export as export_lib
from zerojax.export import main as export_main


def read_safetensors(path):
  """An independent reader of the format: 8-byte header length, JSON header, raw data."""
  with open(path, "rb") as file:
    header = json.loads(file.read(int.from_bytes(file.read(8), "little")))
    data = file.read()
  dtypes = {"F32": np.float32, "I32": np.int32}
  return {
    name: np.frombuffer(data[begin:end], dtypes[info["dtype"]]).reshape(info["shape"])
    for name, info in header.items()
    for begin, end in [info["data_offsets"]]
  }


def save(directory, tx, full):
  params = tx.shard(full)
  with CheckpointManager(directory, train_state_spec(tx, full)) as checkpoints:
    checkpoints.save(0, {"params": params, "opt_state": tx.init(full)})
  return params


def test_exports_the_full_precision_unpadded_params(tmp_path, mesh):
  full = {
    "layer": {"w": jax.random.normal(jax.random.PRNGKey(0), (5, 1001))},  # padded in stage 3
    "count": jnp.arange(3, dtype=jnp.int32),
  }
  # Stage 2 under bf16 keeps bf16 params and a float32 master copy: export the master copy.
  tx = zerojax.zero2(optax.adam(1e-3), mesh=mesh, precision="bf16")
  params = save(tmp_path / "bf16", tx, full)
  assert params["layer"]["w"].dtype == jnp.bfloat16
  tensors = export_safetensors(tmp_path / "bf16", tmp_path / "bf16.safetensors")
  assert tensors == {
    "layer.w": jax.ShapeDtypeStruct((5, 1001), jnp.float32),
    "count": jax.ShapeDtypeStruct((3,), jnp.int32),
  }
  written = read_safetensors(tmp_path / "bf16.safetensors")
  np.testing.assert_array_equal(written["layer.w"], full["layer"]["w"], strict=True)
  np.testing.assert_array_equal(written["count"], full["count"], strict=True)

  # Stage 3 stores the padded float32 params themselves.
  tx = zerojax.zero3(optax.adam(1e-3), mesh=mesh)
  params = save(tmp_path / "fp32", tx, full)
  chex.assert_shape(params["layer"]["w"], (5, 1008))
  loaded = load_params(tmp_path / "fp32")
  chex.assert_trees_all_equal(loaded, tx.gather(params), strict=True)


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
  save(tmp_path / "checkpoints", tx, full)
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


def test_the_command_line_writes_what_the_function_writes(tmp_path, mesh, capsys):
  full = {"w": jax.random.normal(jax.random.PRNGKey(0), (5, 1001))}
  save(tmp_path / "checkpoints", zerojax.zero3(optax.adam(1e-3), mesh=mesh), full)
  export_main([str(tmp_path / "checkpoints"), str(tmp_path / "cli.safetensors"), "--step", "0"])
  assert "wrote 1 tensors, 0.02 MiB, to" in capsys.readouterr().out
  export_safetensors(tmp_path / "checkpoints", tmp_path / "function.safetensors")
  assert (tmp_path / "cli.safetensors").read_bytes() == (
    tmp_path / "function.safetensors"
  ).read_bytes()

  with pytest.raises(SystemExit) as exit_info:
    export_main([str(tmp_path / "checkpoints"), str(tmp_path / "other.safetensors"), "--step", "7"])
  assert exit_info.value.code == 1
  assert "no checkpoint for step 7" in capsys.readouterr().err
  assert not (tmp_path / "other.safetensors").exists()


def test_a_failed_export_leaves_no_partial_file_and_keeps_the_old_one(tmp_path, mesh, monkeypatch):
  full = {f"layer{i}": jnp.full((64, 64), i, jnp.float32) for i in range(3)}
  save(tmp_path / "checkpoints", zerojax.zero3(optax.sgd(1e-3), mesh=mesh), full)
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


def test_exporting_inside_a_multi_process_job_says_how_to_export(tmp_path, monkeypatch):
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with pytest.raises(RuntimeError, match=r"python -m zerojax\.export CHECKPOINT_DIR"):
    export_safetensors(tmp_path, tmp_path / "model.safetensors")
  with pytest.raises(RuntimeError, match="gather_to_host"):
    load_params(tmp_path)


def test_lists_and_tuples_of_params_export_too(tmp_path, mesh):
  # The plain-JAX MLP layout, under bf16 so that the master copy is exported.
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  full = [
    (jax.random.normal(keys[0], (64, 128)), jax.random.normal(keys[1], (128,))),
    (jax.random.normal(keys[2], (128, 10)), jax.random.normal(keys[3], (10,))),
  ]
  tx = zerojax.zero2(optax.adam(1e-3), mesh=mesh, precision="bf16")
  save(tmp_path / "checkpoints", tx, full)
  loaded = load_params(tmp_path / "checkpoints")
  expected = [list(layer) for layer in full]  # Orbax saves tuples as lists
  chex.assert_trees_all_equal(loaded, expected, strict=True)
  export_safetensors(tmp_path / "checkpoints", tmp_path / "model.safetensors")
  written = read_safetensors(tmp_path / "model.safetensors")
  assert sorted(written) == ["0.0", "0.1", "1.0", "1.1"]
  np.testing.assert_array_equal(written["1.0"], full[1][0], strict=True)


def test_parameters_whose_names_would_collide_are_refused(tmp_path, mesh):
  full = {"a.b": jnp.ones((4,)), "a": {"b": jnp.full((4,), 2.0)}}
  save(tmp_path / "checkpoints", zerojax.zero1(optax.sgd(1e-3), mesh=mesh), full)
  with pytest.raises(ValueError, match=r"two parameters would both be called 'a\.b'"):
    export_safetensors(tmp_path / "checkpoints", tmp_path / "model.safetensors")
  assert not (tmp_path / "model.safetensors").exists()
