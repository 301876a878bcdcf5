"""How the benchmarks write what they measured: tables, Markdown sections and plots.

Shared by the benchmark scripts. A result is a list of rows (dicts); a table
shows the columns it is given (``COLUMNS`` holds those the scripts share). A
report opens with its provenance (date, versions, machine, load) and the
command that reruns it, and replaces the generated section of a Markdown file
(``write_markdown``), leaving the prose around it alone.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import time
from typing import Any

import jax
import optax
from measure import MIB
from model import ModelConfig

RESULTS_END = "<!-- results: end -->"

#: Every column the benchmarks' tables share, by the key of its row field: (title, format).
COLUMNS = {
  "n": ("N", "d"),
  "setup": ("setup", "s"),
  "persistent": ("params+opt MiB", ".3f"),
  "estimate": ("estimator MiB", ".3f"),
  "ideal": ("ZeRO formula MiB", ".3f"),
  "arguments": ("XLA args MiB", ".2f"),
  "temp": ("XLA temp MiB", ".2f"),
  "peak": ("XLA peak MiB", ".2f"),
  "all-gather": ("all-gather MiB", ".2f"),
  "reduce-scatter": ("reduce-scatter MiB", ".2f"),
  "all-reduce": ("all-reduce MiB", ".2f"),
  "collective-permute": ("permute MiB", ".2f"),
  "all-to-all": ("all-to-all MiB", ".2f"),
  "volume": ("volume (Ψ)", ".2f"),
  "ideal volume": ("ZeRO (Ψ)", ".0f"),
  "step ms": ("median step ms", ".0f"),
  "vs DP": ("time vs DP", ".2f"),
  "range": ("per-round range", "s"),
  "loss": ("final loss", ".5f"),
}


#: The columns of a step's collectives, and of its time against replicated DP's.
COLLECTIVE_COLUMNS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "volume")
TIME_COLUMNS = ("step ms", "vs DP", "range")


def add_output_flags(parser: argparse.ArgumentParser, *, plots: bool = False) -> None:
  """Adds ``--markdown`` (the file to write the results into) and, with ``plots``, ``--plots``."""
  parser.add_argument("--markdown", metavar="PATH", help="write the results into this file")
  if plots:
    parser.add_argument("--plots", metavar="DIR", help="save the PNG plots into this directory")


def columns(*keys: str, more: dict[str, tuple[str, str]] | None = None) -> dict:
  """The ``COLUMNS`` of ``keys``, in that order, then a script's own ``more``."""
  return {key: COLUMNS[key] for key in keys} | (more or {})


def table(rows: list[dict[str, Any]], columns: dict[str, tuple[str, str]]) -> str:
  """A Markdown table of ``rows`` (also plain text); ``columns`` maps a key to (title, format)."""
  header = [title for title, _ in columns.values()]
  body = [[format(row[key], spec) for key, (_, spec) in columns.items()] for row in rows]
  widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
  render = lambda line: "| " + " | ".join(map(str.ljust, line, widths)) + " |"
  rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
  return "\n".join([render(header), rule, *(render(line) for line in body)])


def section(title: str, *lines: str) -> list[str]:
  """A report's section: its bold title, then ``lines``, each block followed by a blank line."""
  return [f"**{title}**", "", *lines, ""]


class Clock:
  """The wall time and the one-minute load average of a run, from its start."""

  def __init__(self):
    self.start, self.load = time.perf_counter(), os.getloadavg()[0]

  def elapsed(self) -> float:
    return time.perf_counter() - self.start


def _cpu_name() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    return platform.processor() or platform.machine()


def provenance(devices: int, clock: Clock) -> str:
  """When, with what and on what machine the run was made, how long it took, and the load."""
  device = jax.devices()[0]
  cpus = f"{len(os.sched_getaffinity(0))} CPUs ({_cpu_name()})"
  on = (
    f"{cpus} split into {devices} forced host devices"
    if device.platform == "cpu"
    else f"{devices} {device.device_kind} devices, {cpus}"
  )
  return (
    f"Measured {datetime.date.today().isoformat()} with jax {jax.__version__}, optax "
    f"{optax.__version__}, Python {platform.python_version()}, on {platform.platform()}: "
    f"{on}. The whole run took {clock.elapsed():.0f} s; the one-minute load average "
    f"was {clock.load:.1f} at the start and {os.getloadavg()[0]:.1f} at the end."
  )


