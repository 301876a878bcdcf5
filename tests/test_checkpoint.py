"""Checkpoints: round trips, restoring onto other device counts and stages, errors, crashes."""

import functools
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from zerojax import CheckpointManager, StateSpec, train_state_spec

STAGES = {1: zerojax.zero1, 2: zerojax.zero2, 3: zerojax.zero3}
WORKER = pathlib.Path(__file__).with_name("checkpoint_worker.py")
# jax.make_mesh's default (explicit sharding in types) and the compiler-decides kind.
AXIS_TYPES = {"explicit": jax.sharding.AxisType.Explicit, "auto": jax.sharding.AxisType.Auto}

# "w" has no dimension that 2, 4 or 8 divides, so its stored shape changes with
# the device count (and stage 1 stores the params unpadded); "b" never pads;
# "scale" is too small to shard.
MODEL = {
  "w": jax.ShapeDtypeStruct((5, 1001), jnp.float32),
  "b": jax.ShapeDtypeStruct((64, 64), jnp.float32),
  "scale": jax.ShapeDtypeStruct((3,), jnp.float32),
}


@functools.cache
def make_tx(num_devices: int, stage: int, precision: str | None = None, axis_type: str = "auto"):
  """One transformation per setting, shared by the tests (and its compiled steps with it).

  Without ``precision``, every leaf is kept in its own dtype.
  """
  mesh = jax.make_mesh(
    (num_devices,),
    ("data",),
    devices=jax.devices()[:num_devices],
    axis_types=(AXIS_TYPES[axis_type],),
  )
  return STAGES[stage](optax.adam(1e-2), mesh=mesh, precision=precision)


def trained_state(tx, steps: int = 2):
  """A state whose every leaf, Adam's moments included, holds distinct values."""
  keys = iter(jax.random.split(jax.random.PRNGKey(0), 16))
  full = {name: jax.random.normal(next(keys), x.shape, x.dtype) for name, x in MODEL.items()}
  params = tx.shard(full)
  opt_state = tx.init(full)  # the full-precision values: the master copy, under mixed precision
  for _ in range(steps):
    grads = {name: jax.random.normal(next(keys), x.shape, x.dtype) for name, x in MODEL.items()}
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  return {
    "params": params,
    "opt_state": opt_state,
    "step": jnp.int32(steps),
    "rng": jax.random.PRNGKey(steps),
  }


@functools.cache
def trained(*setting) -> tuple[Any, StateSpec]:
  """``trained_state`` and its spec for ``make_tx(*setting)``, made once per setting."""
  tx = make_tx(*setting)
  return trained_state(tx), spec_for(tx)


def random_state(spec: StateSpec) -> Any:
  """A state of ``spec`` with random values in every leaf, without compiling a step.

  Padding is zeros, and a separate master copy's parameters are that copy
  rounded to their dtype, as ``tx.shard`` makes them: what a restore remakes.
  """
  rng = np.random.default_rng(0)

  def fill(logical, stored):
    if jnp.issubdtype(logical.dtype, jnp.floating):
      values = rng.standard_normal(logical.shape).astype(logical.dtype)
    else:
      values = rng.integers(0, 100, logical.shape).astype(logical.dtype)
    return pad_to(values, stored)

  state = jax.tree.map(fill, spec.logical, spec.stored)
  master = state["opt_state"].master
  if master is not None:
    params = jax.tree.map(
      lambda x, struct: pad_to(x.astype(struct.dtype), struct),
      unpadded(master, spec.logical["params"]),
      spec.stored["params"],
    )
    state = {**state, "params": params}
  return state


def pad_to(values: np.ndarray, stored: jax.ShapeDtypeStruct) -> jax.Array:
  """``values`` zero-padded at the end of each dimension to ``stored``'s shape, placed as it."""
  padded = np.zeros(stored.shape, values.dtype)
  padded[tuple(slice(0, n) for n in values.shape)] = values
  return jax.device_put(padded, stored.sharding)


def spec_for(tx):
  return train_state_spec(tx, MODEL, step=jnp.int32(0), rng=jax.random.PRNGKey(0))


