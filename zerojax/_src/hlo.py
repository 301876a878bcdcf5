"""Communication read from compiled HLO: each collective's count and bytes per step."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s([a-z][\w\-]*)\(")
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_CALLEE = re.compile(r"\b(?:body|to_apply|calls|branch_computations)=\{?%?([\w.\-]+)")
_TRIP_COUNT = re.compile(r'known_trip_count"?\s*[:=]\s*\{\s*"?n"?\s*[:=]\s*"?(\d+)')
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[\d+,(\d+)\]")


@dataclasses.dataclass
class Collective:
  """How often one kind of collective runs per step, and how many bytes it moves.

  Attributes:
    count: executions per step (a collective inside a loop counts once per
      iteration).
    bytes: bytes per device per step, counted as the full-size buffer the
      collective assembles or reduces: an all-gather's result, a
      reduce-scatter's operand, an all-reduce's operand. This is the ZeRO
      paper's accounting, where gathering or reduce-scattering Ψ parameters
      moves "Ψ".
  """

  count: int = 0
  bytes: int = 0


def count_collectives(hlo: Any) -> dict[str, Collective]:
  """Counts the collectives of a compiled program, loops unrolled by their trip counts.

  Args:
    hlo: HLO text, or anything with ``as_text()`` (a ``jax.stages.Compiled``).

  Returns:
    A ``Collective`` per kind in ``KINDS``.

  Example:
    >>> import jax, jax.numpy as jnp, zerojax
    >>> compiled = jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile()
    >>> zerojax.count_collectives(compiled)["all-reduce"]
    Collective(count=0, bytes=0)
  """
  text = hlo if isinstance(hlo, str) else hlo.as_text()
  computations, entry = _parse(text)
  totals = {kind: Collective() for kind in KINDS}
  _accumulate(computations, entry, 1, totals, set())
  return totals


def _parse(text: str):
  """Splits HLO text into computations: name -> list of instruction lines."""
  computations: dict[str, list[str]] = {}
  entry = None
  current = None
  for line in text.splitlines():
    match = _COMPUTATION.match(line)
    if match and "=" not in line.split("(")[0]:
      current = match.group(2)
      computations[current] = []
      if match.group(1):
        entry = current
    elif current is not None and line.strip() == "}":
      current = None
    elif current is not None:
      computations[current].append(line)
  if entry is None:
    raise ValueError("no ENTRY computation in this HLO text; pass compiled.as_text().")
  return computations, entry


def _accumulate(computations, name, multiplier, totals, stack):
  if name in stack or name not in computations:
    return
  stack.add(name)
  for line in computations[name]:
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    result_type, opcode = match.groups()
    kind = opcode.removesuffix("-start")
    if kind in KINDS and not opcode.endswith("-done"):
      stats = totals[kind]
      stats.count += multiplier
      stats.bytes += multiplier * _moved_bytes(kind, opcode, result_type, line)
    trip = 1
    if opcode == "while":
      found = _TRIP_COUNT.search(line)
      trip = int(found.group(1)) if found else 1
    for callee in _CALLEE.findall(line):
      _accumulate(computations, callee, multiplier * trip, totals, stack)
  stack.discard(name)


def _moved_bytes(kind: str, opcode: str, result_type: str, line: str) -> int:
  arrays = [_nbytes(dtype, dims) for dtype, dims in _ARRAY.findall(result_type)]
  if opcode.endswith("-start") and len(arrays) > 1:
    arrays = arrays[len(arrays) // 2 :]  # (operands..., results...): keep the results
  size = sum(arrays)
  if kind == "reduce-scatter":
    size *= _group_size(line)
  return size


def _group_size(line: str) -> int:
  listed = _GROUPS_LIST.search(line)
  if listed:
    return len(listed.group(1).split(","))
  iota = _GROUPS_IOTA.search(line)
  return int(iota.group(1)) if iota else 1


def _nbytes(dtype: str, dims: str) -> int:
  """Bytes of an HLO array type such as ``f32[64,8]`` (``pred`` and sub-byte types count 1)."""
  bits = re.match(r"[a-z]+(\d+)", dtype)
  width = max(int(bits.group(1)) // 8, 1) if bits else 1
  return math.prod(int(d) for d in dims.split(",") if d) * width
