"""``zerojax.export_pretrained``: the inverse of ``load_safetensors``' ``keys=``, into HuggingFace's
sharded layout, read back by zerojax onto any stage and device count and by HuggingFace's reader.
"""

import json
import os

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
import safetensors
import safetensors.numpy
from jax.sharding import Mesh

import zerojax
from tests import export_worker
from tests.helpers import STAGES, launch_worker, save_for_export


def model() -> dict[str, np.ndarray]:
  """Odd sizes (1001, 7: padded at stage 3), a stacked (layers, in, out) kernel, a 4-D stack."""
  rng = np.random.default_rng(0)
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  return {
    "embed": normal(1001, 16),
    "blocks": {"kernel": normal(3, 16, 1001), "bias": normal(3, 1001), "conv": normal(2, 3, 5, 7)},
    "head": {"scale": normal(7)},
  }


#: The files' names (HuggingFace's: one tensor a layer, PyTorch's (out, in)), by leaf name.
KEYS = {
  "embed": "model.embed_tokens.weight",
  "blocks.kernel": zerojax.FileKey([f"model.layers.{i}.proj.weight" for i in range(3)], (1, 0)),
  "blocks.bias": [f"model.layers.{i}.proj.bias" for i in range(3)],
  # A 3-D transpose that is not its own inverse: each file tensor is (5, 7, 3).
  "blocks.conv": zerojax.FileKey([f"model.layers.{i}.conv.weight" for i in range(2)], (2, 0, 1)),
  "head.scale": "model.norm.weight",
}


def expected_tensors(full: dict, dtype=np.float32) -> dict[str, np.ndarray]:
  """What the files should hold, made with numpy from the whole model."""
  out = {"model.embed_tokens.weight": full["embed"], "model.norm.weight": full["head"]["scale"]}
  for i in range(3):
    out[f"model.layers.{i}.proj.weight"] = full["blocks"]["kernel"][i].T
    out[f"model.layers.{i}.proj.bias"] = full["blocks"]["bias"][i]
  for i in range(2):
    out[f"model.layers.{i}.conv.weight"] = np.transpose(full["blocks"]["conv"][i], (1, 2, 0))
  return {name: np.asarray(array, dtype) for name, array in out.items()}


def read_with_huggingface(directory) -> dict[str, np.ndarray]:
  """Every tensor of the export, read by ``safetensors`` through the index (or the one file)."""
  index = directory / "model.safetensors.index.json"
  files = (
    sorted(set(json.loads(index.read_text())["weight_map"].values()))
    if index.exists()
    else ["model.safetensors"]
  )
  tensors = {}
  for file in files:
    tensors.update(safetensors.numpy.load_file(str(directory / file)))
  return tensors


def four_devices():
  return Mesh(np.array(jax.devices()[:4]), ("data",))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_round_trip_at_every_stage_onto_four_devices(stage, mesh, tmp_path):
  full = model()
  tx = STAGES[stage](optax.adam(1e-3), mesh=mesh, min_shard_size=1)
  params = tx.shard(full)
  zerojax.export_pretrained(tmp_path, tx, params, keys=KEYS, max_file_bytes=40_000)

  files = read_with_huggingface(tmp_path)
  expected = expected_tensors(full)
  assert files.keys() == expected.keys()
  chex.assert_trees_all_equal(files, expected)
  for stage_back in (1, 3):  # onto 4 devices, at another stage too
    back = STAGES[stage_back](optax.adam(1e-3), mesh=four_devices(), min_shard_size=1)
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), full)
    loaded = zerojax.load_safetensors(tmp_path, back, like, keys=KEYS)
    chex.assert_trees_all_equal(back.gather(loaded), full)


def test_bf16_and_the_master_copy_of_stage_2(mesh, tmp_path):
  """Stage 2 under bf16 compute: its master copy (padded, split) exported in bf16 is the
  full-precision parameters rounded once; the stored bf16 parameters give the same."""
  full = model()
  tx = zerojax.zero2(optax.adam(1e-3), mesh=mesh, precision="bf16", min_shard_size=1)
  params, opt_state = tx.shard(full), tx.init(full)
  master = tx.master_params(params, opt_state)
  zerojax.export_pretrained(tmp_path / "m", tx, master, keys=KEYS, dtype=jnp.bfloat16)
  zerojax.export_pretrained(tmp_path / "p", tx, params, keys=KEYS)

  expected = expected_tensors(full, ml_dtypes.bfloat16)
  for directory in (tmp_path / "m", tmp_path / "p"):
    with safetensors.safe_open(str(directory / "model.safetensors"), "numpy") as file:
      assert file.metadata() == {"format": "pt"}
      assert set(file.keys()) == expected.keys()
      for name in file.keys():  # noqa: SIM118 (safe_open is not a mapping)
        tensor = file.get_tensor(name)
        assert (tensor.dtype, tensor.shape) == (expected[name].dtype, expected[name].shape), name
        np.testing.assert_array_equal(tensor, expected[name], err_msg=name)
  assert not (tmp_path / "m" / "model.safetensors.index.json").exists()  # one file: no index


