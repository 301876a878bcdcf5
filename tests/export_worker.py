"""One process of the 2-process export job of ``tests/test_export_pretrained.py``.

``python -m zerojax_launch -n 2 --devices-per-process 4 tests/export_worker.py DIR``: shards
``model()`` at stage 3 over the 8 devices of both processes and exports it with ``KEYS``
(stacked layers back to one tensor each, transposed, bfloat16) into ``DIR/stage3``, measuring
this process's peak resident memory (``VmHWM``, reset first) above what it held before and the
bytes it wrote (``wchar`` of ``/proc/self/io``); then the same at stage 2, whose parameters both
processes hold whole, into ``DIR/stage2``. Writes ``DIR/p<process>.json``.
"""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import zerojax

LAYERS = 8


def model() -> dict[str, np.ndarray]:
  """48 MiB of float32: 8 layers of a (1024, 1024) kernel (in, out), an odd embedding."""
  rng = np.random.default_rng(0)
  normal = lambda *shape: rng.standard_normal(shape, np.float32)
  return {
    "embed": normal(1021, 1024),
    "blocks": {"kernel": normal(LAYERS, 1024, 1024), "bias": normal(LAYERS, 1024)},
  }


KEYS = {
  "embed": "model.embed_tokens.weight",
  "blocks.kernel": zerojax.FileKey([f"model.layers.{i}.weight" for i in range(LAYERS)], (1, 0)),
  "blocks.bias": [f"model.layers.{i}.bias" for i in range(LAYERS)],
}


def expected_tensors(full: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  out = {"model.embed_tokens.weight": full["embed"]}
  for i in range(LAYERS):
    out[f"model.layers.{i}.weight"] = full["blocks"]["kernel"][i].T
    out[f"model.layers.{i}.bias"] = full["blocks"]["bias"][i]
  return out


def status_mib(field: str) -> float:
  status = Path("/proc/self/status").read_text()
  return int(status.split(f"{field}:")[1].split()[0]) / 1024


def reset_peak() -> None:
  """Starts the peak resident memory (``VmHWM``) afresh from what the process holds now."""
  Path("/proc/self/clear_refs").write_text("5")


def bytes_written() -> int:
  return int(Path("/proc/self/io").read_text().split("wchar:")[1].split()[0])


def main(directory: Path) -> None:
  zerojax.distributed.initialize(heartbeat_timeout=20, collective_timeout=60)
  mesh = jax.make_mesh((8,), ("data",))
  full = model()
  report = {}
  for stage, make in ((3, zerojax.zero3), (2, zerojax.zero2)):
    tx = make(optax.adam(1e-3), mesh=mesh)
    params = jax.block_until_ready(tx.shard(full))
    # Warm up what the first export compiles and starts (its slices, the first collective).
    zerojax.export_pretrained(directory / "warm", tx, params, keys=KEYS, dtype=jnp.bfloat16)
    reset_peak()
    before, written_before = status_mib("VmRSS"), bytes_written()
    zerojax.export_pretrained(
      directory / f"stage{stage}", tx, params, keys=KEYS, dtype=jnp.bfloat16, max_file_bytes=2**22
    )
    peak = status_mib("VmHWM")
    report[f"stage{stage}"] = {
      "growth_mib": peak - before,
      "written_mib": (bytes_written() - written_before) / 2**20,
    }
  (directory / f"p{jax.process_index()}.json").write_text(json.dumps(report))


if __name__ == "__main__":
  main(Path(sys.argv[1]))
