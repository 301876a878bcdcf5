"""What the benchmarks measure of their setups: step times, bytes held and bytes moved.

Shared by the benchmark scripts. Timing runs every setup in turn, round after
round (``time_interleaved``), so that a slow spell of a shared machine hits
them all alike; memory comes from the arrays' shards and XLA's
``memory_analysis``, communication from the compiled HLO, in the ZeRO paper's
units of Ψ.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import jax
from setups import Setup

import zerojax

MIB = 2**20


def add_timing_flags(
  parser: argparse.ArgumentParser, *, warmup: int = 2, rounds: int = 10, steps: bool = True
) -> None:
  """Adds the flags of ``time_interleaved``: warm-up steps, rounds, and steps per round.

  ``steps=False`` leaves ``--steps`` to the script (quantization.py's means train_lm steps).
  """
  parser.add_argument("--warmup", type=int, default=warmup, help="untimed steps per setup")
  parser.add_argument("--rounds", type=int, default=rounds, help="interleaved timing rounds")
  if steps:
    parser.add_argument("--steps", type=int, default=1, help="timed steps per setup per round")


def run_steps(setup: Setup, count: int) -> list[float]:
  """Runs ``count`` steps, returning each one's wall time in seconds."""
  step = setup.compile()
  times = []
  for _ in range(count):
    start = time.perf_counter()
    setup.params, setup.state, loss = step(setup.params, setup.state, *setup.batch)
    loss.block_until_ready()
    times.append(time.perf_counter() - start)
  if times:
    setup.loss = float(loss)
  return times


def time_interleaved(setups: list[Setup], warmup: int, rounds: int, steps: int):
  """Step times per setup, and per-round ratios to the first setup.

  Each round runs ``steps`` steps of every setup in turn, so a slow spell of
  a shared machine hits all setups alike; a setup's ratio for a round is its
  median step time over the first setup's in the same round.

  Args:
    setups: the setups, the baseline first.
    warmup: untimed steps per setup.
    rounds: timing rounds.
    steps: timed steps per setup per round.

  Returns:
    ``(times, ratios)``: per setup, every timed step's seconds, and the
    per-round ratios.
  """
  for setup in setups:
    run_steps(setup, warmup)
  times = {s.name: [] for s in setups}
  ratios = {s.name: [] for s in setups}
  for _ in range(rounds):
    medians = {}
    for setup in setups:
      round_times = run_steps(setup, steps)
      times[setup.name] += round_times
      medians[setup.name] = statistics.median(round_times)
    baseline = medians[setups[0].name]
    for name, median in medians.items():
      ratios[name].append(median / baseline)
  return times, ratios


def relative_time(ratios: dict[str, list[float]], name: str, baseline: str) -> list[float]:
  """Per round, ``name``'s step time over ``baseline``'s (both timed in that round)."""
  return [a / b for a, b in zip(ratios[name], ratios[baseline], strict=True)]


def ratio_range(ratios: list[float]) -> str:
  """``"0.85-1.12"``: the smallest and largest of per-round ratios."""
  return f"{min(ratios):.2f}-{max(ratios):.2f}"


def persistent_bytes(tree: Any) -> int:
  """Bytes one device holds of ``tree``: its first addressable shard of each leaf."""
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def ideal(name: str, psi: int, n: int) -> tuple[float, float]:
  """ZeRO-paper (persistent bytes per device, collective volume in Ψ) for fp32 Adam.

  Parameters take 4Ψ bytes and Adam's two moments 8Ψ. Replicated DP keeps
  all of it; stages 1 and 2 keep the parameters and 1/N of the state; stage 3
  and FSDP 1/N of everything. Communication: an all-reduce of the gradients
  is 2Ψ (a reduce-scatter plus an all-gather), stages 1 and 2 reduce-scatter
  gradients and all-gather parameters (2Ψ), stage 3 and FSDP all-gather the
  parameters twice, forward and backward, and reduce-scatter gradients (3Ψ).
  """
  if name.startswith("replicated"):
    return 12 * psi, 2.0
  if name.startswith(("zero1", "zero2")):
    return 4 * psi + 8 * psi / n, 2.0
  return 12 * psi / n, 3.0


def collective_volume(moved: dict[str, float]) -> float:
  """The bytes of ``moved`` (per collective kind) in ZeRO's accounting.

  An all-reduce counts twice its operand: a ring all-reduce is a
  reduce-scatter plus an all-gather.
  """
  return sum(moved.values()) + moved.get("all-reduce", 0)


def moved_bytes(profile: zerojax.diagnostics.StepProfile) -> dict[str, float]:
  """Bytes per collective kind of a profiled step."""
  return {kind: c.bytes for kind, c in profile.collectives.items()}


def volume_by_axis(step: jax.stages.Compiled, mesh, psi: int) -> dict[str, float]:
  """``collective_volume`` of a compiled step over each axis of ``mesh``, in Ψ (fp32).

  A collective over several axes counts on each of them.
  """
  moved = {axis: 0.0 for axis in mesh.axis_names}
  for axes, kinds in zerojax.diagnostics.count_collectives_by_axes(step, mesh).items():
    volume = collective_volume({kind: c.bytes for kind, c in kinds.items()})
    for axis in axes:
      moved[axis] += volume / (4 * psi)
  return moved


def cross_node(bytes_by_axes: dict, devices_per_node: int) -> float:
  """Bytes that cross into or out of one node per step, as the ZeRO++ paper counts them.

  ``bytes_by_axes`` is ``count_collectives_by_axes``'s bytes per device, keyed
  by the axes spanned (their names joined by spaces), on a ``node x data``
  mesh. A collective over ``node`` alone runs on every device of
  the node: its bytes count ``devices_per_node`` times. One over ``node`` and
  ``data`` runs once for the node, its parts crossing once. An all-reduce
  moves its array twice (a reduce-scatter and an all-gather); an all-to-all's
  chunks differ for each device, so it counts once per device of the node.
  """
  total = 0.0
  for axes, kinds in bytes_by_axes.items():
    axes = tuple(axes.split())
    if "node" not in axes:
      continue
    group = devices_per_node if "data" in axes else 1  # the node's devices in one collective
    for kind, moved in kinds.items():
      times = {"all-reduce": 2 * devices_per_node / group, "all-to-all": devices_per_node}
      total += moved * times.get(kind, devices_per_node / group)
  return total


def results(setups: list[Setup], times, ratios, psi: int, n: int) -> list[dict[str, Any]]:
  """One row per setup: memory, collective bytes, volume, time and loss.

  Args:
    setups: the setups, timed by ``time_interleaved``.
    times: its step times.
    ratios: its per-round ratios to the first setup.
    psi: the parameter count.
    n: the number of devices the data axis spans.
  """
  rows = []
  for setup in setups:
    profile = setup.profile()
    moved = moved_bytes(profile)
    ideal_bytes, ideal_volume = ideal(setup.name, psi, n)
    rows.append(
      {
        "setup": setup.name,
        "persistent": persistent_bytes((setup.params, setup.state)) / MIB,
        "ideal": ideal_bytes / MIB,
        "arguments": profile.argument_bytes / MIB,
        "temp": profile.temp_bytes / MIB,
        "peak": profile.peak_bytes / MIB,
        **{kind: size / MIB for kind, size in moved.items()},
        "volume": collective_volume(moved) / (4 * psi),
        "ideal volume": ideal_volume,
        "step ms": 1e3 * statistics.median(times[setup.name]),
        "vs DP": statistics.median(ratios[setup.name]),
        "range": ratio_range(ratios[setup.name]),
        "loss": setup.loss,
      }
    )
  return rows


def gpu_estimate(log: str, compiled: jax.stages.Compiled) -> dict[str, Any]:
  """XLA:GPU's estimate of ``compiled`` from its scheduler ``log``, as the accelerator
  benchmarks record it: total and waiting cycles, each loop's waiting share, and the
  computations that logged nothing."""
  estimate = zerojax.diagnostics.scheduler_estimate(log, compiled)
  return {
    "cycles": estimate.cycles,
    "wasted": estimate.wasted,
    "loop waiting": [loop.waiting for loop in estimate.loops],
    "silent": list(estimate.silent),
  }
