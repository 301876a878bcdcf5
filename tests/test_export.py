"""Export: a checkpoint's full-precision parameters, unpadded, streamed leaf by leaf."""

import json
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import optax

import zerojax
from zerojax import CheckpointManager, export_safetensors, load_params, train_state_spec


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
  assert params["layer"]["w"].shape == (5, 1008)
  loaded = load_params(tmp_path / "fp32")
  jax.tree.map(
    lambda a, b: np.testing.assert_array_equal(a, b, strict=True), loaded, tx.gather(params)
  )


def test_export_holds_about_one_leaf_in_host_memory(tmp_path, mesh):
  # 12 leaves of 4 MiB each once widened from bf16 to float32: 48 MiB in all.
  # Widening holds both copies of one leaf (1.5 leaves); Orbax adds a few KiB
  # of bookkeeping per leaf read.
  leaf = (1024, 1024)
  full = {f"layer{i}": jnp.full(leaf, i, jnp.bfloat16) for i in range(12)}
  tx = zerojax.zero3(optax.sgd(1e-3), mesh=mesh)
  save(tmp_path / "checkpoints", tx, full)
  largest = np.prod(leaf) * 4  # float32 once exported
  tracemalloc.start()
  try:
    tensors = export_safetensors(tmp_path / "checkpoints", tmp_path / "model.safetensors")
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  assert len(tensors) == 12
  assert peak < 2 * largest, f"peak {peak / 2**20:.1f} MiB for {largest / 2**20:.1f} MiB leaves"
  written = read_safetensors(tmp_path / "model.safetensors")
  for i in range(12):
    assert written[f"layer{i}"].shape == leaf and (written[f"layer{i}"] == i).all()