def logical_values(state, spec):
  """Every leaf of ``state`` on the host, padding sliced off; checks the padding is zeros."""
  return unpadded(state, spec.logical)


def unpadded(tree, logical):
  """Every leaf on the host, cut to ``logical``'s shapes; checks what is cut off is zeros."""

  def unpad(x, logical):
    x = np.asarray(x)
    inside = tuple(slice(0, n) for n in logical.shape)
    padding = x.copy()
    padding[inside] = 0
    assert not padding.any(), "padding must stay zeros"
    return x[inside]

  return jax.tree.map(unpad, tree, logical)


def assert_same(actual, expected):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for path, a, e in zip(
    *zip(*jax.tree_util.tree_flatten_with_path(actual)[0], strict=True),
    jax.tree.leaves(expected),
    strict=True,
  ):
    assert a.dtype == e.dtype and a.shape == e.shape, jax.tree_util.keystr(path)
    np.testing.assert_array_equal(a, e, err_msg=jax.tree_util.keystr(path), strict=True)


def assert_placed(state, spec):
  for x, struct in zip(jax.tree.leaves(state), jax.tree.leaves(spec.stored), strict=True):
    assert x.shape == struct.shape and x.dtype == struct.dtype
    assert x.sharding.is_equivalent_to(struct.sharding, x.ndim)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_round_trip_is_bit_identical(tmp_path, axis_type, stage, precision):
  spec = spec_for(make_tx(8, stage, precision, axis_type))
  state = random_state(spec)
  with CheckpointManager(tmp_path, spec) as checkpoints:
    assert checkpoints.save(2, state)
  with CheckpointManager(tmp_path, spec) as checkpoints:
    assert checkpoints.latest_step() == 2
    restored = checkpoints.restore()
  assert_placed(restored, spec)
  assert_same(jax.tree.map(np.asarray, restored), jax.tree.map(np.asarray, state))


def master_and_rest(state, spec, tx):
  """The master parameters, and the rest of the state without any copy of the parameters."""
  values = logical_values(state, spec)
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
  tx = make_tx(*hops[0], precision, axis_type)
  expected_master, expected_rest = master_and_rest(state, spec, tx)
  if precision == "fp16":  # the loss scale moves too
    assert state["opt_state"].loss_scale is not None
  for hop, (num_devices, stage) in enumerate(hops[1:]):
    with CheckpointManager(tmp_path / str(hop), spec) as checkpoints:
      checkpoints.save(0, state)
    tx = make_tx(num_devices, stage, precision, axis_type)
    spec = spec_for(tx)
    with CheckpointManager(tmp_path / str(hop), spec) as checkpoints:
      state = checkpoints.restore()
    assert_placed(state, spec)
    master, rest = master_and_rest(state, spec, tx)
    assert_same(master, expected_master)
    assert_same(rest, expected_rest)
    # The params are the master copy as tx.shard places it (rounded to the compute dtype).
    rounded = tx.shard(jax.tree.map(jnp.asarray, expected_master))
    assert_same(logical_values(state, spec)["params"], unpadded(rounded, spec.logical["params"]))


def test_keeps_the_last_k_and_saves_every_interval(tmp_path):
  tx = make_tx(8, 3)
  state, spec = trained_state(tx, steps=0), spec_for(tx)
  with CheckpointManager(tmp_path, spec, max_to_keep=2, save_interval_steps=2) as checkpoints:
    saved = [checkpoints.save(step, state) for step in range(7)]
    assert checkpoints.save(7, state, force=True)
    checkpoints.wait()
    assert saved == [True, False, True, False, True, False, True]
    assert checkpoints.all_steps() == [6, 7]
  assert sorted(os.listdir(tmp_path)) == ["6", "7"]


