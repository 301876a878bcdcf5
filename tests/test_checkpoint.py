"""Checkpoints: round trips on both kinds of mesh axes, restoring onto other device counts and
stages, bad directories, damage and crashes. Each part of the manager alone (the layout record,
the restore verdicts and the process vote, the master copy's moves) is tested beside its module:
zerojax/_src/checkpoint/record_test.py, verdict_test.py and master_test.py."""

import functools
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from tests.helpers import (
  AXIS_TYPES,
  CHECKPOINT_MODEL,
  CHECKPOINT_WORKER,
  arrays,
  assert_placed,
  checkpoint_spec,
  checkpoint_tx,
  final_params,
  random_state,
  unpadded,
)
from zerojax import CheckpointManager, StateSpec


@functools.cache
def trained(*setting) -> tuple[Any, StateSpec]:
  """A state of ``checkpoint_tx(*setting)`` after two updates, and its spec, made once per setting.

  Every leaf, Adam's moments included, holds distinct values.
  """
  tx = checkpoint_tx(*setting)
  keys = iter(jax.random.split(jax.random.PRNGKey(0), 16))
  full = {
    name: jax.random.normal(next(keys), x.shape, x.dtype) for name, x in CHECKPOINT_MODEL.items()
  }
  params = tx.shard(full)
  opt_state = tx.init(full)  # the full-precision values: the master copy, under mixed precision
  for _ in range(2):
    grads = {
      name: jax.random.normal(next(keys), x.shape, x.dtype) for name, x in CHECKPOINT_MODEL.items()
    }
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  state = {
    "params": params,
    "opt_state": opt_state,
    "step": jnp.int32(2),
    "rng": jax.random.PRNGKey(2),
  }
  return state, checkpoint_spec(tx)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_round_trip_is_bit_identical(tmp_path, axis_type, stage, precision):
  spec = checkpoint_spec(checkpoint_tx(8, stage, precision, axis_type))
  state = random_state(spec)
  with CheckpointManager(tmp_path, spec) as checkpoints:
    assert checkpoints.save(2, state)
  with CheckpointManager(tmp_path, spec) as checkpoints:
    assert checkpoints.latest_step() == 2
    restored = checkpoints.restore()
  assert_placed(restored, spec)
  chex.assert_trees_all_equal(
    jax.tree.map(np.asarray, arrays(restored)), jax.tree.map(np.asarray, state), strict=True
  )


def master_and_rest(state, spec, tx):
  """The master parameters, and the rest of the state without any copy of the parameters."""
  values = unpadded(state, spec.logical)
  master = tx.master_params(values["params"], values["opt_state"])
  rest = {**values, "params": None, "opt_state": values["opt_state"]._replace(master=None)}
  return master, rest


# Each list is a run saved and restored by the next setting, (device count,
# stage): device counts, stages, and with a lower compute dtype the master copy
# moving between the optimizer state (stages 1-2) and the parameters (stage 3).
HOPS = {
  "fp32-8-4-1-2-8": ("fp32", [(8, 3), (4, 3), (1, 3), (2, 3), (8, 3)]),
  "fp32-stage3-1-3-2-3": ("fp32", [(8, 3), (8, 1), (4, 3), (2, 2), (8, 3)]),
  "bf16-stage1-3-1-2-3-2": ("bf16", [(8, 1), (4, 3), (2, 1), (8, 2), (4, 3), (2, 2)]),
  "fp16-stage3-2-1-3": ("fp16", [(8, 3), (2, 2), (4, 1), (8, 3)]),
}


