"""Reporting for examples/train_lm.py: the step's memory per device, the loss log and plot."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
from matplotlib.figure import Figure


def per_device_bytes(tree: Any) -> int:
  """Bytes of ``tree`` that one device holds: the size of its shard of every leaf."""
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


MEMORY_ROWS = {
  "params_and_opt_state": "params + optimizer state",
  "arguments": "step arguments",
  "outputs": "step outputs",
  "temporaries": "step temporaries",
}


def memory_stats(compiled: jax.stages.Compiled, params: Any, opt_state: Any) -> dict[str, int]:
  """Per-device bytes of a compiled train step, as XLA measured them, and of its state."""
  analysis = compiled.memory_analysis()
  return {
    "params_and_opt_state": per_device_bytes((params, opt_state)),
    "arguments": analysis.argument_size_in_bytes,
    "outputs": analysis.output_size_in_bytes,
    "temporaries": analysis.temp_size_in_bytes,
  }


def format_memory(memory: dict[str, dict[str, int]]) -> str:
  """A table of per-device MiB, one column per stage, one row per ``MEMORY_ROWS`` entry."""
  lines = [f"{'per-device memory (MiB)':<26}" + "".join(f"{stage:>10}" for stage in memory)]
  for key, label in MEMORY_ROWS.items():
    lines.append(f"{label:<26}" + "".join(f"{m[key] / 2**20:>10.2f}" for m in memory.values()))
  return "\n".join(lines)


def plot(
  path: pathlib.Path, train_loss: list[float], val_loss: list[dict[str, float]], baseline: float
) -> None:
  """Saves the loss curves, with the unigram baseline for scale."""
  figure = Figure(figsize=(7, 4))
  ax = figure.subplots()
  ax.plot(train_loss, label="train", linewidth=0.8)
  ax.plot([v["step"] for v in val_loss], [v["loss"] for v in val_loss], "o-", label="validation")
  ax.axhline(baseline, color="gray", linestyle="--", label="unigram baseline")
  ax.set(xlabel="step", ylabel="cross-entropy (nats/byte)")
  ax.legend()
  figure.savefig(path, dpi=120, bbox_inches="tight")


def log_loss(path: pathlib.Path, step: int, loss: float) -> None:
  """Appends ``{"step": step, "loss": loss}`` to ``path`` as one line (one small write)."""
  with open(path, "a") as log:
    log.write(json.dumps({"step": step, "loss": loss}) + "\n")
