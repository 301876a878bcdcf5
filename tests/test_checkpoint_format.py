"""Checkpoints of the previous release restore with the current code.

tests/fixtures/checkpoint_0_1_0 was written by zerojax 0.1.0 (commit b85f1a7) with
tests/fixtures/make_checkpoint_0_1_0.py: stage 3 of AdamW under bf16 on 8 devices, a stacked
leaf, a padded one and a whole one, after two training steps; ``expected.npz`` beside it holds
every saved leaf's values without padding. Here the public paths of docs/checkpoints.md read it
(``CheckpointManager.restore`` onto 8 and 4 devices, stage 3 and stage 1, explicit and ``Auto``
axes; ``load_params``; ``python -m zerojax.export``) and every value must come back bit for bit.
A change to what the checkpoint holds (the layout record's fields, the items' names, the state's
containers) that the current code writes and reads consistently passes tests/test_checkpoint.py
and fails here: keep reading 0.1.0's checkpoints, or say in CHANGELOG.md that they no longer are.
"""

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zerojax
import zerojax.export
from tests.fixtures import make_checkpoint_0_1_0 as fixture
from tests.helpers import AXIS_TYPES, arrays, assert_placed, read_safetensors, unpadded

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "checkpoint_0_1_0"


@pytest.fixture
def directory(tmp_path) -> Path:
  """A copy of the fixture's checkpoints: nothing a restore might write reaches the repository."""
  return Path(shutil.copytree(FIXTURE / fixture.CHECKPOINTS, tmp_path / "checkpoints"))


@pytest.fixture(scope="module")
def expected() -> dict[str, np.ndarray]:
  """``{path: values}`` of every leaf 0.1.0 saved, unpadded, as it held them."""
  with np.load(FIXTURE / fixture.EXPECTED) as saved:
    return dict(saved)


def _spec(num_devices: int, stage: int, axis_type: str) -> zerojax.StateSpec:
  mesh = jax.make_mesh(
    (num_devices,),
    ("data",),
    devices=jax.devices()[:num_devices],
    axis_types=(AXIS_TYPES[axis_type],),
  )
  tx = {1: zerojax.zero1, 3: zerojax.zero3}[stage](
    fixture.optimizer(),
    mesh=mesh,
    min_shard_size=fixture.MIN_SHARD_SIZE,
    precision=fixture.PRECISION,
  )
  return zerojax.train_state_spec(tx, fixture.MODEL, step=jnp.int32(0), rng=jax.random.PRNGKey(0))


def _expected_for(path: str, expected: dict[str, np.ndarray], spec: zerojax.StateSpec):
  """What the leaf at ``path`` of a state of ``spec`` must hold, from 0.1.0's stage-3 values.

  Stage 3's parameters are its master copy; stage 1 under bf16 keeps that copy in
  ``opt_state.master`` and bf16 parameters rounded from it.
  """
  if spec.master_path == ("params",):
    return expected[path]
  master = "['opt_state'].master"
  if path.startswith(master):
    return expected["['params']" + path[len(master) :]]
  if path.startswith("['params']"):
    return expected[path].astype(jnp.bfloat16)
  return expected[path]


@pytest.mark.parametrize(
  "num_devices, stage, axis_type",
  [(8, 3, "explicit"), (4, 3, "auto"), (4, 1, "explicit")],
)
def test_a_0_1_0_checkpoint_restores_bit_for_bit(
  directory, expected, num_devices, stage, axis_type
):
  spec = _spec(num_devices, stage, axis_type)
  with zerojax.CheckpointManager(directory, spec) as checkpoints:
    assert checkpoints.all_steps() == [fixture.STEP]
    restored = checkpoints.restore(fixture.STEP)
  assert_placed(restored, spec)
  got = unpadded(restored, spec.logical)  # and checks that the padding is zeros
  leaves = {
    jax.tree_util.keystr(path): x for path, x in jax.tree_util.tree_flatten_with_path(got)[0]
  }
  params = [path[len("['params']") :] for path in expected if path.startswith("['params']")]
  masters = {"['opt_state'].master" + path for path in params}  # stage 1's master copy
  assert leaves.keys() == (expected.keys() if stage == 3 else expected.keys() | masters)
  # The padded leaf's master copy is padded for this device count, not the 8 it was saved on.
  master = arrays(restored)["params"] if stage == 3 else restored["opt_state"].master
  assert master["out"].shape == (8, {8: 16, 4: 12}[num_devices])
  for path, x in leaves.items():
    want = _expected_for(path, expected, spec)
    assert x.dtype == want.dtype, path
    np.testing.assert_array_equal(x, want, err_msg=path, strict=True)


def test_a_0_1_0_checkpoint_loads_and_exports(directory, expected, tmp_path, capsys):
  want = {path: x for path, x in expected.items() if path.startswith("['params']")}
  params = zerojax.load_params(directory)
  loaded = jax.tree_util.tree_flatten_with_path(params)[0]
  assert {"['params']" + jax.tree_util.keystr(path): x for path, x in loaded}.keys() == want.keys()
  for path, x in loaded:
    np.testing.assert_array_equal(x, want["['params']" + jax.tree_util.keystr(path)], strict=True)

  output = tmp_path / "model.safetensors"
  zerojax.export.main([str(directory), str(output)])  # zerojax-export
  assert f"wrote {len(want)} tensors" in capsys.readouterr().out
  exported = read_safetensors(output)
  assert exported.keys() == {"layers.up", "layers.down", "out", "bias"}
  for name, x in exported.items():
    np.testing.assert_array_equal(
      x, want["['params']" + "".join(f"['{key}']" for key in name.split("."))], strict=True
    )