@pytest.mark.parametrize("hops", HOPS)
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_restore_onto_other_device_counts_and_stages(tmp_path, axis_type, hops):
  precision, hops = HOPS[hops]
  state, spec = trained(*hops[0], precision, axis_type)
  tx = checkpoint_tx(*hops[0], precision, axis_type)
  expected_master, expected_rest = master_and_rest(state, spec, tx)
  if precision == "fp16":  # the loss scale moves too
    assert state["opt_state"].loss_scale is not None
  for hop, (num_devices, stage) in enumerate(hops[1:]):
    with CheckpointManager(tmp_path / str(hop), spec) as checkpoints:
      checkpoints.save(0, state)
    tx = checkpoint_tx(num_devices, stage, precision, axis_type)
    spec = checkpoint_spec(tx)
    with CheckpointManager(tmp_path / str(hop), spec) as checkpoints:
      state = checkpoints.restore()
    assert_placed(state, spec)
    master, rest = master_and_rest(state, spec, tx)
    chex.assert_trees_all_equal(master, expected_master, strict=True)
    chex.assert_trees_all_equal(rest, expected_rest, strict=True)
    # The params are the master copy as tx.shard places it (rounded to the compute dtype).
    rounded = tx.shard(jax.tree.map(jnp.asarray, expected_master))
    chex.assert_trees_all_equal(
      unpadded(state["params"], spec.logical["params"]),
      unpadded(rounded, spec.logical["params"]),
      strict=True,
    )


def test_keeps_the_last_k_and_saves_every_interval(tmp_path):
  spec = checkpoint_spec(checkpoint_tx(8, 3))
  state = random_state(spec)
  with CheckpointManager(tmp_path, spec, max_to_keep=2, save_interval_steps=2) as checkpoints:
    saved = [checkpoints.save(step, state) for step in range(7)]
    assert checkpoints.save(7, state, force=True)
    checkpoints.wait()
    assert saved == [True, False, True, False, True, False, True]
    assert checkpoints.all_steps() == [6, 7]
  assert sorted(os.listdir(tmp_path)) == ["6", "7"]


def test_a_mismatched_checkpoint_names_what_differs(tmp_path):
  tx = checkpoint_tx(8, 3)
  spec = checkpoint_spec(tx)
  with CheckpointManager(tmp_path, spec) as checkpoints:
    checkpoints.save(0, random_state(spec))
  other = {
    "w": jax.ShapeDtypeStruct((5, 1000), jnp.float32),  # another shape
    "b": jax.ShapeDtypeStruct((64, 64), jnp.bfloat16),  # another dtype
    "bias": jax.ShapeDtypeStruct((3,), jnp.float32),  # "scale" renamed
  }
  spec = checkpoint_spec(tx, other)
  with CheckpointManager(tmp_path, spec) as checkpoints, pytest.raises(ValueError) as error:
    checkpoints.restore()
  message = str(error.value)
  assert "checkpoint step 0" in message
  assert "['params']['w']: shape (5, 1001) in the checkpoint, (5, 1000) in the spec" in message
  assert "['params']['b']: dtype float32 in the checkpoint, bfloat16 in the spec" in message
  assert "['params']['bias']: in the spec, not in the checkpoint" in message
  assert "['params']['scale']: in the checkpoint, not in the spec" in message
  assert ".mu['w']: shape (5, 1001)" in message  # the optimizer state is checked too
  assert sorted(os.listdir(tmp_path)) == ["0"]  # a misfit is not damage: nothing is renamed


def test_a_checkpoint_of_another_precision_policy_names_what_differs(tmp_path):
  spec = checkpoint_spec(checkpoint_tx(8, 2, "fp16"))
  with CheckpointManager(tmp_path, spec) as checkpoints:
    checkpoints.save(0, random_state(spec))
  bf16 = checkpoint_spec(checkpoint_tx(8, 3, "bf16"))
  with (
    CheckpointManager(tmp_path, bf16) as checkpoints,
    pytest.raises(
      ValueError, match=r"\['opt_state'\]\.loss_scale\.scale: in the checkpoint, not in"
    ),
  ):
    checkpoints.restore()


def test_saving_a_state_of_another_spec_raises(tmp_path):
  spec = checkpoint_spec(checkpoint_tx(8, 3))
  state = {**random_state(spec), "step": jnp.float32(0)}
  with (
    CheckpointManager(tmp_path, spec) as checkpoints,
    pytest.raises(ValueError, match=r"\['step'\]: dtype float32 in the state, int32 in the spec"),
  ):
    checkpoints.save(0, state)
  assert os.listdir(tmp_path) == []


# Directories that are not what they should be: a clear error or a warning, and no data lost.