def test_the_index_names_every_tensor_and_the_files_hold_at_most_the_limit(mesh, tmp_path):
  full = model()
  tx = zerojax.zero3(optax.adam(1e-3), mesh=mesh, min_shard_size=1)
  (tmp_path / "model.safetensors").write_bytes(b"a stale export")
  (tmp_path / "model-00001-of-00009.safetensors").write_bytes(b"a stale shard")
  (tmp_path / "config.json").write_text("{}")
  written = zerojax.export_pretrained(
    tmp_path, tx, tx.shard(full), keys=KEYS, max_file_bytes=70_000
  )

  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  expected = expected_tensors(full)
  files = sorted(set(index["weight_map"].values()))
  count = len(files)
  assert count > 1
  assert files == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
  assert index["weight_map"].keys() == expected.keys()
  assert index["metadata"]["total_size"] == sum(t.nbytes for t in expected.values())
  assert written == {
    name: jax.ShapeDtypeStruct(tensor.shape, tensor.dtype) for name, tensor in expected.items()
  }
  for file in files:
    with safetensors.safe_open(str(tmp_path / file), "numpy") as opened:
      names = list(opened.keys())
      assert {index["weight_map"][n] for n in names} == {file}
      sizes = [expected[n].nbytes for n in names]
      assert sum(sizes) <= 70_000 or len(names) == 1, (file, names)
  # The stale weights files are gone, not the others.
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
    [*files, "model.safetensors.index.json", "config.json"]
  )


def test_from_a_checkpoint_directory(mesh, tmp_path):
  full = model()
  tx = zerojax.zero2(optax.adam(1e-3), mesh=mesh, precision="bf16", min_shard_size=1)
  save_for_export(tmp_path / "checkpoints", tx, full)
  zerojax.export_pretrained(tmp_path / "out", None, tmp_path / "checkpoints", keys=KEYS)
  chex.assert_trees_all_equal(read_with_huggingface(tmp_path / "out"), expected_tensors(full))


def test_keys_that_do_not_fit_are_named_before_anything_is_written(mesh, tmp_path):
  full = model()
  tx = zerojax.zero3(optax.adam(1e-3), mesh=mesh, min_shard_size=1)
  keys = {
    **KEYS,
    "blocks.bias": ["a.0", "a.1"],  # 3 layers
    "blocks.conv": zerojax.FileKey(KEYS["blocks.conv"].key, (1, 0)),  # 3 axes
    "head.scale": "model.embed_tokens.weight",  # taken
    "hed.bias": "x",  # no such leaf
  }
  with pytest.raises(ValueError) as error:
    zerojax.export_pretrained(tmp_path, tx, tx.shard(full), keys=keys)
  message = str(error.value)
  assert "blocks.bias: 2 names for a leading dimension of 3" in message, message
  assert "blocks.conv: transpose=(1, 0) is not a permutation" in message, message
  assert "'model.embed_tokens.weight' names both embed and head.scale" in message, message
  assert "keys maps 'hed.bias', which names no leaf" in message, message
  assert list(tmp_path.iterdir()) == []


def test_a_value_the_dtype_cannot_hold_is_refused(mesh, tmp_path):
  tx = zerojax.zero1(optax.adam(1e-3), mesh=mesh)
  params = tx.shard({"w": jnp.full((4, 8), 1e6)})
  with pytest.raises(ValueError, match=r"'w' holds 1000000.0 .* float16"):
    zerojax.export_pretrained(tmp_path, tx, params, dtype=jnp.float16)
  assert list(tmp_path.iterdir()) == []  # no partial file left


def test_two_processes_write_one_set_of_files_each_its_part(tmp_path):
  """2 processes x 4 devices (``tests/export_worker.py``): at stage 3 each writes its half of
  every tensor into the same files; at stage 2 each writes whole tensors, about half of them;
  HuggingFace's reader reads every tensor; each process's peak memory grows by a few pieces at
  most, not by its share of the files."""
  launch_worker("tests/export_worker.py", str(tmp_path))
  full = export_worker.model()
  expected = {
    name: tensor.astype(ml_dtypes.bfloat16)
    for name, tensor in export_worker.expected_tensors(full).items()
  }
  total_mib = sum(t.nbytes for t in expected.values()) / 2**20
  for stage in (3, 2):
    directory = tmp_path / f"stage{stage}"
    chex.assert_trees_all_equal(read_with_huggingface(directory), expected)
    tx = zerojax.zero3(optax.adam(1e-3), mesh=four_devices())
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), full)
    loaded = tx.gather(zerojax.load_safetensors(directory, tx, like, keys=export_worker.KEYS))
    rounded = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32), full)
    chex.assert_trees_all_equal(loaded, rounded)
    for process in (0, 1):
      report = json.loads((tmp_path / f"p{process}.json").read_text())[f"stage{stage}"]
      # Its half of the tensors' bytes (and the headers), not more.
      assert abs(report["written_mib"] - total_mib / 2) < 0.1 * total_mib, report
      # A few pieces (a 4 MiB piece read, transposed and cast: 0.1 to 12 MiB measured, as the
      # allocator keeps freed pieces or not), not its share of a leaf (16 MiB of the stacked
      # kernel as float32, whose copy would add that to the pieces).
      assert report["growth_mib"] < 16, report


def test_a_tensor_split_over_columns_is_written_in_whole_rows(mesh, tmp_path, monkeypatch):
  """Stage 3 splits the kernel's last axis, a file tensor's columns: this process's shards tile
  it, so it is written in pieces of whole rows, one write a piece, not one a row a device."""
  tx = zerojax.zero3(optax.adam(1e-3), mesh=mesh)
  params = tx.shard({"w": jnp.ones((512, 1024))})
  assert params["w"].sharding.spec == jax.sharding.PartitionSpec(None, "data")
  writes = []
  pwrite = os.pwrite
  monkeypatch.setattr(os, "pwrite", lambda *args: writes.append(args[2]) or pwrite(*args))
  zerojax.export_pretrained(tmp_path, tx, params)
  assert len(writes) == 1, writes  # 2 MiB: one piece
