"""Misuses of the public API, as a new user makes them: each ends in an error that says the fix.

The cases are keyed by the message fragments of docs/guide.md's errors table,
so the table and the tests cannot drift apart; so are the mistakes that give
the right answer anyway, by the first column of the table after it.
"""

import json
import pathlib
import re
import tempfile
import types as types_lib
import warnings

import flax.linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

import zerojax
import zerojax.flax.linen
from tests.helpers import arrays

MESH_TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}
GUIDE = pathlib.Path(__file__).parent.parent / "docs" / "guide.md"


def _mesh(types, n=8):
  return jax.make_mesh((n,), ("data",), (types,), devices=jax.devices()[:n])


def _loss(params, x, *_):
  return jnp.mean(x @ zerojax.gather(params)["w"])


def _step(tx, params, *batch, **options):
  """``value_and_grad`` of ``_loss`` under ``jax.jit``, as a training step runs it."""
  grad_fn = zerojax.value_and_grad(_loss, tx, **options)
  return jax.jit(lambda params, *batch: grad_fn(params, *batch))(params, *batch)


def _w(tx, **extra):
  return tx.shard({"w": jnp.ones((4, 1024)), **extra})


def axis_name_typo(types):
  zerojax.zero2(optax.sgd(0.1), mesh=_mesh(types), axis_name="dta")


def no_mesh(types):
  zerojax.zero1(optax.sgd(0.1))


def not_an_optimizer(types):
  zerojax.zero2(lambda x: x, mesh=_mesh(types))


def nested_transformations(types):
  mesh = _mesh(types)
  zerojax.zero3(zerojax.zero3(optax.adam(1e-3), mesh=mesh), mesh=mesh)


def indivisible_batch(types):
  tx = zerojax.zero1(optax.sgd(0.1), mesh=_mesh(types))
  _step(tx, _w(tx), jnp.ones((10, 4)))


def indivisible_micro_batches(types):
  tx = zerojax.zero2(optax.sgd(0.1), mesh=_mesh(types))
  _step(tx, _w(tx), jnp.ones((16, 4)), microbatches=4)


def mismatched_batch(types):
  tx = zerojax.zero2(optax.sgd(0.1), mesh=_mesh(types))
  _step(tx, _w(tx), jnp.ones((16, 4)), {"y": jnp.ones((8, 1024))})


def keys_one_per_device(types):
  tx = zerojax.zero2(optax.sgd(0.1), mesh=_mesh(types))
  _step(tx, _w(tx), jnp.ones((64, 4)), jax.random.split(jax.random.key(0), tx.num_shards))


def unplaced_padded_params(types):
  tx = zerojax.zero3(optax.sgd(0.1), mesh=_mesh(types), min_shard_size=1)
  zerojax.value_and_grad(lambda p, x: jnp.sum(x), tx)({"w": jnp.ones((7, 13))}, jnp.ones((8, 4)))


def params_of_another_mesh_in_jit(types):
  small = zerojax.zero3(optax.sgd(0.1), mesh=_mesh(types, 4))
  _step(zerojax.zero3(optax.sgd(0.1), mesh=_mesh(types)), _w(small), jnp.ones((8, 4)))


def state_of_another_mesh_in_jit(types):
  small = zerojax.zero1(optax.adam(0.1), mesh=_mesh(types, 4))
  tx = zerojax.zero1(optax.adam(0.1), mesh=_mesh(types))
  params, state = _w(tx), small.init({"w": jnp.ones((4, 1024))})
  jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), state, params)


def _stored_on_8(types):
  """A (4, 1001) leaf stored over 8 devices, padded to (4, 1008): over 4 it would be (4, 1004)."""
  return zerojax.zero3(optax.sgd(0.1), mesh=_mesh(types)).shard({"w": jnp.ones((4, 1001))})


def gather_of_another_mesh(types):
  zerojax.zero3(optax.sgd(0.1), mesh=_mesh(types, 4)).gather(_stored_on_8(types))


def forward_of_another_mesh(types):
  tx = zerojax.zero3(optax.sgd(0.1), mesh=_mesh(types, 4))
  logits = lambda params, x: x @ zerojax.gather(params)["w"]
  zerojax.forward(logits, tx)(_stored_on_8(types), jnp.ones((8, 4)))


def integer_leaf(types):
  tx = zerojax.zero1(optax.sgd(0.1), mesh=_mesh(types))
  _step(tx, _w(tx, step=jnp.int32(0)), jnp.ones((8, 4)))


def scalar_loss_with_aux(types):
  tx = zerojax.zero3(optax.sgd(0.1), mesh=_mesh(types))
  _step(tx, _w(tx), jnp.ones((8, 4)), has_aux=True)


def tx_gather_inside_the_loss(types):
  tx = zerojax.zero3(optax.sgd(0.1), mesh=_mesh(types))
  loss = lambda params, x: jnp.mean(x @ tx.gather(params)["w"])
  jax.jit(zerojax.value_and_grad(loss, tx))(_w(tx), jnp.ones((8, 4)))


def chain_given_to_value_and_grad(types):
  tx = optax.chain(optax.clip(1.0), zerojax.zero1(optax.sgd(0.1), mesh=_mesh(types)))
  zerojax.value_and_grad(_loss, tx)


def non_array_leaf(types):
  zerojax.zero3(optax.sgd(0.1), mesh=_mesh(types)).shard({"w": jnp.ones(4), "name": "layer"})


def sharded_init_of_a_float_leaf(types):
  tx = zerojax.zero3(optax.sgd(0.1), mesh=_mesh(types))
  tx.sharded_init(lambda: {"w": jnp.ones((4, 1024)), "scale": 1.0})()


def sharded_init_of_built_params(types):
  zerojax.zero3(optax.sgd(0.1), mesh=_mesh(types)).sharded_init({"w": jnp.ones((4, 1024))})


def state_of_another_model(types):
  tx = zerojax.zero1(optax.adam(0.1), mesh=_mesh(types))
  tx.update(_w(tx), tx.init({"w": jnp.ones((8, 256))}), _w(tx))


def not_a_zero_state(types):
  tx = zerojax.zero1(optax.adam(0.1), mesh=_mesh(types))
  tx.update(_w(tx), optax.adam(0.1).init(_w(tx)), _w(tx))


def init_after_shard_under_bf16(types):
  tx = zerojax.zero2(optax.adam(0.1), mesh=_mesh(types), precision="bf16")
  tx.init(_w(tx))


def loss_scale_without_state(types):
  tx = zerojax.zero2(optax.adam(0.1), mesh=_mesh(types), precision="fp16")
  _step(tx, _w(tx), jnp.ones((8, 4)))


def update_without_params_under_bf16(types):
  tx = zerojax.zero1(optax.adam(0.1), mesh=_mesh(types), precision="bf16")
  state = tx.init({"w": jnp.ones((4, 1024))})
  tx.update(jax.tree.map(jnp.ones_like, _w(tx)), state)


