"""Communication read from HLO text: each collective's count and bytes per step."""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

# An array type, e.g. ``bf16[8,64]``: (dtype, its bit width, dimensions). ``pred``
# has no width in its name; tokens have no size and do not match.
_ARRAY = re.compile(r"\b(pred|[a-z]+(\d+)\w*)\[([<=\d,]*)\]")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*)?\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_CALLEES = re.compile(
  r"\b(calls|to_apply|body|true_computation|false_computation|branch_computations)="
  r"(\{[^}]*\}|%?[\w.\-]+)"
)
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


@dataclasses.dataclass
class Collective:
  """How often one kind of collective runs per step, and how many bytes it moves.

  Attributes:
    count: executions per step. A collective inside a while loop counts once
      per iteration; an asynchronous ``-start`` / ``-done`` pair counts once;
      a combined collective (several arrays in one tuple-shaped instruction)
      counts once.
    bytes: bytes per device per step, counted as the full logical size of the
      data the collective works on: an all-gather's result (the gathered
      array); a reduce-scatter's, all-reduce's, all-to-all's or
      collective-permute's operand (the unreduced, unscattered array). This is
      the ZeRO paper's accounting, where gathering or reduce-scattering Ψ
      parameters moves "Ψ". A combined collective sums its arrays.

  Example:
    Summing an array split over 8 devices all-reduces one float32 per device:

    >>> import jax, jax.numpy as jnp, zerojax
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> x = jax.device_put(jnp.ones(1024), jax.NamedSharding(mesh, jax.P("data")))
    >>> zerojax.profile(jnp.sum, x).collectives["all-reduce"]
    Collective(count=1, bytes=4)
  """

  count: int = 0
  bytes: int = 0


def count_collectives(hlo: str | jax.stages.Compiled) -> dict[str, Collective]:
  """Counts the collectives of an HLO module, loops unrolled by their trip counts.

  A while loop's trip count is XLA's ``known_trip_count`` annotation (present
  in compiled programs), or else the bound ``c`` of a loop condition
  ``i < c`` with a constant ``c``, which assumes a counter from 0 by 1 (as
  ``lax.scan`` and ``lax.fori_loop`` lower to). Nested loops multiply. Every
  branch of a conditional counts, as if all of them ran.

  Args:
    hlo: the text of an HLO module (``compiled.as_text()``, or the
      unoptimised ``lowered.as_text(dialect="hlo")``), or a
      ``jax.stages.Compiled``.

  Returns:
    A ``Collective`` per kind in ``KINDS``.

  Raises:
    ValueError: if the text has no entry computation, or a while loop that
      contains collectives has neither a known trip count nor an ``i < c``
      condition.

  Examples:
    A compiled program without collectives:

    >>> import jax, jax.numpy as jnp, zerojax
    >>> compiled = jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile()
    >>> zerojax.count_collectives(compiled)["all-reduce"]
    Collective(count=0, bytes=0)

    An all-gather of 8 floats to 64 floats (256 bytes), in a loop of 3:

    >>> hlo = '''
    ... %body (p: f32[8]) -> f32[8] {
    ...   %p = f32[8]{0} parameter(0)
    ...   %ag = f32[64]{0} all-gather(%p), dimensions={0}
    ...   ROOT %s = f32[8]{0} slice(%ag), slice={[0:8]}
    ... }
    ...
    ... ENTRY %main (a: f32[8]) -> f32[8] {
    ...   %a = f32[8]{0} parameter(0)
    ...   ROOT %w = f32[8]{0} while(%a), body=%body, backend_config={"known_trip_count":{"n":"3"}}
    ... }
    ... '''
    >>> zerojax.count_collectives(hlo)["all-gather"]
    Collective(count=3, bytes=768)
  """
  text = hlo if isinstance(hlo, str) else hlo.as_text()
  computations, entry = _parse_module(text)
  shapes = {i.name: i.shape for body in computations.values() for i in body}

  @functools.cache
  def per_execution(name: str) -> dict[str, Collective]:
    """The collectives one execution of computation ``name`` runs, callees included."""
    totals = {kind: Collective() for kind in KINDS}
    for instruction in computations.get(name, ()):
      kind = instruction.opcode.removesuffix("-start")
      if kind in totals:
        totals[kind].count += 1
        totals[kind].bytes += _moved_bytes(instruction, shapes)
      if instruction.opcode.endswith(("-done", "-update")):
        continue  # an async op's computation counts once, at its start
      for role, callees in _CALLEES.findall(instruction.attributes):
        for callee in re.findall(r"[\w.\-]+", callees.replace("%", " ")):
          inner = per_execution(callee)
          if not any(c.count for c in inner.values()):
            continue
          times = _trip_count(instruction, computations) if role == "body" else 1
          for kind, collective in inner.items():
            totals[kind].count += times * collective.count
            totals[kind].bytes += times * collective.bytes
    return totals

  return per_execution(entry)