def accelerator_provenance(clock: Clock) -> str:
  """When and with which compilers a deviceless run compiled its steps, and how long it took."""
  from importlib import metadata

  versions = []
  for package in ("jax-cuda12-pjrt", "libtpu"):
    try:
      versions.append(f"{package} {metadata.version(package)}")
    except metadata.PackageNotFoundError:
      continue
  return (
    f"Compiled {datetime.date.today().isoformat()} with jax {jax.__version__} and "
    f"{', '.join(versions) or 'no accelerator compiler'}, without the devices (deviceless "
    f"ahead-of-time compilation), on {platform.platform()}; the whole run took "
    f"{clock.elapsed():.0f} s."
  )


def commit() -> str:
  """This checkout's commit, with ``+`` if zerojax/ or the benchmarks are changed: what a cached
  result records it was compiled at."""
  here = os.path.dirname(os.path.abspath(__file__))
  git = lambda *a: subprocess.run(["git", "-C", here, *a], capture_output=True, text=True).stdout
  dirty = git("status", "--porcelain", "--", "../zerojax", "*.py").strip()
  return git("rev-parse", "--short", "HEAD").strip() + ("+" if dirty else "")


def command(script: str, argv: list[str]) -> list[str]:
  """The lines of a Markdown code block that reruns ``script`` with ``argv``."""
  return ["```", " ".join([f"python benchmarks/{script}", *argv]), "```"]


def describe_model(config: ModelConfig, psi: int) -> str:
  """One sentence: the model's shape, batch, optimizer and parameter count Ψ."""
  return (
    f"Model: {config.layers} layers, d_model {config.d_model}, {config.heads} heads, vocabulary "
    f"{config.vocab}, global batch {config.batch} x {config.seq} tokens, fp32, `optax.adam`; "
    f"Ψ = {psi:,} parameters ({4 * psi / MIB:.2f} MiB)."
  )


def describe_timing(warmup: int, rounds: int, steps: int) -> str:
  """One sentence: how the setups were timed."""
  return (
    f"Timing: {warmup} warm-up steps, then {rounds} interleaved rounds, each timing "
    f"{steps} step(s) of every setup."
  )


def write_markdown(path: str, section: str, begin: str, title: str) -> None:
  """Replaces the generated section of ``path`` (between the markers), keeping the rest.

  Args:
    path: the Markdown file; created, with ``title`` as its heading, if missing.
    section: the new text between the markers.
    begin: the marker that opens the section (``RESULTS_END`` closes it).
    title: the heading of a new file.
  """
  block = f"{begin}\n{section}\n{RESULTS_END}"
  try:
    with open(path) as f:
      text = f.read()
  except FileNotFoundError:
    text = f"# {title}\n\n{begin}\n{RESULTS_END}\n"
  if begin not in text or RESULTS_END not in text:
    raise ValueError(f"{path} has no {begin!r} ... {RESULTS_END!r} section to replace")
  before, rest = text.split(begin, 1)
  after = rest.split(RESULTS_END, 1)[1]
  with open(path, "w") as f:
    f.write(before + block + after)


def plot_path(plots: str | None, markdown: str | None, name: str) -> tuple[str | None, str | None]:
  """Where to save the plot ``name`` in ``plots``, and its path relative to ``markdown``.

  ``(None, None)`` when no ``plots`` directory is given.
  """
  if not plots:
    return None, None
  os.makedirs(plots, exist_ok=True)
  path = os.path.join(plots, name)
  return path, os.path.relpath(path, os.path.dirname(markdown or ".") or ".")


def mark_zero_volumes(ax, right: float) -> None:
  """Dashed lines at ZeRO's 2Ψ and 3Ψ on a plot of volume per step, labelled at ``right``."""
  for level in (2, 3):
    ax.axhline(level, color="gray", linestyle="--", linewidth=1)
    ax.annotate(f"{level}Ψ", (right, level), xytext=(2, 2), textcoords="offset points")
