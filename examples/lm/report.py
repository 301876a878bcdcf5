"""What examples/train_lm.py prints and writes: header, progress, memory, metrics and plot."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import statistics
import sys
import time
from typing import Any

import jax
from tqdm import tqdm

from . import configs


@dataclasses.dataclass
class History:
  """What the training loop measured, step by step.

  Attributes:
    first_step: the first step trained (after a resume, the one after the checkpoint's).
    train_loss: every step's training loss.
    val_loss: ``{"step": ..., "loss": ...}`` of every validation.
    step_seconds: every step's wall time.
    grad_norms: every step's gradient norm before clipping (stages 1-3).
  """

  first_step: int
  train_loss: list[float] = dataclasses.field(default_factory=list)
  val_loss: list[dict[str, float]] = dataclasses.field(default_factory=list)
  step_seconds: list[float] = dataclasses.field(default_factory=list)
  grad_norms: list[float] = dataclasses.field(default_factory=list)

  def record(self, loss: float, seconds: float, opt_state: Any) -> None:
    """Notes a step's loss, time and, with a zerojax state, its pre-clip gradient norm."""
    self.train_loss.append(loss)
    self.step_seconds.append(seconds)
    if hasattr(opt_state, "pre_clip_grad_norm"):
      self.grad_norms.append(float(opt_state.pre_clip_grad_norm))


def describe(config: configs.Config, n_params: int, platform: str, corpus: Any) -> str:
  """The run's first line: model, stage, devices and their mesh, precision, batch and data."""
  mesh = ", ".join(f"{name}={size}" for name, size in config.mesh_shape.items())
  quantized = {"weights": config.quantized_weights, "gradients": config.quantized_gradients}
  wire = ", ".join(f"{bits} {what}" for what, bits in quantized.items() if bits)
  host = {"optimizer": "optimizer state", "optimizer+master": "optimizer state and master copy"}
  return (
    f"{config.model} model: {n_params / 1e6:.2f}M params, stage {config.stage} on "
    f"{config.devices} {platform} devices (mesh {mesh}"
    f"{f', hpZ over {config.secondary_axis}' if config.secondary_axis else ''}) in "
    f"{_count(jax.process_count(), 'process', 'processes')}, {config.precision} precision"
    f"{f' with {wire} on the wire' if wire else ''}"
    f"{f', {host[config.offload]} in host memory' if config.offload else ''}; "
    f"batch {config.batch_size} = "
    f"{config.device_batch} per device x {config.batch_devices} x "
    f"{_count(config.microbatches, 'micro-batch', 'micro-batches')}"
    f"{f' ({config.pipeline} pipeline)' if config.pipeline else ''}; "
    f"{len(corpus.train) / 1e6:.2f}M train bytes, {len(corpus.val) / 1e3:.0f}K validation bytes"
  )


class Progress:
  """The training's progress, printed by the leader: a bar on a terminal, plain lines elsewhere.

  tqdm redraws its bar in place with carriage returns, which a terminal
  overwrites and a file (a batch job's log, the launcher's pipe) keeps: 150 KB
  on one line for 600 steps. So where the bar's stream (stderr) is not a
  terminal, a plain line is printed after the first step, every
  ``config.log_every`` steps, at least every ``LINE_SECONDS``, and after the
  last step.
  """

  #: Where the output is not a terminal, the longest time between two lines.
  LINE_SECONDS = 60.0

  def __init__(self, config: configs.Config, first_step: int, *, enabled: bool):
    self._config, self._first_step, self._enabled = config, first_step, enabled
    self._bar = None
    if enabled and sys.stderr.isatty():
      self._bar = tqdm(
        desc=f"ZeRO-{config.stage}",
        dynamic_ncols=True,
        initial=first_step - 1,
        total=config.steps,
      )
    self._last_line = time.monotonic()

  def step(self, step: int, stats: dict[str, Any]) -> None:
    """Shows step ``step``, just finished, and its figures (``progress``'s)."""
    if self._bar is not None:
      self._bar.update()
      self._bar.set_postfix(stats)
      return
    now = time.monotonic()
    due = step in (self._first_step, self._config.steps) or step % self._config.log_every == 0
    if self._enabled and (due or now - self._last_line >= self.LINE_SECONDS):
      figures = ", ".join(f"{name} {value}" for name, value in stats.items())
      print(f"step {step}/{self._config.steps}: {figures}", flush=True)
      self._last_line = now

  def write(self, line: str) -> None:
    """Prints ``line`` (a validation's) without breaking the bar."""
    if self._bar is not None:
      self._bar.write(line)
    elif self._enabled:
      print(line, flush=True)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()


def progress(history: History, opt_state: Any, tokens: int) -> dict[str, Any]:
  """The progress bar's figures after a step."""
  stats = dict(loss=f"{history.train_loss[-1]:.3f}")
  if hasattr(opt_state, "pre_clip_grad_norm"):
    stats["grad_norm"] = f"{history.grad_norms[-1]:.2f}"  # before clip_by_global_norm
    if opt_state.loss_scale is not None:
      stats["skipped"] = int(opt_state.skipped_steps)
  seconds = history.step_seconds[-1]
  return stats | dict(tok_s=f"{tokens / seconds:,.0f}", step_ms=f"{1e3 * seconds:.0f}")


def validation(history: History, unigram_loss: float) -> str:
  """The line printed after a validation."""
  return (
    f"step {history.val_loss[-1]['step']}: train {history.train_loss[-1]:.3f}, validation "
    f"{history.val_loss[-1]['loss']:.3f} (unigram {unigram_loss:.3f}) nats/byte"
  )


def per_device_bytes(tree: Any, memory_kind: str | None = None) -> int:
  """Bytes of ``tree`` that one device holds: its shard of every leaf (in ``memory_kind`` only).

  The leaves may be arrays or ``jax.ShapeDtypeStruct`` s with a sharding.
  """
  return sum(
    math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
    for x in jax.tree.leaves(tree)
    if memory_kind in (None, x.sharding.memory_kind)
  )


MEMORY_ROWS = {
  "params_and_opt_state": "params + optimizer state",
  "in_host_memory": "  of which in host memory",
  "arguments": "step arguments",
  "outputs": "step outputs",
  "temporaries": "step temporaries",
}


def memory_stats(compiled: jax.stages.Compiled, params: Any, opt_state: Any) -> dict[str, int]:
  """Per-device bytes of a compiled train step, as XLA measured them, and of its state."""
  analysis = compiled.memory_analysis()
  return {
    "params_and_opt_state": per_device_bytes((params, opt_state)),
    "in_host_memory": per_device_bytes((params, opt_state), "pinned_host"),
    "arguments": analysis.argument_size_in_bytes,
    "outputs": analysis.output_size_in_bytes,
    "temporaries": analysis.temp_size_in_bytes,
  }


def format_memory(memory: dict[str, dict[str, int]]) -> str:
  """A table of per-device MiB, one column per stage, one row per ``MEMORY_ROWS`` entry."""
  lines = [f"{'per-device memory (MiB)':<26}" + "".join(f"{stage:>10}" for stage in memory)]
  for key, label in MEMORY_ROWS.items():
    if not any(m[key] for m in memory.values()):
      continue  # the host-memory row, without --offload
    lines.append(f"{label:<26}" + "".join(f"{m[key] / 2**20:>10.2f}" for m in memory.values()))
  return "\n".join(lines)


def metrics(
  config: configs.Config,
  history: History,
  *,
  n_params: int,
  platform: str,
  unigram_loss: float,
  skipped_steps: int,
  compile_seconds: float,
  memory: dict[str, dict[str, int]],
  sample: str | None,
) -> dict[str, Any]:
  """The run's settings and results, as ``metrics.json`` holds them."""
  settings = dataclasses.asdict(config) | {
    "out": str(config.out),
    "checkpoint_dir": config.checkpoint_dir and str(config.checkpoint_dir),
    "mesh": config.mesh_shape,
    "n_params": n_params,
    "platform": platform,
  }
  step_seconds = statistics.median(history.step_seconds)
  return {
    "config": dataclasses.asdict(config.preset) | settings,
    "unigram_loss": unigram_loss,
    "first_step": history.first_step,
    "train_loss": history.train_loss,
    "val_loss": history.val_loss,
    "pre_clip_grad_norm": history.grad_norms,
    "skipped_steps": skipped_steps,
    "compile_seconds": compile_seconds,
    "step_seconds": step_seconds,
    "tokens_per_second": config.batch_size * config.seq_len / step_seconds,
    "memory_bytes": memory,
    "sample": sample,
  }


def write(out: pathlib.Path, metrics: dict[str, Any], *, with_plot: bool = True) -> None:
  """Writes ``metrics.json`` (and, ``with_plot``, the loss plot ``loss.png``) into ``out``."""
  written = [out / "metrics.json"]
  written[0].write_text(json.dumps(metrics, indent=2))
  if with_plot:
    written.append(out / "loss.png")
    plot(written[1], metrics["train_loss"], metrics["val_loss"], metrics["unigram_loss"])
  print("wrote", " and ".join(map(str, written)))


def plot(
  path: pathlib.Path, train_loss: list[float], val_loss: list[dict[str, float]], baseline: float
) -> None:
  """Saves the loss curves, with the unigram baseline for scale."""
  # Imported here, at the end of a run, not with the module: it takes 0.6 s that every process
  # of a multi-process run would pay before its first step.
  from matplotlib.figure import Figure

  figure = Figure(figsize=(7, 4))
  ax = figure.subplots()
  ax.plot(train_loss, label="train", linewidth=0.8)
  ax.plot([v["step"] for v in val_loss], [v["loss"] for v in val_loss], "o-", label="validation")
  ax.axhline(baseline, color="gray", linestyle="--", label="unigram baseline")
  ax.set(xlabel="step", ylabel="cross-entropy (nats/byte)")
  ax.legend()
  figure.savefig(path, dpi=120, bbox_inches="tight")


def start_loss_log(out: pathlib.Path, *, keep: bool) -> pathlib.Path:
  """``out/losses.jsonl``, emptied unless ``keep``: appended to every step, so a killed run
  keeps its lines (and a resumed one adds to them)."""
  out.mkdir(parents=True, exist_ok=True)
  path = out / "losses.jsonl"
  if not keep:
    path.unlink(missing_ok=True)
  return path


def log_loss(path: pathlib.Path, step: int, loss: float) -> None:
  """Appends ``{"step": step, "loss": loss}`` to ``path`` as one line (one small write)."""
  with open(path, "a") as log:
    log.write(json.dumps({"step": step, "loss": loss}) + "\n")


def _count(n: int, one: str, many: str) -> str:
  return f"{n} {one if n == 1 else many}"