def test_a_mismatched_checkpoint_names_what_differs(tmp_path):
  tx = make_tx(8, 3)
  with CheckpointManager(tmp_path, spec_for(tx)) as checkpoints:
    checkpoints.save(0, trained_state(tx, steps=0))
  other = {
    "w": jax.ShapeDtypeStruct((5, 1000), jnp.float32),  # another shape
    "b": jax.ShapeDtypeStruct((64, 64), jnp.bfloat16),  # another dtype
    "bias": jax.ShapeDtypeStruct((3,), jnp.float32),  # "scale" renamed
  }
  spec = train_state_spec(tx, other, step=jnp.int32(0), rng=jax.random.PRNGKey(0))
  with CheckpointManager(tmp_path, spec) as checkpoints, pytest.raises(ValueError) as error:
    checkpoints.restore()
  message = str(error.value)
  assert "checkpoint step 0" in message
  assert "['params']['w']: shape (5, 1001) in the checkpoint, (5, 1000) in the spec" in message
  assert "['params']['b']: dtype float32 in the checkpoint, bfloat16 in the spec" in message
  assert "['params']['bias']: in the spec, not in the checkpoint" in message
  assert "['params']['scale']: in the checkpoint, not in the spec" in message
  assert ".mu['w']: shape (5, 1001)" in message  # the optimizer state is checked too


def test_saving_a_state_of_another_spec_raises(tmp_path):
  tx = make_tx(8, 3)
  state = trained_state(tx, steps=0)
  state["step"] = jnp.float32(0)
  with (
    CheckpointManager(tmp_path, spec_for(tx)) as checkpoints,
    pytest.raises(ValueError, match=r"\['step'\]: dtype float32 in the state, int32 in the spec"),
  ):
    checkpoints.save(0, state)
  assert os.listdir(tmp_path) == []


def run_worker(*args, **popen):
  return subprocess.Popen(
    [sys.executable, str(WORKER), *map(str, args)],
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    **popen,
  )


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_damaged_checkpoint_raises_instead_of_restoring_part(tmp_path, damage):
  output, _ = run_worker("train", tmp_path, 1).communicate(timeout=120)
  assert "saving 1" in output, output
  data = [path for path in (tmp_path / "1" / "state").rglob("*") if path.parent.name == "d"]
  largest = max(data, key=lambda path: path.stat().st_size)
  if damage == "truncate":
    os.truncate(largest, largest.stat().st_size // 2)
  else:
    largest.unlink()
  # In its own process: after a failed read, Orbax leaves unfinished reads that
  # Python reports when they are collected, which pytest would pin on some
  # later test.
  output, _ = run_worker("restore", tmp_path).communicate(timeout=120)
  assert "error: checkpoint step 1" in output and "could not be read in full" in output, output
  # With nothing earlier to fall back to, it stays where it is (no resume from scratch).
  assert sorted(os.listdir(tmp_path)) == ["1", "final.npz"]


def test_a_checkpoint_without_its_layout_record_raises(tmp_path):
  tx = make_tx(8, 3)
  spec = spec_for(tx)
  with CheckpointManager(tmp_path, spec) as checkpoints:
    checkpoints.save(0, trained_state(tx, steps=0))
  for path in (tmp_path / "0" / "layout").iterdir():
    path.unlink()
  with (
    CheckpointManager(tmp_path, spec) as checkpoints,
    pytest.raises(FileNotFoundError, match="no readable layout record"),
  ):
    checkpoints.restore()


def test_restoring_a_missing_step_raises(tmp_path):
  tx = make_tx(8, 3)
  with (
    CheckpointManager(tmp_path, spec_for(tx)) as checkpoints,
    pytest.raises(FileNotFoundError, match=r"no checkpoint for step None .* steps \[\]"),
  ):
    checkpoints.restore()


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
  whole, resumed = np.load(tmp_path / "whole" / "final.npz"), np.load(crashed / "final.npz")
  assert sorted(whole) == sorted(resumed) == ["big", "w"]
  for name in whole:
    np.testing.assert_array_equal(resumed[name], whole[name], strict=True)


def test_a_checkpoint_of_another_precision_policy_names_what_differs(tmp_path):
  spec = spec_for(make_tx(8, 2, "fp16"))
  with CheckpointManager(tmp_path, spec) as checkpoints:
    checkpoints.save(0, random_state(spec))
  bf16 = spec_for(make_tx(8, 3, "bf16"))
  with (
    CheckpointManager(tmp_path, bf16) as checkpoints,
    pytest.raises(
      ValueError, match=r"\['opt_state'\]\.loss_scale\.scale: in the checkpoint, not in"
    ),
  ):
    checkpoints.restore()