def state_of_another_policy(types):
  tx = zerojax.zero1(optax.adam(0.1), mesh=_mesh(types), precision="bf16")
  other = zerojax.zero1(optax.adam(0.1), mesh=_mesh(types))
  tx.update(jax.tree.map(jnp.ones_like, _w(tx)), other.init(_w(other)), _w(tx))


def replaced_init(types):
  tx = zerojax.zero1(optax.sgd(0.1), mesh=_mesh(types))
  _ = tx._replace(init=optax.sgd(0.1).init).stage


def cpu_devices_as_text(types):
  zerojax.distributed.use_cpu_devices("8")


def batch_by_keyword(types):
  tx = zerojax.zero1(optax.sgd(0.1), mesh=_mesh(types))
  zerojax.value_and_grad(_loss, tx)(_w(tx), x=jnp.ones((8, 4)))


def offloaded_state_without_offload(types):
  mesh = _mesh(types)
  offloaded = zerojax.zero2(optax.adam(0.1), mesh=mesh, offload="optimizer")
  tx = zerojax.zero2(optax.adam(0.1), mesh=mesh)
  params = _w(tx)
  tx.update(jax.tree.map(jnp.ones_like, params), offloaded.init(params), params)


def summed_loss(types):
  tx = zerojax.zero3(optax.sgd(0.1), mesh=_mesh(types))
  loss = lambda params, x: jnp.sum(x @ zerojax.gather(params)["w"])
  jax.jit(zerojax.value_and_grad(loss, tx))(_w(tx), jnp.ones((8, 4)))


def min_shard_size_as_text(types):
  zerojax.zero2(optax.sgd(0.1), mesh=_mesh(types), min_shard_size="1024")


def negative_min_shard_size(types):
  zerojax.zero3(optax.sgd(0.1), mesh=_mesh(types), min_shard_size=-1)


def transformation_as_checkpoint_spec(types):
  tx = zerojax.zero1(optax.sgd(0.1), mesh=_mesh(types))
  zerojax.CheckpointManager(GUIDE.parent / "_never_created", tx)  # refused before it is made


def checkpoint_of_another_optimizer(types):
  tx = zerojax.zero3(optax.adam(0.1), mesh=_mesh(types))
  adamw = zerojax.zero3(optax.adamw(0.1), mesh=_mesh(types))
  with tempfile.TemporaryDirectory() as directory:
    with zerojax.CheckpointManager(directory, zerojax.train_state_spec(tx, _w(tx))) as saved:
      saved.save(0, {"params": _w(tx), "opt_state": tx.init(_w(tx))})
    with zerojax.CheckpointManager(directory, zerojax.train_state_spec(adamw, _w(tx))) as other:
      other.restore()  # the same leaves as adam's: only the empty states differ


def checkpoint_step_not_whole(types):
  tx = zerojax.zero1(optax.sgd(0.1), mesh=_mesh(types))
  spec = zerojax.train_state_spec(tx, _w(tx))
  with tempfile.TemporaryDirectory() as directory, zerojax.CheckpointManager(directory, spec) as m:
    m.save(1.5, {"params": _w(tx), "opt_state": tx.init(_w(tx))})


def collectives_of_a_lowered_step(types):
  zerojax.diagnostics.count_collectives(jax.jit(lambda x: x * 2).lower(jnp.ones(8)))


def load_params_of_one_step_s_directory(types):
  tx = zerojax.zero1(optax.sgd(0.1), mesh=_mesh(types))
  spec = zerojax.train_state_spec(tx, _w(tx))
  with tempfile.TemporaryDirectory() as directory:
    with zerojax.CheckpointManager(directory, spec) as manager:
      manager.save(1, {"params": _w(tx), "opt_state": tx.init(_w(tx))})
    zerojax.load_params(pathlib.Path(directory) / "1")


#: A model as HuggingFace keeps it: an embedding, two layers' Linear weights (out, in), a count.
_MODEL = {
  "wte.weight": np.ones((16, 8), np.float32),
  **{f"h.{i}.weight": np.ones((8, 4), np.float32) for i in range(2)},
  "steps": np.zeros(3, np.int32),
}


def _load_files(types, like, keys=None, write=None, stage=3, **options):
  """``zerojax.load_safetensors`` at ``stage`` (with its transformation's ``options``) of ``like``
  (``{leaf: shape}`` of float32, or ``jax.ShapeDtypeStruct`` s) from ``_MODEL`` saved in a
  temporary directory, or from the path ``write(directory)`` returns."""
  tx = getattr(zerojax, f"zero{stage}")(optax.adam(0.1), mesh=_mesh(types), **options)
  structs = {
    name: s if isinstance(s, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(s, jnp.float32)
    for name, s in like.items()
  }
  with tempfile.TemporaryDirectory() as directory:
    directory = pathlib.Path(directory)
    if write is None:
      save_file(_MODEL, str(directory / "model.safetensors"))
    path = directory / "model.safetensors" if write is None else write(directory)
    zerojax.load_safetensors(path, tx, structs, keys=keys)


def _raw_file(directory, header, data):
  """A file of the format with the ``header`` given as it is."""
  encoded = json.dumps(header).encode()
  path = directory / "model.safetensors"
  path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + data)
  return path


def _file_of(tensors):
  """The ``write`` of ``_load_files`` for a file of ``tensors`` (names to numpy arrays)."""

  def write(directory):
    save_file(tensors, str(directory / "model.safetensors"))
    return directory / "model.safetensors"

  return write


def _cut(end):
  """The ``write`` of ``_load_files`` for a file of a tensor ``w`` cut to its bytes ``[:end]``."""

  def write(directory):
    path = _file_of({"w": np.ones(4, np.float32)})(directory)
    path.write_bytes(path.read_bytes()[:end])
    return path

  return write


def load_keys_as_a_list(types):
  _load_files(types, {"embed": (16, 8)}, keys=["wte.weight"])


def load_keys_giving_a_number(types):
  _load_files(types, {"embed": (16, 8)}, keys=lambda name: 3)


def load_a_misspelt_tensor_name(types):
  _load_files(types, {"embed": (16, 8)}, keys={"embed": "wte.weights"})


def load_keys_of_a_misspelt_leaf(types):
  _load_files(types, {"embed": (16, 8)}, keys={"embd": "wte.weight"})


def load_keys_of_a_misspelt_leaf_that_has_a_tensor_of_its_name(types):
  # Without the error, the leaf would load the files' own 'embed', not 'wte.weight'.
  write = _file_of({**_MODEL, "embed": np.zeros((16, 8), np.float32)})
  _load_files(types, {"embed": (16, 8)}, keys={"embd": "wte.weight"}, write=write)


def load_another_shape(types):
  _load_files(types, {"embed": (16, 4)}, keys={"embed": "wte.weight"})


def load_a_linear_weight_untransposed(types):
  _load_files(types, {"kernel": (4, 8)}, keys={"kernel": "h.0.weight"})


def load_stacked_linear_weights_untransposed(types):
  _load_files(types, {"kernel": (2, 4, 8)}, keys={"kernel": ["h.0.weight", "h.1.weight"]})


