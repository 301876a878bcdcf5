"""Export: a checkpoint's full-precision parameters, unpadded, streamed leaf by leaf.

With its leaf reads swapped (a leak of one leaf, a read that fails):
zerojax/_src/checkpoint/export_test.py.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from tests.helpers import read_safetensors, save_for_export
from zerojax import export_safetensors, load_params
from zerojax.export import main as export_main


def test_exports_the_full_precision_unpadded_params(tmp_path, mesh):
  full = {
    "layer": {"w": jax.random.normal(jax.random.PRNGKey(0), (5, 1001))},  # padded in stage 3
    "count": jnp.arange(3, dtype=jnp.int32),
  }
  # Stage 2 under bf16 keeps bf16 params and a float32 master copy: export the master copy.
  tx = zerojax.zero2(optax.adam(1e-3), mesh=mesh, precision="bf16")
  params = save_for_export(tmp_path / "bf16", tx, full)
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
  params = save_for_export(tmp_path / "fp32", tx, full)
  chex.assert_shape(params["layer"]["w"], (5, 1008))
  loaded = load_params(tmp_path / "fp32")
  chex.assert_trees_all_equal(loaded, tx.gather(params), strict=True)


def test_the_command_line_writes_what_the_function_writes(tmp_path, mesh, capsys):
  full = {"w": jax.random.normal(jax.random.PRNGKey(0), (5, 1001))}
  save_for_export(tmp_path / "checkpoints", zerojax.zero3(optax.adam(1e-3), mesh=mesh), full)
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
  save_for_export(tmp_path / "checkpoints", tx, full)
  loaded = load_params(tmp_path / "checkpoints")
  expected = [list(layer) for layer in full]  # Orbax saves tuples as lists
  chex.assert_trees_all_equal(loaded, expected, strict=True)
  export_safetensors(tmp_path / "checkpoints", tmp_path / "model.safetensors")
  written = read_safetensors(tmp_path / "model.safetensors")
  assert sorted(written) == ["0.0", "0.1", "1.0", "1.1"]
  np.testing.assert_array_equal(written["1.0"], full[1][0], strict=True)


def test_parameters_whose_names_would_collide_are_refused(tmp_path, mesh):
  full = {"a.b": jnp.ones((4,)), "a": {"b": jnp.full((4,), 2.0)}}
  save_for_export(tmp_path / "checkpoints", zerojax.zero1(optax.sgd(1e-3), mesh=mesh), full)
  with pytest.raises(ValueError, match=r"two parameters would both be called 'a\.b'"):
    export_safetensors(tmp_path / "checkpoints", tmp_path / "model.safetensors")
  assert not (tmp_path / "model.safetensors").exists()