def _shape_bytes(shape: str) -> int:
  """Bytes of every array in an HLO shape (a tuple sums its elements).

  Sub-byte types count as packed; a dynamic dimension counts at its bound.

  Examples:
    >>> _shape_bytes("f32[4,256]{1,0}")
    4096
    >>> _shape_bytes("(f32[8]{0}, /*index=1*/bf16[2,3]{1,0}, s32[], pred[2])")
    50
    >>> _shape_bytes("s4[3]"), _shape_bytes("f8e4m3fn[<=5]"), _shape_bytes("c64[2]")
    (2, 5, 16)
  """
  total = 0
  for _, bits, dims in _ARRAY.findall(shape):
    elements = math.prod(int(d) for d in re.findall(r"\d+", dims))
    total += -(-elements * (int(bits) if bits else 8) // 8)
  return total


@dataclasses.dataclass(frozen=True)
class _Instruction:
  name: str
  shape: str
  opcode: str
  arguments: str  # the text between the opcode's parentheses
  operands: tuple[str, ...]
  attributes: str


def _closing(text: str, start: int) -> int:
  """Index just past the parenthesis that closes the one at ``text[start]``."""
  depth = 0
  for i in range(start, len(text)):
    depth += {"(": 1, ")": -1}.get(text[i], 0)
    if depth == 0:
      return i + 1
  raise ValueError(f"unbalanced parentheses in HLO: {text[start : start + 80]!r}")


def _operand_names(arguments: str) -> tuple[str, ...]:
  """The last word of each top-level comma-separated argument, without ``%``.

  Examples:
    >>> _operand_names("%a, /*index=1*/%b.1")
    ('a', 'b.1')
    >>> _operand_names("f32[8,64]{1,0} %x, (s32[], f32[2]) y")
    ('x', 'y')
  """
  arguments = re.sub(r"/\*.*?\*/", " ", arguments)
  names, depth, start = [], 0, 0
  for i, char in enumerate(arguments + ","):
    depth += (char in "([{") - (char in ")]}")
    if char == "," and depth == 0:
      argument = arguments[start:i].split()
      if argument:
        names.append(argument[-1].removeprefix("%"))
      start = i + 1
  return tuple(names)


def _parse_instruction(line: str) -> _Instruction | None:
  """One ``name = shape opcode(operands), attributes`` line, or None for anything else."""
  match = _INSTRUCTION.match(line)
  if match is None:
    return None
  name, rest = match.groups()
  shape_end = _closing(rest, 0) if rest.startswith("(") else rest.find(" ")
  opcode = _OPCODE.match(rest, shape_end)
  if opcode is None:
    return None
  args_start = opcode.end() - 1
  args_end = _closing(rest, args_start)
  arguments = rest[args_start + 1 : args_end - 1]
  return _Instruction(
    name, rest[:shape_end], opcode.group(1), arguments, _operand_names(arguments), rest[args_end:]
  )


def _parse_module(hlo: str) -> tuple[dict[str, list[_Instruction]], str]:
  """The module's computations (name to instructions) and the entry computation's name."""
  computations: dict[str, list[_Instruction]] = {}
  entry = current = None
  for line in hlo.splitlines():
    header = _COMPUTATION.match(line)
    if header is not None and not line[:1].isspace():
      current = header.group(2)
      computations[current] = []
      if header.group(1):
        entry = current
    elif current is not None and line.strip() == "}":
      current = None
    elif current is not None:
      instruction = _parse_instruction(line)
      if instruction is not None:
        computations[current].append(instruction)
  if entry is None:
    raise ValueError("no ENTRY computation in this HLO text; pass compiled.as_text().")
  return computations, entry


def _trip_count(while_op: _Instruction, computations: dict[str, list[_Instruction]]) -> int:
  """A while loop's trip count: XLA's ``known_trip_count``, else the condition's bound."""
  known = _TRIP_COUNT.search(while_op.attributes)
  if known:
    return int(known.group(1))
  condition = re.search(r"condition=%?([\w.\-]+)", while_op.attributes)
  instructions = computations.get(condition.group(1), []) if condition else []
  constants = {
    i.name: int(i.arguments)
    for i in instructions
    if i.opcode == "constant" and re.fullmatch(r"-?\d+", i.arguments)
  }
  bounds = [
    constants[i.operands[1]]
    for i in instructions
    if i.opcode == "compare" and "direction=LT" in i.attributes and i.operands[1] in constants
  ]
  if len(bounds) != 1:
    raise ValueError(
      f"cannot find the trip count of while loop {while_op.name}: it has no known_trip_count "
      "and its condition is not `i < constant`."
    )
  return bounds[0]


def _moved_bytes(instruction: _Instruction, shapes: dict[str, str]) -> int:
  """The logical size one collective works on (see ``Collective.bytes``)."""
  operand_bytes = sum(_shape_bytes(shapes[o]) for o in instruction.operands if o in shapes)
  if instruction.opcode == "all-gather":
    return _shape_bytes(instruction.shape)
  if instruction.opcode == "all-gather-start":
    return _shape_bytes(instruction.shape) - operand_bytes  # the shape is (operands, results)
  return operand_bytes