def load_one_layer_into_a_stack(types):
  _load_files(types, {"kernel": (2, 8, 4)}, keys={"kernel": "h.0.weight"})


def load_a_stack_of_unlike_tensors(types):
  _load_files(types, {"kernel": (2, 8, 4)}, keys={"kernel": ["h.0.weight", "wte.weight"]})


def load_a_stack_naming_a_layer_twice(types):
  _load_files(types, {"kernel": (2, 8, 4)}, keys={"kernel": ["h.0.weight", "h.0.weight"]})


def load_a_transpose_that_is_no_permutation(types):
  key = zerojax.FileKey("h.0.weight", transpose=(0, 0))
  _load_files(types, {"kernel": (8, 4)}, keys={"kernel": key})


def load_integers_into_a_float_leaf(types):
  _load_files(types, {"count": (3,)}, keys={"count": "steps"})


#: A float32 tensor with a value beyond float16's range.
_LARGE = {"w": np.array([1.0, 1e6], np.float32)}


def load_large_values_into_a_float16_leaf(types):
  _load_files(types, {"w": jax.ShapeDtypeStruct((2,), jnp.float16)}, write=_file_of(_LARGE))


def load_large_values_stored_in_float16(types):
  # Stage 1 stores the parameters in float16 (stage 3, the float32 master itself).
  _load_files(types, {"w": (2,)}, write=_file_of(_LARGE), stage=1, precision="fp16")


def load_an_unknown_dtype(types):
  header = {"w": {"dtype": "C64", "shape": [2], "data_offsets": [0, 16]}}
  _load_files(types, {"w": (2,)}, write=lambda directory: _raw_file(directory, header, bytes(16)))


def load_a_missing_path(types):
  _load_files(types, {"w": (4,)}, write=lambda directory: directory / "missing.safetensors")


def load_an_empty_directory(types):
  _load_files(types, {"w": (4,)}, write=lambda directory: directory)


def _index(directory, text):
  (directory / "model.safetensors.index.json").write_text(text)
  return directory / "model.safetensors.index.json"


def load_an_index_without_a_weight_map(types):
  _load_files(types, {"w": (4,)}, write=lambda directory: _index(directory, '{"metadata": {}}'))


def load_an_index_whose_files_are_not_all_there(types):
  def write(directory):
    save_file({"w": np.ones(4, np.float32)}, str(directory / "model-00001-of-00002.safetensors"))
    files = {"w": "model-00001-of-00002.safetensors", "v": "model-00002-of-00002.safetensors"}
    return _index(directory, json.dumps({"weight_map": files}))

  _load_files(types, {"w": (4,)}, write=write)


def load_a_pytorch_file(types):
  def write(directory):
    (directory / "pytorch_model.bin").write_bytes(b"PK\x03\x04" + bytes(60))  # a zip archive
    return directory / "pytorch_model.bin"

  _load_files(types, {"w": (4,)}, write=write)


def load_a_header_that_is_not_json(types):
  def write(directory):
    (directory / "model.safetensors").write_bytes((8).to_bytes(8, "little") + b"not json")
    return directory / "model.safetensors"

  _load_files(types, {"w": (4,)}, write=write)


def load_a_damaged_file(types):
  header = {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}
  _load_files(types, {"w": (4,)}, write=lambda directory: _raw_file(directory, header, bytes(12)))


def load_a_file_whose_tensors_overlap(types):
  header = {
    "embed": {"dtype": "F32", "shape": [2, 4], "data_offsets": [0, 32]},
    "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},  # inside embed's bytes
  }
  write = lambda directory: _raw_file(directory, header, bytes(32))
  _load_files(types, {"embed": (2, 4)}, write=write)


def load_a_truncated_file(types):
  _load_files(types, {"w": (4,)}, write=_cut(-8))


def load_a_file_truncated_inside_its_header(types):
  _load_files(types, {"w": (4,)}, write=_cut(8 + 10))


def load_the_files_of_two_models(types):
  def write(directory):
    for name in ("a", "b"):
      save_file(_MODEL, str(directory / f"{name}.safetensors"))
    return directory

  _load_files(types, {"embed": (16, 8)}, keys={"embed": "wte.weight"}, write=write)


def devices_not_whole(types):
  zerojax.estimate_memory(7.5e9, num_devices=8.5, stage=3)


def devices_per_node_not_dividing(types):
  zerojax.estimate_communication(1e9, num_devices=16, stage=3, devices_per_node=6)


def loss_not_a_scalar(types):
  tx = zerojax.zero3(optax.sgd(0.1), mesh=_mesh(types))
  loss = lambda params, x: x @ zerojax.gather(params)["w"]  # per example, not reduced
  jax.jit(zerojax.value_and_grad(loss, tx))(_w(tx), jnp.ones((8, 4)))


def forward_returns_a_scalar(types):
  tx = zerojax.zero3(optax.sgd(0.1), mesh=_mesh(types))
  loss = lambda params, x: jnp.mean(x @ zerojax.gather(params)["w"])  # the mean, not per example
  jax.jit(zerojax.forward(loss, tx))(_w(tx), jnp.ones((8, 4)))


def forward_without_a_batch(types):
  tx = zerojax.zero3(optax.sgd(0.1), mesh=_mesh(types))
  jax.jit(zerojax.forward(lambda params: zerojax.gather(params)["w"], tx))(_w(tx))


def forward_returns_a_gathered_parameter(types):
  tx = zerojax.zero3(optax.sgd(0.1), mesh=_mesh(types))
  w = lambda params: zerojax.gather(params)["w"]
  jax.jit(zerojax.forward(lambda params, x: (x @ w(params), w(params)), tx))(
    _w(tx), jnp.ones((16, 4))
  )


def forward_builds_a_kv_cache(types):
  tx = zerojax.zero3(optax.sgd(0.1), mesh=_mesh(types))

  def decode(params, x):  # the cache made inside, then filled from the batch in a loop
    fill = lambda i, cache: cache.at[:, i].set(x @ zerojax.gather(params)["w"])
    return jax.lax.fori_loop(0, 2, fill, jnp.zeros((x.shape[0], 2, 1024)))

  jax.jit(zerojax.forward(decode, tx))(_w(tx), jnp.ones((16, 4)))


def pipeline_key_for_a_stage_fn_without_one(types):
  mesh = _stage_mesh(types)
  _pipelined(mesh, _staged(mesh), jnp.ones((8, 16)), microbatches=2, key=jax.random.key(0))


def _stage_mesh(types):
  return jax.make_mesh((2, 4), ("stage", "data"), (types, types))


def _staged(mesh, shape=(2, 2, 16, 16)):
  return jax.device_put(jnp.ones(shape), jax.NamedSharding(mesh, jax.P("stage")))


def _stage(w, h):
  return zerojax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, w)[0]


def _pipelined(mesh, w, x, stage_fn=_stage, **options):
  with jax.set_mesh(mesh):
    return jax.jit(lambda w, x: zerojax.pipeline(stage_fn, w, x, **options))(w, x)


def indivisible_pipeline_micro_batches(types):
  mesh = _stage_mesh(types)
  _pipelined(mesh, _staged(mesh), jnp.ones((6, 16)), microbatches=4)