def test_a_file_is_refused_as_a_checkpoint_directory(tmp_path):
  spec = checkpoint_spec(checkpoint_tx(8, 3))
  file = tmp_path / "notes.txt"
  file.write_text("keep me")
  for directory in (file, file / "checkpoints"):
    with pytest.raises(ValueError, match=f"checkpoints go in a directory, but {file} is a file"):
      CheckpointManager(directory, spec)
    with pytest.raises(ValueError, match=f"but {file} is a file") as raised:
      zerojax.load_params(directory)
    assert "creates it" not in str(raised.value)  # reading never creates a directory
  assert file.read_text() == "keep me"


def test_loading_from_a_missing_or_empty_directory_says_which(tmp_path):
  with pytest.raises(FileNotFoundError, match=f"the checkpoint directory {tmp_path / 'run'} does"):
    zerojax.load_params(tmp_path / "run")
  assert not (tmp_path / "run").exists()  # a read does not create it
  with pytest.raises(FileNotFoundError, match=f"^no checkpoints in {tmp_path}\\.$"):
    zerojax.export_safetensors(tmp_path, tmp_path / "model.safetensors")
  assert os.listdir(tmp_path) == []


def test_restoring_from_an_empty_directory_or_a_missing_step_raises(tmp_path):
  spec = checkpoint_spec(checkpoint_tx(8, 3))
  with CheckpointManager(tmp_path, spec) as checkpoints:
    with pytest.raises(FileNotFoundError, match=f"no checkpoints in {tmp_path}: nothing to"):
      checkpoints.restore()
    checkpoints.save(1, random_state(spec))
    checkpoints.wait()
    with pytest.raises(FileNotFoundError, match=r"no checkpoint for step 2 in .* steps \[1\]\)\.$"):
      checkpoints.restore(2)


def test_entries_named_like_a_step_that_are_not_checkpoints_are_left_alone(tmp_path):
  spec = checkpoint_spec(checkpoint_tx(8, 3))
  state = random_state(spec)
  with CheckpointManager(tmp_path, spec, max_to_keep=2) as checkpoints:
    checkpoints.save(5, state)
  (tmp_path / "7").mkdir()  # empty: taken for the latest step, then renamed 7.damaged, before
  (tmp_path / "3").mkdir()  # someone's data: deleted once out of max_to_keep, before
  (tmp_path / "3" / "notes.txt").write_text("keep me")
  (tmp_path / "9").write_text("a file")  # Orbax does not take a file for a step
  strangers = f"{tmp_path / '3'}, {tmp_path / '7'} in {tmp_path}: named like a checkpoint but"
  with pytest.warns(UserWarning, match=strangers):
    checkpoints = CheckpointManager(tmp_path, spec, max_to_keep=2)
  with checkpoints:
    assert checkpoints.all_steps() == [5] and checkpoints.latest_step() == 5
    assert int(checkpoints.restore()["step"]) == int(state["step"])
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / '7'} is not a checkpoint"):
      checkpoints.restore(7)
    for step in (7, 9):
      with pytest.raises(ValueError, match=f"save step {step}: {tmp_path / str(step)} exists"):
        checkpoints.save(step, state)
    for step in (6, 8, 10):
      checkpoints.save(step, state)
    checkpoints.wait()
    assert checkpoints.all_steps() == [8, 10]
  with pytest.warns(UserWarning, match=strangers):
    assert zerojax.load_params(tmp_path)["w"].shape == (5, 1001)
  assert sorted(os.listdir(tmp_path)) == ["10", "3", "7", "8", "9"]
  assert (tmp_path / "3" / "notes.txt").read_text() == "keep me"
  assert (tmp_path / "9").read_text() == "a file"


# Damage and crashes.


def test_a_damaged_latest_checkpoint_is_set_aside_and_the_one_before_restored(tmp_path):
  spec = checkpoint_spec(checkpoint_tx(8, 3))
  with CheckpointManager(tmp_path, spec) as checkpoints:
    for step in (1, 2):
      checkpoints.save(step, {**random_state(spec), "step": jnp.int32(step)})
  for path in (tmp_path / "2" / "layout").iterdir():
    path.unlink()
  (tmp_path / "2.damaged").mkdir()  # set aside before: kept
  with CheckpointManager(tmp_path, spec) as checkpoints:
    with pytest.warns(
      UserWarning,
      match=r"step 2 \(checkpoint step 2 .* no readable layout record .* moved to .*2\.damaged2\. "
      "Restored step 1",
    ):
      assert int(checkpoints.restore()["step"]) == 1
    assert checkpoints.all_steps() == [1]
  assert sorted(os.listdir(tmp_path)) == ["1", "2.damaged", "2.damaged2"]


