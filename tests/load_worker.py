"""One process of the 2-process loading job of ``tests/test_load_multiprocess.py``.

``python -m zerojax_launch -n 2 --devices-per-process 4 tests/load_worker.py DIR``: loads
``DIR/model.safetensors`` (see ``write_model``) into stage 3 on the 8 devices of both
processes, measuring this process's peak resident memory (``ru_maxrss``) above what it held
before and the bytes it read (``rchar`` of ``/proc/self/io``); checks each of its shards
against the file; then loads the stacked layers onto a (stage, data) mesh whose stages are the
processes, recording which file tensors it read. Writes ``DIR/p<process>.json``.

``... tests/load_worker.py DIR --floor AXIS_TYPE``: loads ``DIR/huggingface.safetensors``
(``write_huggingface_model``, written by HuggingFace's own ``safetensors``) with ``keys`` that
stack and transpose its layers, cast a bfloat16 tensor and pad, onto a mesh of that axis type;
measures the growth of this process's peak resident memory over its baseline after imports,
JAX's start and the processes' first collective; writes ``DIR/floor.p<process>.json``.
"""

import json
import resource
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

import zerojax
from tests.helpers import AXIS_TYPES
from zerojax._src.checkpoint import tensor_files

LAYERS = 4


def write_model(path: Path) -> None:
  """128 MiB in sixteen 8 MiB leaves: one split over columns (each process's half of a row,
  16 KiB, is 16 KiB from the next row's), fourteen split over rows, stacked layers from four
  tensors; and one padded at stage 3 (1009 is prime)."""
  rng = np.random.default_rng(0)
  normal = lambda *shape: rng.standard_normal(shape, np.float32)
  arrays = {
    "wide": normal(256, 8192),
    **{f"mlp.{k}": normal(2, 1024, 1024) for k in range(14)},
    **{f"layers.{i}": normal(512, 1024) for i in range(LAYERS)},
    "odd": normal(3, 1009),
  }
  tensor_files.write(path, arrays)


def model_like() -> dict[str, jax.ShapeDtypeStruct]:
  struct = lambda *shape: jax.ShapeDtypeStruct(shape, np.float32)
  return {
    "wide": struct(256, 8192),
    **{f"mlp.{k}": struct(2, 1024, 1024) for k in range(14)},
    "layers": struct(LAYERS, 512, 1024),
    "odd": struct(3, 1009),
  }


KEYS = {"layers": [f"layers.{i}" for i in range(LAYERS)]}

#: The HuggingFace-style model: 8 layers of 6 MiB, one 8 MiB embedding and one 4 MiB bfloat16 head.
HUGGINGFACE_LAYERS, WIDTH, HIDDEN, VOCAB = 8, 2048, 768, 1021


def write_huggingface_model(path: Path) -> None:
  """A model as HuggingFace keeps it, written by its ``safetensors``: layers apart, ``Linear``
  weights ``(out, in)``, a vocabulary of 1021 (prime: it pads at stage 3), a bfloat16 head."""
  rng = np.random.default_rng(0)
  normal = lambda *shape: rng.standard_normal(shape, np.float32)
  arrays = {
    f"model.layers.{i}.mlp.up_proj.weight": normal(HIDDEN, WIDTH) for i in range(HUGGINGFACE_LAYERS)
  }
  arrays["model.embed_tokens.weight"] = normal(VOCAB, WIDTH)
  arrays["lm_head.weight"] = normal(VOCAB, WIDTH).astype(ml_dtypes.bfloat16)
  save_file(arrays, str(path))


def huggingface_like() -> tuple[dict, dict]:
  """The leaves of a scanned model in float32, ``(in, out)``, and the ``keys`` that read them."""
  struct = lambda *shape: jax.ShapeDtypeStruct(shape, np.float32)
  like = {
    "layers": struct(HUGGINGFACE_LAYERS, WIDTH, HIDDEN),  # stacked and transposed
    "embed": struct(VOCAB, WIDTH),
    "head": struct(WIDTH, VOCAB),  # transposed, cast from bfloat16, padded to 1024 columns
  }
  layers = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(HUGGINGFACE_LAYERS)]
  keys = {
    "layers": zerojax.FileKey(layers, transpose=(1, 0)),
    "embed": "model.embed_tokens.weight",
    "head": zerojax.FileKey("lm_head.weight", transpose=(1, 0)),
  }
  return like, keys


def resident_mib() -> float:
  """This process's resident memory now (``ru_maxrss`` is its peak so far), in MiB."""
  status = Path("/proc/self/status").read_text()
  return int(status.split("VmRSS:")[1].split()[0]) / 1024


def bytes_read() -> int:
  return int(Path("/proc/self/io").read_text().split("rchar:")[1].split()[0])