def schedule_typo(types):
  mesh = _stage_mesh(types)
  _pipelined(mesh, _staged(mesh), jnp.ones((8, 16)), microbatches=2, schedule="1fb1")


def one_f_one_b_without_the_loss(types):
  mesh = _stage_mesh(types)
  _pipelined(mesh, _staged(mesh), jnp.ones((8, 16)), microbatches=2, schedule="1f1b")


def _interleaved(types, w_shape=(2, 2, 16, 16), rows=8, **options):
  """The interleaved schedule on ``stage=2 x data=4``, the loss inside the pipeline."""
  mesh = _stage_mesh(types)
  options = {"schedule": "interleaved", "microbatches": 2, "virtual_stages": 2, **options}
  mean = lambda _, h: jnp.mean(h)
  _pipelined(mesh, _staged(mesh, w_shape), jnp.ones((rows, 16)), loss_fn=mean, **options)


def interleaved_without_virtual_stages(types):
  _interleaved(types, virtual_stages=None)


def interleaved_micro_batches_not_in_groups_of_the_stages(types):
  _interleaved(types, rows=9, microbatches=3)


def virtual_stages_without_the_interleaved_schedule(types):
  _interleaved(types, schedule="1f1b")


def interleaved_chunks_that_do_not_divide_a_stage_s_layers(types):
  _interleaved(types, w_shape=(2, 3, 16, 16))


def pipeline_on_a_mesh_without_stages(types):
  mesh = _mesh(types)
  w = jax.device_put(jnp.ones((2, 16, 16)), jax.NamedSharding(mesh, jax.P()))
  _pipelined(mesh, w, jnp.ones((8, 16)), microbatches=2)


def zero_over_the_stage_axis(types):
  zerojax.zero3(optax.sgd(0.1), mesh=_stage_mesh(types), axis_name="stage")


def stage_params_not_one_per_stage(types):
  _pipelined(_stage_mesh(types), jnp.ones((3, 16, 16)), jnp.ones((8, 16)), microbatches=2)


def stage_changes_the_activations_shape(types):
  mesh = _stage_mesh(types)
  narrow = lambda w, h: _stage(w, h)[:, :8]
  _pipelined(mesh, _staged(mesh), jnp.ones((8, 16)), narrow, microbatches=2)


def pipeline_loss_fn_that_sums(types):
  mesh = _stage_mesh(types)
  head = lambda _, h: jnp.sum(h**2)  # per micro-batch, summed
  _pipelined(mesh, _staged(mesh), jnp.ones((8, 16)), microbatches=2, loss_fn=head)


def pipeline_stage_fn_reading_a_key_from_an_object(types):
  # A key in a variable of the loss reaches the stages; one in an object's attribute cannot.
  # Explicit axes whatever ``types``: on Auto axes JAX lets a shard_map close over it.
  mesh = _stage_mesh(AxisType.Explicit)

  def dropout(key):
    holder = types_lib.SimpleNamespace(key=key)
    return lambda w, h: _stage(w, h) * jax.random.bernoulli(holder.key, 0.5, h.shape)

  with jax.set_mesh(mesh):
    w, x = _staged(mesh), jnp.ones((8, 16))
    jax.jit(lambda w, x, key: zerojax.pipeline(dropout(key), w, x, microbatches=2))(
      w, x, jax.random.key(0)
    )


def stage_returns_a_scan_body_s_pair(types):
  mesh = _stage_mesh(types)
  pair = lambda w, h: (_stage(w, h), None)
  _pipelined(mesh, _staged(mesh), jnp.ones((8, 16)), pair, microbatches=2)


def value_and_grad_under_a_shard_map_over_every_axis(types):
  mesh = _stage_mesh(types)
  tx = zerojax.zero3(optax.sgd(0.1), mesh=mesh)
  params = tx.shard({"w": _staged(mesh, (2, 4, 1024))})
  inner = lambda p, x: zerojax.value_and_grad(_loss, tx)(p, x)[0]
  with jax.set_mesh(mesh):
    specs = ({"w": jax.P("stage", None, "data")}, jax.P())
    jax.shard_map(inner, in_specs=specs, out_specs=jax.P())(params, jnp.ones((8, 4)))


def stage_layers_split_over_data(types):
  mesh = _stage_mesh(types)
  tx = zerojax.zero3(optax.sgd(0.1), mesh=mesh)
  params = tx.shard({"w": jnp.ones((2, 4, 16, 16))})  # not placed on the stage axis first
  loss = lambda p, x: jnp.sum(zerojax.pipeline(_stage, p["w"], x, microbatches=2))
  with jax.set_mesh(mesh):
    zerojax.value_and_grad(loss, tx)(params, jnp.ones((8, 16)))


def flax_layers_that_stages_cannot_share(types):
  class Block(flax.linen.Module):
    @flax.linen.compact
    def __call__(self, h, _):
      return flax.linen.Dense(16)(h), None

  layers = zerojax.flax.linen.pipeline(Block, length=3, microbatches=2)()
  params = layers.init(jax.random.key(0), jnp.ones((8, 16)))
  with jax.set_mesh(_stage_mesh(types)):
    layers.apply(params, jnp.ones((8, 16)))


def _scanned(types, layer, prefetch=1, policy=None, carry=jnp.float32, **options):
  """A stage-3 step whose loss runs ``layer`` with ``zerojax.scan`` over a stack of 4 layers."""
  mesh = _mesh(types)
  tx = zerojax.zero3(optax.sgd(0.1), mesh=mesh, min_shard_size=1, **options)
  params = tx.shard({"w": jnp.linspace(-1, 1, 256).reshape(4, 8, 8)})
  scan = lambda x, w: zerojax.scan(layer, x.astype(carry), w, prefetch=prefetch, policy=policy)
  loss = lambda p, x: jnp.mean(scan(x, p["w"])[0])
  grad_fn = zerojax.value_and_grad(loss, tx)
  return jax.jit(grad_fn)(params, jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P("data"))))


def scan_body_returning_one_value(types):
  _scanned(types, lambda h, w: jnp.tanh(h @ w))


def scan_body_promoting_its_carry(types):
  # bfloat16 activations, and a NumPy scalar (float64, taken as float32) that promotes them.
  _scanned(types, lambda h, w: (h @ w / np.sqrt(8), None), carry=jnp.bfloat16, precision="bf16")


def policy_on_a_layer_under_its_own_checkpoint(types):
  _scanned(types, jax.checkpoint(lambda h, w: (jnp.tanh(h @ w), None)), policy="dots_saveable")


def scan_over_a_split_layer_axis(types):
  _scanned(types, lambda h, w: (jnp.tanh(h @ w), None), layout={"w": P("data")})


def misspelt_policy_name(types):
  _scanned(types, lambda h, w: (jnp.tanh(h @ w), None), policy="dots_saveble")


def deferred_reductions_without_prefetch(types):
  zerojax.scan(
    lambda h, w: (h, None), jnp.ones(2), jnp.ones((3, 2)), prefetch=0, defer_reductions=True
  )