def test_a_damaged_checkpoint_with_none_before_it_raises_and_stays(tmp_path):
  spec = checkpoint_spec(checkpoint_tx(8, 3))
  with CheckpointManager(tmp_path, spec) as checkpoints:
    checkpoints.save(0, random_state(spec))
  for path in (tmp_path / "0" / "layout").iterdir():
    path.unlink()
  with (
    CheckpointManager(tmp_path, spec) as checkpoints,
    pytest.raises(FileNotFoundError, match="no readable layout record"),
  ):
    checkpoints.restore()
  assert os.listdir(tmp_path) == ["0"]


def run_worker(*args, **popen):
  return subprocess.Popen(
    [sys.executable, str(CHECKPOINT_WORKER), *map(str, args)],
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    **popen,
  )


@pytest.fixture(scope="module")
def worker_checkpoint(tmp_path_factory):
  """A directory with the worker's checkpoint of step 1 (and its final.npz), made once."""
  directory = tmp_path_factory.mktemp("worker")
  output, _ = run_worker("train", directory, 1).communicate(timeout=120)
  assert "saving 1" in output, output
  return directory


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_damaged_checkpoint_raises_instead_of_restoring_part(tmp_path, worker_checkpoint, damage):
  directory = tmp_path / "checkpoints"
  shutil.copytree(worker_checkpoint, directory)
  data = [path for path in (directory / "1" / "state").rglob("*") if path.parent.name == "d"]
  largest = max(data, key=lambda path: path.stat().st_size)
  if damage == "truncate":
    os.truncate(largest, largest.stat().st_size // 2)
  else:
    largest.unlink()
  # In its own process: after a failed read, Orbax leaves unfinished reads that
  # Python reports when they are collected, which pytest would pin on some
  # later test.
  output, _ = run_worker("restore", directory).communicate(timeout=120)
  assert "error: checkpoint step 1" in output and "could not be read in full" in output, output
  # With nothing earlier to fall back to, it stays where it is (no resume from scratch).
  assert sorted(os.listdir(directory)) == ["1", "final.npz"]


def test_a_run_killed_mid_save_resumes_to_the_same_params(tmp_path):
  steps = 12
  # Without interruption.
  output, _ = run_worker("train", tmp_path / "whole", steps).communicate(timeout=120)
  assert f"saving {steps}" in output, output
  # Killed with SIGKILL while a save is in flight, then resumed.
  crashed = tmp_path / "crashed"
  crashed.mkdir()
  worker = run_worker("train", crashed, steps)
  deadline = time.monotonic() + 120
  while not any(".orbax-checkpoint-tmp" in name for name in os.listdir(crashed)) or not any(
    name.isdigit() for name in os.listdir(crashed)
  ):
    assert worker.poll() is None and time.monotonic() < deadline, "no save was caught in flight"
    time.sleep(0.002)
  os.kill(worker.pid, signal.SIGKILL)
  worker.communicate(timeout=60)
  assert worker.returncode == -signal.SIGKILL
  names = os.listdir(crashed)
  in_flight = [name for name in names if ".orbax-checkpoint-tmp" in name]
  complete = sorted(int(name) for name in names if name.isdigit())
  assert in_flight and complete, names
  assert int(in_flight[0].split(".")[0]) > complete[-1], "the partial save is the newest"
  output, _ = run_worker("train", crashed, steps).communicate(timeout=120)
  assert f"start {complete[-1]}\n" in output and f"saving {steps}" in output, output
  assert not [name for name in os.listdir(crashed) if ".orbax-checkpoint-tmp" in name]
  whole, resumed = final_params(tmp_path / "whole"), final_params(crashed)
  assert sorted(whole) == ["big", "w"]
  chex.assert_trees_all_equal(resumed, whole, strict=True)
