"""Loading safetensors files into shards: ``zerojax.load_safetensors`` gives what ``tx.shard`` of
the whole parameters gives, reading only the regions each process holds.

Files are written with HuggingFace's own ``safetensors`` library (an independent writer), in its
sharded layout too (an index naming each tensor's file). The 2-process run, with each process's
peak memory and bytes read, is in ``tests/load_worker.py``.
"""

import json
import re
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

import zerojax
from tests.helpers import AXIS_TYPES, STAGES, arrays, save_for_export

LAYERS = 4  # split over a 'stage' axis of 2 too


def full_params(seed: int = 0) -> dict:
  """A scanned model with shapes that pad at stage 3 (1009 is prime; 67 and 131 are too)."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  return {
    "embed": normal(61, 128),
    "blocks": {"kernel": normal(LAYERS, 67, 131), "bias": normal(LAYERS, 131)},
    "head": {"kernel": normal(128, 1009)},
    "scale": normal(3),
    "count": np.arange(5, dtype=np.int32),
  }


def like(params):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)


def write_huggingface(directory: Path, params: dict, dtype=np.float32) -> None:
  """``params`` as HuggingFace keeps a model: layers apart (``h.0``, ``h.1``, ...), ``Linear``
  weights as ``(out, in)``, split over two files named by ``model.safetensors.index.json``."""
  cast = lambda x: x.astype(dtype) if x.dtype == np.float32 else x
  layers = {}
  for i in range(LAYERS):
    layers[f"h.{i}.mlp.weight"] = cast(params["blocks"]["kernel"][i].T.copy())
    layers[f"h.{i}.mlp.bias"] = cast(params["blocks"]["bias"][i])
  rest = {
    "wte.weight": cast(params["embed"]),
    "lm_head.weight": cast(params["head"]["kernel"].T.copy()),
    "ln_f.weight": cast(params["scale"]),
    "steps": params["count"],
    "unused.buffer": np.zeros(4, np.float32),  # a tensor no leaf names is not read
  }
  files = {"model-00001-of-00002.safetensors": layers, "model-00002-of-00002.safetensors": rest}
  weight_map = {}
  for name, tensors in files.items():
    save_file(tensors, str(directory / name))
    weight_map.update(dict.fromkeys(tensors, name))
  index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
  (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def huggingface_keys(name: str):
  """The files' names of the leaves of ``full_params``."""
  stacked = lambda suffix: [f"h.{i}.mlp.{suffix}" for i in range(LAYERS)]
  return {
    "embed": "wte.weight",
    "blocks.kernel": zerojax.FileKey(stacked("weight"), transpose=(1, 0)),
    "blocks.bias": stacked("bias"),
    "head.kernel": zerojax.FileKey("lm_head.weight", transpose=(1, 0)),
    "scale": "ln_f.weight",
    "count": "steps",
  }[name]


def mesh_of(count: int, axis_type: str):
  return jax.make_mesh((count,), ("data",), (AXIS_TYPES[axis_type],), devices=jax.devices()[:count])


def assert_placed_as(loaded, expected):
  """The same tree (``Stored`` layouts included), bit for bit, on the same shardings."""
  assert jax.tree.structure(loaded) == jax.tree.structure(expected)
  chex.assert_trees_all_equal(arrays(loaded), arrays(expected), strict=True)
  for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(expected), strict=True):
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim), (got.sharding, want.sharding)


@pytest.fixture(scope="module")
def huggingface_files(tmp_path_factory):
  directory = tmp_path_factory.mktemp("huggingface")
  write_huggingface(directory, full_params())
  return directory


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
@pytest.mark.parametrize("stage", STAGES)
def test_loads_huggingface_files_as_shard_places_the_whole_model(
  huggingface_files, stage, axis_type
):
  tx = STAGES[stage](optax.adam(1e-3), mesh=mesh_of(8, axis_type))
  full = full_params()
  loaded = zerojax.load_safetensors(huggingface_files, tx, like(full), keys=huggingface_keys)
  assert_placed_as(loaded, tx.shard(full))
  if stage == 3:
    assert loaded["head"]["kernel"].layout.padding == 7  # 1009 -> 1016 on 8 devices