def main(directory: Path) -> None:
  zerojax.distributed.initialize(heartbeat_timeout=20, collective_timeout=60)
  path = directory / "model.safetensors"
  mesh = jax.make_mesh((8,), ("data",))
  tx = zerojax.zero3(optax.adam(1e-3), mesh=mesh)
  # Warm up what the first load starts (transfers, the processes' first collective).
  zerojax.load_safetensors(path, tx, {"odd": model_like()["odd"]})

  before, read_before = resident_mib(), bytes_read()
  params = zerojax.load_safetensors(path, tx, model_like(), keys=KEYS)
  jax.block_until_ready(params)
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  read = bytes_read() - read_before

  # Checked after measuring: HuggingFace's reader loads the whole file.
  whole = load_file(str(path))
  whole["layers"] = np.stack([whole.pop(name) for name in KEYS["layers"]])
  held, exact = 0, True  # held: the bytes of the file that this process's devices hold
  for name, leaf in params.items():
    padded = np.zeros(leaf.shape, np.float32)
    padded[tuple(slice(0, n) for n in whole[name].shape)] = whole[name]
    shards = {str(shard.index): shard for shard in leaf.value.addressable_shards}.values()
    for shard in shards:
      exact &= np.array_equal(np.asarray(shard.data), padded[shard.index])
      held += whole[name][shard.index].nbytes
  # Layers split over a "stage" axis whose two entries are the two processes.
  reads = []
  original = tensor_files.FileTensor.read
  tensor_files.FileTensor.read = lambda self, index: (
    reads.append(self.name) or original(self, index)
  )
  staged = jax.make_mesh((2, 4), ("stage", "data"))
  structs = {
    "layers": jax.ShapeDtypeStruct(
      (LAYERS, 512, 1024), np.float32, sharding=NamedSharding(staged, P("stage"))
    )
  }
  zerojax.load_safetensors(path, zerojax.zero3(optax.adam(1e-3), mesh=staged), structs, keys=KEYS)
  tensor_files.FileTensor.read = original
  # The leaf split over columns alone: its half of each row, and not the other half.
  read_before = bytes_read()
  wide = zerojax.load_safetensors(path, tx, {"wide": model_like()["wide"]})["wide"]
  wide_read = bytes_read() - read_before
  wide_held = sum(shard.data.nbytes for shard in wide.value.addressable_shards)
  # Stage 2 replicates its bf16 parameters; with init=True each process reads only its half of
  # the float32 master copy, and the parameters are gathered from it.
  tx = zerojax.zero2(optax.adam(1e-3), mesh=mesh, precision="bf16")
  read_before = bytes_read()
  zerojax.load_safetensors(path, tx, {"mlp.0": model_like()["mlp.0"]}, init=True)
  init_read = bytes_read() - read_before

  report = {
    "file_mib": path.stat().st_size / 2**20,
    "held_mib": held / 2**20,
    "read_mib": read / 2**20,
    "wide_read_mib": wide_read / 2**20,
    "wide_held_mib": wide_held / 2**20,
    "init_read_mib": init_read / 2**20,
    "growth_mib": peak - before,
    "exact": bool(exact),
    "layers_read": sorted(set(reads)),
  }
  (directory / f"p{jax.process_index()}.json").write_text(json.dumps(report))


def floor(directory: Path, axis_type: str) -> None:
  """Loads the HuggingFace-style model, measuring this process's peak memory over its baseline."""
  zerojax.distributed.initialize(heartbeat_timeout=20, collective_timeout=60)
  mesh = jax.make_mesh((8,), ("data",), (AXIS_TYPES[axis_type],))
  tx = zerojax.zero3(optax.adam(1e-3), mesh=mesh)
  like, keys = huggingface_like()
  # JAX started: the processes' first collective (which loading runs, to check that every
  # process loads the same model), and a small array on each device.
  multihost_utils.sync_global_devices("started")
  jax.block_until_ready(jax.device_put(np.zeros(8 * 1024, np.float32), NamedSharding(mesh, P())))
  before = resident_mib()
  params = zerojax.load_safetensors(directory / "huggingface.safetensors", tx, like, keys=keys)
  jax.block_until_ready(params)
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  held = sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards)

  # Checked after measuring: HuggingFace's reader loads the whole file.
  whole = load_file(str(directory / "huggingface.safetensors"))
  expected = {
    "layers": np.stack([whole[name].T for name in keys["layers"].key]),
    "embed": whole["model.embed_tokens.weight"],
    "head": whole["lm_head.weight"].T.astype(np.float32),
  }
  exact = True
  for name, leaf in params.items():
    padded = np.zeros(leaf.shape, np.float32)
    padded[tuple(slice(0, n) for n in expected[name].shape)] = expected[name]
    for shard in leaf.value.addressable_shards:
      exact &= np.array_equal(np.asarray(shard.data), padded[shard.index])
  report = {"growth_mib": peak - before, "held_mib": held / 2**20, "exact": bool(exact)}
  (directory / f"floor.p{jax.process_index()}.json").write_text(json.dumps(report))


if __name__ == "__main__":
  if "--floor" in sys.argv:
    floor(Path(sys.argv[1]), sys.argv[sys.argv.index("--floor") + 1])
  else:
    main(Path(sys.argv[1]))