def evaluating_on_stored_params(types):
  tx = zerojax.zero3(optax.sgd(0.1), mesh=_mesh(types))
  loss_fn = lambda params, x: jnp.mean(x @ zerojax.gather(params)["w"])
  jax.jit(loss_fn)(tx.shard({"w": jnp.eye(64)[:8]}), jnp.ones((8, 8)))


def _hpz(types, shape, secondary_axis):
  mesh = jax.make_mesh(shape, ("node", "data"), (types, types))
  zerojax.zero3(
    optax.sgd(0.1), mesh=mesh, axis_name=("node", "data"), secondary_axis=secondary_axis
  )


def hpz_over_one_device(types):
  _hpz(types, (8, 1), "data")


def hpz_across_nodes(types):
  _hpz(types, (2, 4), "node")


def packed_gathers_not_a_bool(types):
  zerojax.zero3(optax.sgd(0.1), mesh=_mesh(types), packed_gathers="yes")


# The first column of docs/guide.md's errors table, and the misuse that raises each.
CASES = {
  "mesh has no axis 'dta' (its axes are ('data',)); did you mean axis_name='data'?": axis_name_typo,
  "no mesh: pass mesh=": no_mesh,
  "zero2 wraps an optax.GradientTransformation": not_an_optimizer,
  "zero3 was given a zerojax transformation (zero3) to wrap": nested_transformations,
  "batch argument 0 has shape (10, 4): its leading dimension must divide by the 8 devices": (
    indivisible_batch
  ),
  "... times 4 micro-batches": indivisible_micro_batches,
  "batch argument 1['y'] has 8 rows but batch argument 0 has 16": mismatched_batch,
  "batch argument 1 has 8 rows but batch argument 0 has 64 ... one key per example, "
  "jax.random.split(key, 64)": keys_one_per_device,
  "params['w'] has shape (7, 13) but stage 3 stores it as (7, 16)": unplaced_padded_params,
  "params['w'] lives on a mesh of {'data': 4}, not on this transformation's mesh": (
    params_of_another_mesh_in_jit
  ),
  "params['w'] lives on a mesh of {'data': 8}, not on this transformation's mesh of {'data': 4}: "
  "use the transformation that stored them, or move them to this mesh: "
  "tx.shard(that_tx.gather(params))": gather_of_another_mesh,
  "params['step'] is int32, and a gradient is taken only of floating-point parameters": (
    integer_leaf
  ),
  "value_and_grad(..., has_aux=True) expects loss_fn to return (loss, aux)": scalar_loss_with_aux,
  "value_and_grad needs the zerojax transformation": chain_given_to_value_and_grad,
  "TypeError: tx.gather was given zerojax.Shards ... open them with zerojax.gather(params)": (
    tx_gather_inside_the_loss
  ),
  "leaf at ['name'] is str, not an array": non_array_leaf,
  "TypeError: tx.sharded_init takes the function that makes the parameters ... got dict ... "
  "use tx.shard(params)": sharded_init_of_built_params,
  "optimizer state leaf ... expected": state_of_another_model,
  "state is a tuple, not a ZeroState": not_a_zero_state,
  "init makes the float32 master copy ... call tx.init(params) on the full-precision": (
    init_after_shard_under_bf16
  ),
  "tx's precision policy scales the loss ... opt_state=opt_state": loss_scale_without_state,
  "keeps master parameters apart from the (lower-precision) parameters": (
    update_without_params_under_bf16
  ),
  "the optimizer state was made for another precision policy": state_of_another_policy,
  "this ZeroTransformation's init is not zerojax's any more": replaced_init,
  "opt_state.inner_state[0].count is in host memory, but this transformation (offload=None)": (
    offloaded_state_without_offload
  ),
  "TypeError: use_cpu_devices takes a whole number of devices, got '8' (a str)": (
    cpu_devices_as_text
  ),
  "TypeError: ... takes the batch as positional arguments, f(params, *batch) ... 'x'": (
    batch_by_keyword
  ),
  "UserWarning: ... loss_fn's loss looks like a sum over its batch, not a mean": summed_loss,
  "TypeError: value_and_grad needs loss_fn to return a scalar loss ... shape (1, 1024)": (
    loss_not_a_scalar
  ),
  "zerojax.forward's fn returned a scalar at its output": forward_returns_a_scalar,
  "zerojax.forward's function was called with no batch arguments": forward_without_a_batch,
  "zerojax.forward's fn returned [1] of shape (4, 1024) on each device, where the batch has 2 "
  "rows ... gather parameters outside forward with tx.gather(params)": (
    forward_returns_a_gathered_parameter
  ),
  "zerojax.forward's fn carries a value it made itself through a loop ... pass a KV cache as a "
  "batch argument": forward_builds_a_kv_cache,
  "zerojax.pipeline was given key=, so it calls stage_fn(params, h, key), but stage_fn takes "
  "(w, h)": pipeline_key_for_a_stage_fn_without_one,
  "min_shard_size must be an int, 0 or more (the fewest elements a leaf needs to be split), "
  "got '1024'": min_shard_size_as_text,
  "TypeError: CheckpointManager's spec is a zerojax.StateSpec, got ZeroTransformation": (
    transformation_as_checkpoint_spec
  ),
  "does not fit this manager's spec (its containers differ ... opt_state.inner_state: a list "
  "of 2 in the checkpoint, a list of 3 in the spec": checkpoint_of_another_optimizer,
  "TypeError: a checkpoint's step is a whole number, 0 or more, got 1.5 (float)": (
    checkpoint_step_not_whole
  ),
  "FileNotFoundError: no checkpoints in ... it is itself a checkpoint, step 1 of ...; pass": (
    load_params_of_one_step_s_directory
  ),
  "TypeError: keys is a mapping or a function of a leaf's name, got list": load_keys_as_a_list,
  "TypeError: keys gave 3 for leaf 'embed': give a tensor's name, a non-empty sequence of names": (
    load_keys_giving_a_number
  ),
  "1 of 1 leaves do not fit the tensors in ... embed: tensor 'wte.weights' (from keys) is not in "
  "the files; the closest there: ['wte.weight', ...": load_a_misspelt_tensor_name,
  "embed: tensor 'embed' is not in the files ... keys maps 'embd', which names no leaf (did you "
  "mean 'embed'?)": load_keys_of_a_misspelt_leaf,
  "keys maps 'embd', which names no leaf (did you mean 'embed'?)": (
    load_keys_of_a_misspelt_leaf_that_has_a_tensor_of_its_name
  ),
  "embed: tensor 'wte.weight' gives shape (16, 8), the leaf has (16, 4)": load_another_shape,
  "kernel: tensor 'h.0.weight' gives shape (8, 4), the leaf has (4, 8); transposed it fits: "
  "zerojax.FileKey('h.0.weight', transpose=(1, 0))": load_a_linear_weight_untransposed,
  "kernel: tensor 'h.0.weight' gives shape (2, 8, 4), the leaf has (2, 4, 8); each layer "
  "transposed it fits: zerojax.FileKey(names, transpose=(1, 0)), with the 2 names": (
    load_stacked_linear_weights_untransposed
  ),
  "kernel: tensor 'h.0.weight' gives shape (8, 4), the leaf has (2, 8, 4); it fits one layer: "
  "give 2 names to stack, one per layer": load_one_layer_into_a_stack,
  "kernel: the tensors stacked into it differ: 'h.0.weight' is F32 (8, 4), 'wte.weight' F32 "
  "(16, 8)": load_a_stack_of_unlike_tensors,
  "kernel: tensor 'h.0.weight' is stacked into it as layers 0 and 1: name each layer's own "
  "tensor": load_a_stack_naming_a_layer_twice,
  "kernel: transpose=(0, 0) is not a permutation of the axes of 'h.0.weight', (0, 1)": (
    load_a_transpose_that_is_no_permutation
  ),
  "count: tensor 'steps' is int32 and the leaf float32; an integer tensor is not read into a "
  "floating leaf": load_integers_into_a_float_leaf,
  "w: tensor 'w', float32, holds 1000000.0 ... beyond the range of float16 (-65504.0 to "
  "65504.0), the leaf's dtype in": load_large_values_into_a_float16_leaf,
  "w: tensor 'w', float32, holds 1000000.0 ... float16 ..., the dtype the precision policy "
  "stores the leaf in": load_large_values_stored_in_float16,
  "tensor 'w' in ... is C64, which zerojax cannot read": load_an_unknown_dtype,
  "missing.safetensors does not exist: pass a .safetensors file, an index or a directory": (
    load_a_missing_path
  ),
  "holds no .safetensors files (nor a model.safetensors.index.json)": load_an_empty_directory,
  "is not a safetensors index: it has no JSON object with a 'weight_map'": (
    load_an_index_without_a_weight_map
  ),
  "names 2 files, and model-00002-of-00002.safetensors of them is not beside it": (
    load_an_index_whose_files_are_not_all_there
  ),
  "pytorch_model.bin is not a safetensors file (its first 8 bytes give no header)": (
    load_a_pytorch_file
  ),
  "is not a safetensors file (its header is not a JSON object giving each tensor's dtype, shape "
  "and data_offsets)": load_a_header_that_is_not_json,
  "tensor 'w' in ... has 12 bytes for shape (4,) of F32: the file is damaged": load_a_damaged_file,
  "tensor 'b' in ... starts at byte 8 of the data, inside tensor 'embed' (bytes 0 to 32): the "
  "file is damaged": load_a_file_whose_tensors_overlap,
  "ends before the data of tensor 'w': the file is truncated (an interrupted download or copy?)": (
    load_a_truncated_file
  ),
  "model.safetensors ends inside its header: the file is truncated": (
    load_a_file_truncated_inside_its_header
  ),
  "tensor 'h.0.weight' is in both ... and ...: pass the files of one model (or its index.json)": (
    load_the_files_of_two_models
  ),
  "num_devices must be a whole number, at least 1, got 8.5": devices_not_whole,
  "devices_per_node=6 must divide num_devices=16": devices_per_node_not_dividing,
  "TypeError: the collectives are read from a compiled program, got a lowered program: pass "
  "jax.jit(step).lower(*args).compile()": collectives_of_a_lowered_step,
  "zerojax.pipeline splits x of shape (6, 16) into 4 micro-batches": (
    indivisible_pipeline_micro_batches
  ),
  "schedule must be one of ('gpipe', '1f1b', 'interleaved'), got '1fb1'; did you mean '1f1b'?": (
    schedule_typo
  ),
  "the loss must be computed inside the pipeline: pass loss_fn=": one_f_one_b_without_the_loss,
  "schedule='interleaved' splits each stage's layers into chunks (virtual stages): pass "
  "virtual_stages=v": interleaved_without_virtual_stages,
  "schedule='interleaved' runs micro-batches in groups of the 2 stages": (
    interleaved_micro_batches_not_in_groups_of_the_stages
  ),
  "virtual_stages=2 is the interleaved schedule's": virtual_stages_without_the_interleaved_schedule,
  "the interleaved schedule splits each stage's layers (the second axis) into "
  "virtual_stages=2 chunks": interleaved_chunks_that_do_not_divide_a_stage_s_layers,
  "mesh has no axis 'stage' (its axes are ('data',)) to run the pipeline stages over": (
    pipeline_on_a_mesh_without_stages
  ),
  "axis_name='stage' names 'stage', the mesh axis zerojax.pipeline runs its stages over ... "
  "pass axis_name='data'": zero_over_the_stage_axis,
  "stage_params has shape (3, 16, 16), but the mesh's 'stage' axis has 2 stages": (
    stage_params_not_one_per_stage
  ),
  "stage_fn returned float32[4, 8] for a micro-batch of float32[4, 16]": (
    stage_changes_the_activations_shape
  ),
  "UserWarning: zerojax.pipeline: loss_fn's loss looks like a sum over its micro-batch": (
    pipeline_loss_fn_that_sums
  ),
  "zerojax.pipeline: stage_fn or loss_fn closes over an array from outside the pipeline": (
    pipeline_stage_fn_reading_a_key_from_an_object
  ),
  "stage_fn returned (float32[4, 16], None) for a micro-batch of float32[4, 16] ... Return the "
  "activations alone": stage_returns_a_scan_body_s_pair,
  "zerojax.value_and_grad was called where the mesh axes ['data'] are already manual": (
    value_and_grad_under_a_shard_map_over_every_axis
  ),
  "stage_params is split over the data axes along dimension 1, its per-stage layer axis": (
    stage_layers_split_over_data
  ),
  "layers['Dense_0']['bias'] stacks 3 layers, which the 2 stages of the 'stage' axis": (
    flax_layers_that_stages_cannot_share
  ),
  "zerojax.scan's f must return a pair (carry, y), as jax.lax.scan's does": (
    scan_body_returning_one_value
  ),
  "zerojax.scan's f returned the carry as float32[1, 8], but was given it as bfloat16[1, 8]": (
    scan_body_promoting_its_carry
  ),
  "this layer runs under its own jax.checkpoint (jax.remat, nn.remat, nnx.remat)": (
    policy_on_a_layer_under_its_own_checkpoint
  ),
  "... whose leading (layer) axis is split over the data axes 'data'": (
    scan_over_a_split_layer_axis
  ),
  "policy='dots_saveble' names no policy of jax.checkpoint_policies that takes no arguments; "
  "did you mean 'dots_saveable'?": misspelt_policy_name,
  "defer_reductions=True reduce-scatters each layer's gradient in the next iteration": (
    deferred_reductions_without_prefetch
  ),
  "a stage-3 parameter stored as (8, 64), 1/N of it on each device, was used as a whole "
  "array": evaluating_on_stored_params,
  "UserWarning: secondary_axis='data' has 1 device (the mesh is {'node': 8, 'data': 1})": (
    hpz_over_one_device
  ),
  "UserWarning: secondary_axis='node' looks like an axis across nodes (its name says so)": (
    hpz_across_nodes
  ),
  "packed_gathers must be True, False or None (on GPUs, packed where axis_name crosses nodes), got "
  "'yes'": packed_gathers_not_a_bool,
}