def test_the_index_file_and_a_list_of_files_name_the_same_tensors(huggingface_files):
  tx = zerojax.zero3(optax.adam(1e-3), mesh=mesh_of(4, "explicit"))
  full = full_params()
  expected = tx.shard(full)
  index = huggingface_files / "model.safetensors.index.json"
  files = sorted(huggingface_files.glob("*.safetensors"))
  for paths in (index, files):
    assert_placed_as(
      zerojax.load_safetensors(paths, tx, like(full), keys=huggingface_keys), expected
    )


@pytest.mark.parametrize(("stage", "precision"), [(3, None), (3, "bf16"), (2, "bf16"), (1, None)])
def test_a_bfloat16_file_loads_exactly(tmp_path, stage, precision):
  # A bf16 file into float32 leaves: the float32 master copy holds the bf16 values exactly, and a
  # bf16 compute dtype stores them as they are.
  write_huggingface(tmp_path, full_params(), dtype=ml_dtypes.bfloat16)
  full = jax.tree.map(
    lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32) if x.dtype == np.float32 else x,
    full_params(),
  )
  tx = STAGES[stage](optax.adam(1e-3), mesh=mesh_of(8, "explicit"), precision=precision)
  loaded = zerojax.load_safetensors(tmp_path, tx, like(full), keys=huggingface_keys)
  assert_placed_as(loaded, tx.shard(full))


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
@pytest.mark.parametrize(("stage", "precision"), [(1, "bf16"), (2, "bf16"), (3, "bf16"), (2, None)])
def test_init_makes_the_optimizer_state_of_the_full_precision_values(
  huggingface_files, stage, precision, axis_type
):
  # Stages 1 and 2 under bf16 compute store the parameters rounded and keep the float32 master
  # copy apart, in the optimizer state: it holds the file's values, as tx.init(full) makes it.
  tx = STAGES[stage](optax.adam(1e-3), mesh=mesh_of(8, axis_type), precision=precision)
  full = full_params()
  params, opt_state = zerojax.load_safetensors(
    huggingface_files, tx, like(full), keys=huggingface_keys, init=True
  )
  assert_placed_as(params, tx.shard(full))
  assert_placed_as(opt_state, tx.init(full))


def test_leaves_placed_on_another_axis_load_as_shard_places_them(huggingface_files):
  # Layers split over a "stage" axis, as a pipeline places them: the data axis joins on another
  # dimension. (tests/load_worker.py checks that each process then reads only its own layers.)
  mesh = jax.make_mesh((2, 4), ("stage", "data"), axis_types=(AXIS_TYPES["auto"],) * 2)
  tx = zerojax.zero3(optax.adam(1e-3), mesh=mesh)
  full = full_params()
  staged = NamedSharding(mesh, P("stage"))
  structs = like(full)
  structs["blocks"] = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=staged), structs["blocks"]
  )
  loaded = zerojax.load_safetensors(huggingface_files, tx, structs, keys=huggingface_keys)
  placed = {**full, "blocks": jax.device_put(full["blocks"], staged)}
  assert_placed_as(loaded, tx.shard(placed))
  assert loaded["blocks"]["kernel"].sharding.spec == P("stage", None, "data")
  # The master copy kept apart at stage 2 is on the stage axis too.
  tx = zerojax.zero2(optax.adam(1e-3), mesh=mesh, precision="bf16")
  loaded = zerojax.load_safetensors(
    huggingface_files, tx, structs, keys=huggingface_keys, init=True
  )
  assert_placed_as(loaded, (tx.shard(placed), tx.init(placed)))
  assert loaded[1].master["blocks"]["kernel"].sharding.spec == P("stage", None, "data")


def test_a_round_trip_through_export_is_exact_onto_another_stage_and_device_count(tmp_path):
  # Train a step on 8 devices at stage 3, save, export; load on 4 devices at stage 1 and on 2 at
  # stage 3, on both kinds of axes.
  full = {k: v for k, v in full_params().items() if k != "count"}
  tx = zerojax.zero3(optax.adam(1e-2), mesh=mesh_of(8, "auto"))
  params = tx.shard(full)
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, tx.gather(params))
  updates, state = jax.jit(tx.update)(grads, state, params)
  trained = optax.apply_updates(params, updates)
  save_for_export(tmp_path / "run", tx, tx.gather(trained))
  zerojax.export_safetensors(tmp_path / "run", tmp_path / "model.safetensors")
  for stage, count, axis_type in ((1, 4, "explicit"), (3, 2, "auto")):
    other = STAGES[stage](optax.adam(1e-2), mesh=mesh_of(count, axis_type))
    loaded = zerojax.load_safetensors(tmp_path / "model.safetensors", other, like(full))
    assert_placed_as(loaded, other.shard(tx.gather(trained)))


def test_what_does_not_fit_is_named_with_the_fix(huggingface_files):
  tx = zerojax.zero3(optax.adam(1e-3), mesh=mesh_of(8, "auto"))
  full = full_params()
  structs = like(full)
  structs["count"] = jax.ShapeDtypeStruct((5,), jnp.float32)  # an integer tensor
  keys = {
    "embed": "wte.weights",  # misspelt
    "blocks.kernel": [f"h.{i}.mlp.weight" for i in range(LAYERS)],  # not transposed
    "blocks.bias": "h.0.mlp.bias",  # one layer for four
    "head.kernel": "lm_head.weight",  # not transposed
    "scale": "ln_f.weight",
    "count": "steps",
  }
  with pytest.raises(ValueError) as error:
    zerojax.load_safetensors(huggingface_files, tx, structs, keys=keys)
  message = str(error.value)
  assert "5 of 6 leaves do not fit" in message
  assert (
    "embed: tensor 'wte.weights' (from keys) is not in the files; the closest there: ['wte.weight'"
    in message
  )
  assert (
    "blocks.kernel: tensor 'h.0.mlp.weight' gives shape (4, 131, 67), the leaf has (4, 67, 131)"
    in message
  )
  assert (
    "blocks.bias: tensor 'h.0.mlp.bias' gives shape (131,), the leaf has (4, 131); it fits one "
    "layer: give 4 names" in message
  )
  assert "zerojax.FileKey('lm_head.weight', transpose=(1, 0))" in message
  assert "count: tensor 'steps' is int32 and the leaf float32" in message


def test_a_bad_path_or_file_says_what_to_pass(tmp_path):
  tx = zerojax.zero3(optax.adam(1e-3), mesh=mesh_of(8, "auto"))
  structs = {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)}
  with pytest.raises(ValueError, match=r"does not exist: pass a \.safetensors file"):
    zerojax.load_safetensors(tmp_path / "missing.safetensors", tx, structs)
  with pytest.raises(ValueError, match=r"holds no \.safetensors files"):
    zerojax.load_safetensors(tmp_path, tx, structs)
  (tmp_path / "bad.safetensors").write_bytes(b"\x10" + b"\x00" * 7 + b"not json")
  with pytest.raises(ValueError, match="is not a safetensors file"):
    zerojax.load_safetensors(tmp_path / "bad.safetensors", tx, structs)
  save_file({"w": np.ones((4, 4), np.float32)}, str(tmp_path / "cut.safetensors"))
  data = (tmp_path / "cut.safetensors").read_bytes()
  (tmp_path / "cut.safetensors").write_bytes(data[:-8])
  with pytest.raises(ValueError, match="truncated"):
    zerojax.load_safetensors(tmp_path / "cut.safetensors", tx, structs)