# Misuses the table covers with another row's message.
MORE = {
  "opt_state... lives on a mesh of {'data': 4}": state_of_another_mesh_in_jit,
  "min_shard_size must be an int, 0 or more ... got -1;": negative_min_shard_size,
  "params['w'] lives on a mesh of {'data': 8} ... use the transformation that stored them": (
    forward_of_another_mesh
  ),
  "leaf at ['scale'] is float, not an array": sharded_init_of_a_float_leaf,
}


def shard_twice(types):
  tx = zerojax.zero3(optax.sgd(0.1), mesh=_mesh(types), min_shard_size=1)
  once = tx.shard({"w": jnp.arange(91.0).reshape(7, 13)})  # stored padded to (7, 16)
  return [once], [tx.shard(once)]


def unplaced_gradients(types):
  done_right, unplaced = [], []
  for stage in (2, 3):
    tx = getattr(zerojax, f"zero{stage}")(optax.adam(0.1), mesh=_mesh(types), min_shard_size=1)
    # Padded to (7, 16) and (30, 104): a logical (30, 100) split 8 ways is uneven.
    params = tx.shard({"w": jnp.arange(91.0).reshape(7, 13), "v": jnp.ones((30, 100)) / 9})

    def loss(params, x):
      params = zerojax.gather(params)
      return jnp.mean(jnp.sin(x @ params["w"])) + jnp.mean(jnp.sin(x[:, :1] @ params["v"][:1]))

    _, grads = jax.jit(zerojax.value_and_grad(loss, tx))(params, jnp.ones((8, 7)))
    state = tx.init(params)
    padded = jax.tree.map(np.asarray, arrays(grads))
    logical = {"w": padded["w"][:, :13], "v": padded["v"][:, :100]}
    for host in (padded, logical):
      done_right.append(tx.update(grads, state, params))
      unplaced.append(tx.update(host, state, params))
      done_right.append(tx.update(grads, state, params))
      unplaced.append(tx.update(jax.device_put(host, jax.devices()[1]), state, params))
    done_right.append(tx.update(grads, state, params))
    unplaced.append(jax.jit(tx.update)(logical, state, params))
  return done_right, unplaced