def test_values_take_the_dtype_of_like_before_the_stored_one(huggingface_files):
  # A float32 file into a bfloat16 leaf of a float32 master copy: rounded to bfloat16 first, as
  # tx.shard of the bfloat16 parameters stores them.
  tx = zerojax.zero3(optax.adam(1e-3), mesh=mesh_of(8, "auto"), precision="fp32")
  full = full_params()
  full["embed"] = full["embed"].astype(ml_dtypes.bfloat16)
  loaded = zerojax.load_safetensors(huggingface_files, tx, like(full), keys=huggingface_keys)
  assert loaded["embed"].dtype == np.float32
  assert_placed_as(loaded, tx.shard(full))


@pytest.mark.parametrize("piece_bytes", [64, 40_000])
def test_leaves_read_in_pieces_load_the_same(huggingface_files, monkeypatch, piece_bytes):
  # Pieces of part of a row, of several rows: each scattered into its shards.
  monkeypatch.setattr(zerojax._src.checkpoint.load, "PIECE_BYTES", piece_bytes)
  for stage in (1, 3):
    tx = STAGES[stage](optax.adam(1e-3), mesh=mesh_of(8, "explicit"))
    full = full_params()
    loaded = zerojax.load_safetensors(huggingface_files, tx, like(full), keys=huggingface_keys)
    assert_placed_as(loaded, tx.shard(full))


@pytest.mark.parametrize("piece_bytes", [24, 200, zerojax._src.checkpoint.load.PIECE_BYTES])
def test_a_transpose_of_three_axes_reads_each_region_from_its_own_axes(
  tmp_path, monkeypatch, piece_bytes
):
  # (1, 2, 0) and (2, 0, 1) are each other's inverse, unlike a transpose of two axes: reading
  # a leaf's region from the file's axes the wrong way round gives other values. Pieces of a
  # few elements cut every axis; a stack of them is read one layer at a time.
  monkeypatch.setattr(zerojax._src.checkpoint.load, "PIECE_BYTES", piece_bytes)
  rng = np.random.default_rng(0)
  layers = {f"h.{i}": rng.standard_normal((3, 5, 17)).astype(np.float32) for i in range(2)}
  save_file(layers, str(tmp_path / "model.safetensors"))
  tx = zerojax.zero3(optax.adam(1e-3), mesh=mesh_of(8, "explicit"))
  for transpose in ((1, 2, 0), (2, 0, 1)):
    full = {
      "one": layers["h.0"].transpose(transpose),
      "stacked": np.stack([x.transpose(transpose) for x in layers.values()]),
    }
    keys = {
      "one": zerojax.FileKey("h.0", transpose=transpose),
      "stacked": zerojax.FileKey(list(layers), transpose=transpose),
    }
    loaded = zerojax.load_safetensors(tmp_path / "model.safetensors", tx, like(full), keys=keys)
    assert_placed_as(loaded, tx.shard(full))


def test_init_at_stage_3_with_the_master_copy_apart_returns_the_compute_copy(huggingface_files):
  # Offloading the master copy keeps it apart at stage 3 too: the parameters are the bf16
  # compute copy, the float32 master copy is in the optimizer state.
  tx = zerojax.zero3(
    optax.adam(1e-3), mesh=mesh_of(8, "explicit"), precision="bf16", offload="optimizer+master"
  )
  full = full_params()
  params, opt_state = zerojax.load_safetensors(
    huggingface_files, tx, like(full), keys=huggingface_keys, init=True
  )
  assert params["embed"].dtype == jnp.bfloat16
  assert_placed_as(params, tx.shard(full))
  assert_placed_as(opt_state, tx.init(full))


def test_a_layer_named_twice_in_a_stack_is_refused(huggingface_files):
  tx = zerojax.zero3(optax.adam(1e-3), mesh=mesh_of(8, "auto"))
  names = ["h.0.mlp.bias", "h.1.mlp.bias", "h.0.mlp.bias", "h.3.mlp.bias"]
  with pytest.raises(
    ValueError,
    match=re.escape(
      "blocks.bias: tensor 'h.0.mlp.bias' is stacked into it as layers 0 and 2: name each "
      "layer's own tensor"
    ),
  ):
    zerojax.load_safetensors(
      huggingface_files,
      tx,
      like(full_params()),
      keys=lambda name: names if name == "blocks.bias" else huggingface_keys(name),
    )