def stored_params_given_to_another_transformation(types):
  params = {"w": jnp.arange(91.0).reshape(7, 13), "b": jnp.ones(13)}  # "w" stored as (7, 16)
  make = lambda: zerojax.zero3(optax.adam(0.1), mesh=_mesh(types), min_shard_size=1)
  stored = zerojax.zero3(optax.sgd(0.1), mesh=_mesh(types), min_shard_size=1).shard(params)
  # Another layout: "w" (91 elements) stays whole under the default min_shard_size.
  other = zerojax.zero3(optax.sgd(0.1), mesh=_mesh(types)).shard(params)
  done_right, mistaken, from_other = make(), make(), make()
  right = done_right.shard(params)
  return [right, done_right.init(right), done_right.gather(right)] * 2, [
    mistaken.shard(stored),
    mistaken.init(stored),
    mistaken.gather(stored),
    from_other.shard(other),
    from_other.init(other),
    from_other.gather(other),
  ]


def policy_by_name(types):
  layer = lambda h, w: (jnp.tanh(h @ w), None)
  dots = jax.checkpoint_policies.dots_saveable
  return [_scanned(types, layer, policy=dots)], [_scanned(types, layer, policy="dots_saveable")]


def pipelined_step_outside_jit(types):
  mesh = _stage_mesh(types)
  tx = zerojax.zero3(optax.sgd(0.1), mesh=mesh)
  params = tx.shard({"w": _staged(mesh, (2, 2, 16, 16)) / 16})
  loss = lambda p, x: jnp.mean(zerojax.pipeline(_stage, p["w"], x, microbatches=2))
  step = zerojax.value_and_grad(loss, tx)
  x = jnp.linspace(0, 1, 128).reshape(8, 16)
  with jax.set_mesh(mesh):
    return [jax.jit(step)(params, x)], [step(params, x)]


# The first column of the guide's table of mistakes that give the right answer, and for each a
# function that returns what doing it right gives and what the mistake gives.
RIGHT_ANSWERS = {
  "tx.shard(tx.shard(params))": shard_twice,
  "tx.update(grads, opt_state, params)": unplaced_gradients,
  "tx2.init(tx1.shard(params))": stored_params_given_to_another_transformation,
  'zerojax.scan(layer, h, xs, policy="dots_saveable")': policy_by_name,
  "zerojax.value_and_grad(loss_fn, tx)(params, x)": pipelined_step_outside_jit,
}


def _pattern(fragment: str) -> str:
  """The regular expression of a table fragment: literal text, ``...`` for anything (lines too)."""
  return "(?s)" + ".*".join(re.escape(part.strip()) for part in fragment.split("..."))


#: What a row may name first; a row that names none is a ``ValueError``.
KINDS = (TypeError, FileNotFoundError, UserWarning)


def _kind(fragment: str) -> tuple[type[Exception], str]:
  """The error (or warning) a table fragment names, and the message it contains."""
  for kind in KINDS:
    if fragment.startswith(f"{kind.__name__}: "):
      return kind, fragment.removeprefix(f"{kind.__name__}: ")
  return ValueError, fragment


@pytest.mark.parametrize("types", MESH_TYPES.values(), ids=MESH_TYPES)
@pytest.mark.parametrize("fragment", {**CASES, **MORE})
def test_misuse_raises_an_error_that_says_what_to_do(fragment, types):
  kind, message = _kind(fragment)
  with warnings.catch_warnings():
    warnings.simplefilter("error", UserWarning)  # a warning is raised, so it can be matched
    with pytest.raises(kind, match=_pattern(message)) as raised:
      {**CASES, **MORE}[fragment](types)
  assert type(raised.value) is kind  # not a subclass (a JAX error is a ValueError too)


def _guide_tables() -> tuple[list[str], list[str]]:
  """The first columns of the guide's table of errors and of its table of right answers."""
  text = GUIDE.read_text()
  section = text[text.index("## Errors you may meet") :].split("\n## ")[0]
  errors, right = section.split("| what you do |")
  column = lambda table: re.findall(r"^\| `(.+?)`", table, flags=re.MULTILINE)
  return column(errors), column(right)


def test_the_guide_lists_exactly_the_tested_errors():
  assert _guide_tables() == (list(CASES), list(RIGHT_ANSWERS))


@pytest.mark.parametrize("types", MESH_TYPES.values(), ids=MESH_TYPES)
@pytest.mark.parametrize("what", RIGHT_ANSWERS)
def test_these_mistakes_give_the_right_answer(what, types):
  done_right, mistaken = RIGHT_ANSWERS[what](types)
  for expected, got in zip(jax.tree.leaves(done_right), jax.tree.leaves(mistaken), strict=True):
    assert got.sharding.is_equivalent_to(expected.sharding, got.ndim)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("types", MESH_TYPES.values(), ids=MESH_TYPES)
def test_evaluation_runs_on_gathered_parameters_not_on_the_stored_shards(types):
  # The guide: the model code of value_and_grad runs in evaluation on tx.gather(params); the
  # stored stage-3 parameters refuse to be used as arrays, on either axis type, saying so.
  tx = zerojax.zero3(optax.sgd(0.1), mesh=_mesh(types))
  params = tx.shard({"w": jnp.eye(64), "layers": jnp.ones((2, 64, 64)) / 64})
  layer = lambda h, w: (jnp.tanh(h @ w), None)

  def loss_fn(params, x):  # README's quickstart model
    h = x @ zerojax.gather(params["w"])
    return jnp.mean(zerojax.scan(layer, h, params["layers"])[0])

  x = jnp.ones((8, 64))
  expected, _ = jax.jit(zerojax.value_and_grad(loss_fn, tx))(params, x)
  assert jax.jit(loss_fn)(tx.gather(params), x) == pytest.approx(float(expected), rel=1e-5)
  with pytest.raises(ValueError, match=r"was used as a whole array.*tx\.gather\(params\)"):
    jax.jit(loss_fn)(params, x)
  with pytest.raises(ValueError, match=r"in a drop-in jax\.grad step, call the model on tx\.unpad"):
    jax.jit(lambda p, x: x @ p["w"])(params, x)


def _drop_in(types, unpad):
  """A drop-in stage-3 step (``jax.value_and_grad``) on a (16, 15) leaf, stored as (16, 16)."""
  mesh = _mesh(types)
  tx = zerojax.zero3(optax.sgd(0.1), mesh=mesh, min_shard_size=1)
  params = tx.shard({"w": jnp.ones((16, 15)), "v": jnp.ones((16, 16))})
  x = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P("data")))
  loss = lambda p, x: jnp.mean(x @ p["v"] @ p["w"] @ jnp.ones((15, 1)))
  return jax.jit(lambda p, x: jax.value_and_grad(loss)(unpad(tx, p), x))(params, x)


def _apply_plain_updates(updates_of):
  """``optax.apply_updates`` of stage-3 stored parameters, a (7, 13) leaf stored as (7, 16), and
  ``updates_of(tx, params, grads)``, the gradients in their logical shape (as ``jax.grad`` of the
  gathered parameters gives them); checks the SGD step it makes."""
  tx = zerojax.zero3(optax.sgd(0.5), mesh=_mesh(AxisType.Auto), min_shard_size=1)
  params = tx.shard({"w": jnp.ones((7, 13))})
  new = optax.apply_updates(params, updates_of(tx, params, {"w": np.ones((7, 13), np.float32)}))
  np.testing.assert_array_equal(tx.gather(new)["w"], np.full((7, 13), 0.5, np.float32))


def _plain_sgd(grads):
  sgd = optax.sgd(0.5)
  return sgd.update(grads, sgd.init(grads))[0]


# What the guide's list of mistakes that raise JAX's errors quotes, and for each the mistake and
# the fix the guide gives. The drop-in path on explicit axes, where the model's matmul of two
# sharded operands is JAX's to refuse (without tx.unpad it is zerojax's error, a row above); and
# updates computed without zerojax (a plain optax optimizer) added to stage 3's stored
# parameters, in optax.apply_updates, where zerojax runs no code.
DROP_IN = {
  "ShardingTypeError: dot_general operation with inputs: f32[8@data,16], f32[16,16@data] "
  "produces an illegally sharded result": (
    lambda: _drop_in(AxisType.Explicit, lambda tx, p: tx.unpad(p)),
    lambda: _drop_in(AxisType.Auto, lambda tx, p: tx.unpad(p)),
  ),
  "ValueError: pytree structure error: different types at key path ... tree['w'] ... "
  "zerojax._src.sharding.stored.Stored": (
    lambda: _apply_plain_updates(lambda tx, params, grads: _plain_sgd(grads)),
    lambda: (
      _apply_plain_updates(lambda tx, params, grads: tx.shard(_plain_sgd(grads))),
      _apply_plain_updates(lambda tx, params, grads: tx.update(grads, tx.init(params))[0]),
    ),
  ),
}


@pytest.mark.parametrize("message", DROP_IN)
def test_mistakes_jax_refuses_raise_what_the_guide_quotes_and_its_fix_works(message):
  mistake, fix = DROP_IN[message]
  section = " ".join(GUIDE.read_text().split("## Errors you may meet")[1].split())
  assert message in section
  kind, text = message.split(": ", 1)
  with pytest.raises(Exception, match=_pattern(text)) as raised:
    mistake()
  assert type(raised.value).__name__ == kind
  fix()


def test_counting_parameters_counts_the_model_s_not_the_padding():
  # Stage 3 stores "embed" (97, 36) as (97, 40): its leaves' sizes count the padding.
  tx = zerojax.zero3(optax.sgd(0.1), mesh=_mesh(AxisType.Auto), min_shard_size=1)
  model = {"embed": jnp.ones((97, 36)), "b": jnp.ones(36)}
  params = tx.shard(model)
  assert sum(x.size for x in jax.tree.leaves(params)) == 97 * 40 + 40
  assert tx.num_params(params) == tx.num_params(model) == 97 * 36 + 36


def test_a_shard_used_without_gather_raises_a_type_error():
  tx = zerojax.zero3(optax.sgd(0.1), mesh=_mesh(AxisType.Explicit))
  with pytest.raises(TypeError, match=r"call zerojax\.gather"):
    zerojax.value_and_grad(lambda p, x: jnp.sum(x @ p["w"]), tx)(_w(tx), jnp.ones((8, 4)))


def test_a_chain_runs_eagerly_under_set_mesh_and_in_jit():
  # On explicit axes JAX computes eagerly on sharded arrays only inside
  # jax.set_mesh (the chain's clipping runs before zerojax sees anything):
  # the guide says so; under jit or set_mesh the chain works.
  mesh = _mesh(AxisType.Explicit)
  zero = zerojax.zero3(optax.adam(1e-3), mesh=mesh)
  tx = optax.chain(optax.clip_by_global_norm(1.0), zero)
  params = zero.shard({"w": jnp.ones((8, 1024))})
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  with jax.set_mesh(mesh):
    eager, _ = tx.update(grads, state, params)
  jitted, _ = jax.jit(tx.update)(grads, state, params)
  assert eager["w"].sharding.spec == jitted["w"].sharding.spec == jax.P(None, "data")


def test_the_summed_loss_check_traces_silently(capsys):
  # The check traces the loss once more, at twice its batch; what the loss prints shows once.
  tx = zerojax.zero3(optax.sgd(0.1), mesh=_mesh(AxisType.Explicit))

  def loss(params, x):
    print("tracing the loss")
    return jnp.mean(x @ zerojax.gather(params)["w"])

  zerojax.value_and_grad(loss, tx)(_w(tx), jnp.ones((16, 4)))
  assert capsys.readouterr().out == "tracing the loss\n"