def test_keys_that_name_no_leaf_are_refused_with_the_closest_leaves(tmp_path):
  save_file({"embed": np.ones((4, 8), np.float32)}, str(tmp_path / "model.safetensors"))
  tx = zerojax.zero3(optax.adam(1e-3), mesh=mesh_of(8, "auto"))
  structs = {"embed": jax.ShapeDtypeStruct((4, 8), jnp.float32)}
  with pytest.raises(ValueError) as error:
    zerojax.load_safetensors(
      tmp_path / "model.safetensors", tx, structs, keys={"embd": "embed", "zzz": "embed"}
    )
  message = str(error.value)
  assert "keys maps 'embd', which names no leaf (did you mean 'embed'?)" in message
  assert "keys maps 'zzz', which names no leaf\n" in message
  assert "leaves do not fit" not in message  # the leaf itself loads


@pytest.mark.parametrize("piece_bytes", [16, zerojax._src.checkpoint.load.PIECE_BYTES])
def test_values_a_dtype_cannot_hold_are_refused_naming_the_tensor_and_the_fix(
  tmp_path, monkeypatch, piece_bytes
):
  monkeypatch.setattr(zerojax._src.checkpoint.load, "PIECE_BYTES", piece_bytes)
  big = np.ones((4, 8), np.float32)
  big[2, 4], big[2, 5] = 7e4, -1e6  # in one piece of 16 bytes: the larger magnitude is named
  layers = {"h.0": np.ones((4, 8), np.float32), "h.1": big, "steps": np.array([1, 2**40])}
  layers["h.0"][0, 0] = np.inf  # inf in the file stays inf: not an overflow
  save_file(layers, str(tmp_path / "model.safetensors"))
  path = tmp_path / "model.safetensors"
  half = {"layers": jax.ShapeDtypeStruct((2, 4, 8), jnp.float16)}
  keys = {"layers": ["h.0", "h.1"]}
  tx = zerojax.zero3(optax.adam(1e-3), mesh=mesh_of(8, "auto"))
  with pytest.raises(ValueError) as error:
    zerojax.load_safetensors(path, tx, half, keys=keys)
  assert str(error.value) == (
    "layers: tensor 'h.1', float32, holds -1000000.0 (at (1, 2, 5) of the leaf), beyond the "
    "range of float16 (-65504.0 to 65504.0), the leaf's dtype in `like`: cast, it would be -inf. "
    "Give the leaf a dtype that holds it in `like` (the file's does), or rescale the tensor in "
    "the file."
  )
  steps = {"steps": jax.ShapeDtypeStruct((2,), jnp.int32)}
  with pytest.raises(
    ValueError, match=r"steps: tensor 'steps', int64, holds 1099511627776 \(at \(1,\)"
  ):
    zerojax.load_safetensors(path, tx, steps)
  # Stored in float16 by the precision policy.
  tx = zerojax.zero1(optax.adam(1e-3), mesh=mesh_of(8, "auto"), precision="fp16")
  full = {"layers": jax.ShapeDtypeStruct((2, 4, 8), jnp.float32)}
  with pytest.raises(
    ValueError, match=r"float16 .*, the dtype the precision policy stores the leaf in: cast, it"
  ):
    zerojax.load_safetensors(path, tx, full, keys=keys)
  # Values it holds load, with no warning from numpy.
  half = {"layers": jax.ShapeDtypeStruct((4, 8), jnp.float16)}
  loaded = zerojax.load_safetensors(path, tx, half, keys={"layers": "h.0"})
  np.testing.assert_array_equal(tx.gather(loaded)["layers"], layers["h.0"].astype(np.float16))
