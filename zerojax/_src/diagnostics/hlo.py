"""Communication read from HLO text: each collective's count, bytes per step and mesh axes."""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

import jax
import numpy as np

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

# An array type, e.g. ``bf16[8,64]``: (dtype, its bit width, dimensions). ``pred``
# has no width in its name; tokens have no size and do not match.
_ARRAY = re.compile(r"\b(pred|[a-z]+(\d+)\w*)\[([<=\d,]*)\]")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*)?\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
CALLEES = re.compile(
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
    >>> zerojax.diagnostics.profile(jnp.sum, x).collectives["all-reduce"]
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
    >>> zerojax.diagnostics.count_collectives(compiled)["all-reduce"]
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
    >>> zerojax.diagnostics.count_collectives(hlo)["all-gather"]
    Collective(count=3, bytes=768)
  """
  totals = _tally(text_of(hlo), lambda instruction: None)
  return {kind: totals.get((None, kind), Collective()) for kind in KINDS}


def count_collectives_by_axes(
  hlo: str | jax.stages.Compiled, mesh: jax.sharding.Mesh
) -> dict[tuple[str, ...], dict[str, Collective]]:
  """Counts the collectives of an HLO module by the mesh axes each one spans.

  A collective spans a mesh axis if one of its device groups holds devices
  at different coordinates of that axis (for a collective-permute, if a
  source and its target differ there). Groups of single devices span no
  axis, ``()``. Counts and bytes are those of ``count_collectives``, split
  by the tuple of axes spanned: summed over the tuples they give
  ``count_collectives(hlo)`` kind by kind. So under hybrid sharding over
  ``("replica", "data")``, ``("replica",)`` holds what crosses replicas and
  ``("data",)`` what stays inside a data group.

  Device groups are read in each format XLA prints: explicit lists
  (``replica_groups={{0,1},{2,3}}``, ``{}`` for all devices), iota lists
  (``replica_groups=[2,4]<=[4,2]T(1,0)``), mesh axes
  (``replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}``, with
  ``device_ids=(...)`` and sub-axes such as ``'axis_0':(2)2``), and
  ``source_target_pairs={{0,1},...}``. The numbers in them are positions in
  the program's list of devices: for a ``jax.stages.Compiled`` that list is
  read from the executable and matched to ``mesh`` by device id; for HLO
  text it is taken to be ``mesh.devices.flat``, the order ``jax.jit`` gives
  a program over ``mesh``.

  Args:
    hlo: the text of an HLO module or a ``jax.stages.Compiled``, as for
      ``count_collectives``.
    mesh: the mesh whose axes to report, normally the one the program was
      compiled over.

  Returns:
    For each tuple of axis names (in ``mesh.axis_names`` order) that some
    collective spans, a ``Collective`` per kind in ``KINDS``.

  Raises:
    ValueError: for what ``count_collectives`` rejects; if ``mesh`` is not a
      ``jax.sharding.Mesh``; if the program runs on a different number of
      devices than ``mesh`` has, or on devices outside it; or if a
      collective's device groups are in a format this function cannot read.

  Examples:
    Under hybrid sharding, a sum inside each data group and a gather across
    replicas:

    >>> import jax, jax.numpy as jnp, zerojax
    >>> mesh = jax.make_mesh((2, 4), ("replica", "data"))
    >>> def f(x):  # this device's float32[1, 2] block
    ...   x = jax.lax.psum(x, "data")
    ...   return jax.lax.all_gather(x, "replica", tiled=True)
    >>> spec = jax.P("replica", "data")
    >>> f = jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=jax.P("replica"))
    >>> x = jax.device_put(jnp.ones((2, 8)), jax.NamedSharding(mesh, spec))
    >>> compiled = jax.jit(f).lower(x).compile()
    >>> by_axes = zerojax.diagnostics.count_collectives_by_axes(compiled, mesh)
    >>> list(by_axes)
    [('replica',), ('data',)]
    >>> by_axes[("data",)]["all-reduce"], by_axes[("replica",)]["all-gather"]
    (Collective(count=1, bytes=8), Collective(count=1, bytes=16))

    The same from HLO text, with groups as an iota list: ``[2,4]<=[8]`` is
    ``{{0,1,2,3},{4,5,6,7}}``, each group a row of the mesh:

    >>> hlo = '''
    ... ENTRY %main (a: f32[8]) -> f32[8] {
    ...   %a = f32[8]{0} parameter(0)
    ...   ROOT %r = f32[8]{0} all-reduce(%a), replica_groups=[2,4]<=[8], to_apply=%add
    ... }
    ... '''
    >>> zerojax.diagnostics.count_collectives_by_axes(hlo, mesh)[("data",)]["all-reduce"]
    Collective(count=1, bytes=32)
  """
  if not isinstance(mesh, jax.sharding.Mesh):
    raise ValueError(
      f"mesh must be a jax.sharding.Mesh with devices, got {type(mesh).__name__}; pass the "
      "mesh the program was compiled over."
    )
  text = text_of(hlo)
  coordinates = _device_coordinates(hlo, text, mesh)

  def spanned_axes(instruction: _Instruction) -> tuple[int, ...]:
    spanned: set[int] = set()
    for group in _device_groups(instruction, len(coordinates)):
      group_coordinates = coordinates[list(group)]
      spanned.update(np.flatnonzero((group_coordinates != group_coordinates[0]).any(axis=0)))
    return tuple(sorted(int(axis) for axis in spanned))

  totals = _tally(text, spanned_axes)
  return {
    tuple(mesh.axis_names[axis] for axis in axes): {
      kind: totals.get((axes, kind), Collective()) for kind in KINDS
    }
    for axes in sorted({axes for axes, _ in totals})
  }


#: How many times a chip's part a transfer across slices sends: an all-gather's result holds
#: every slice's part, an all-reduce is a reduce-scatter and an all-gather.
_ACROSS_SLICES = {"ALL_GATHER": None, "ALL_REDUCE": 2}


def count_across_slices(hlo: str | jax.stages.Compiled, slices: int) -> dict[str, int]:
  """Bytes each chip sends to other slices in one step, by transfer kind, loops unrolled.

  Compiled for several TPU slices, XLA:TPU's program is one slice's, and each
  collective across slices is a host-transfer ``send`` / ``recv`` pair marked
  ``_xla_megascale_transfer_type`` (``ALL_GATHER``, ``REDUCE_SCATTER``,
  ``ALL_REDUCE``, ``ALL_TO_ALL``, ``ONE_TO_ONE``), which the collective
  counters do not see. Each ``send`` carries one chip's part: an all-gather
  counts it once per slice (its result, as ``count_collectives`` counts an
  all-gather), an all-reduce twice, the others once; a send in a loop once
  per trip.

  Args:
    hlo: a program compiled for several slices, or its text.
    slices: how many slices it was compiled for.

  Returns:
    Bytes per step by transfer kind; empty for a program of one slice.

  Example:
    One all-reduce across two slices of a chip's 1024 bfloat16 values:

    >>> send = ("  %s = (bf16[1024]{0}, u32[], token[]) send(%a, %t), channel_id=1, "
    ...         'frontend_attributes={_xla_megascale_transfer_type="ALL_REDUCE"}')
    >>> hlo = "\\n".join([
    ...   "ENTRY %main (a: bf16[1024]) -> bf16[1024] {",
    ...   "  %a = bf16[1024]{0} parameter(0)",
    ...   "  %t = token[] after-all()",
    ...   send,
    ...   "  ROOT %c = bf16[1024]{0} copy(%a)",
    ...   "}",
    ... ])
    >>> count_across_slices(hlo, slices=2)
    {'ALL_REDUCE': 4096}
  """

  def sends(instruction: _Instruction, shapes: dict[str, str]) -> Iterator[tuple[str, int]]:
    kind = re.search(r'_xla_megascale_transfer_type="(\w+)"', instruction.attributes)
    array = _ARRAY.search(instruction.shape)
    if instruction.opcode == "send" and kind is not None and array is not None:
      times = _ACROSS_SLICES.get(kind.group(1), 1) or slices
      yield kind.group(1), _shape_bytes(array.group(0)) * times

  return {kind: sent.bytes for kind, sent in _unrolled(text_of(hlo), sends).items()}


def text_of(hlo: str | jax.stages.Compiled) -> str:
  """The HLO text of a compiled program (or ``hlo`` itself, given text).

  Raises:
    TypeError: for a function or a lowered program, which has no compiled HLO yet.
  """
  if isinstance(hlo, jax.stages.Lowered) or not isinstance(hlo, str | jax.stages.Compiled):
    what = "a lowered program" if isinstance(hlo, jax.stages.Lowered) else type(hlo).__name__
    raise TypeError(
      f"the collectives are read from a compiled program, got {what}: pass "
      "jax.jit(step).lower(*args).compile() (or its as_text()): the collectives are what the "
      "compiler inserts, which a function or a lowered program does not hold yet."
    )
  text = hlo if isinstance(hlo, str) else hlo.as_text()
  if text is None:
    raise ValueError("this compiled program has no HLO text to read; pass compiled.as_text().")
  return text


def _tally(text: str, label: Callable[[_Instruction], Hashable]) -> dict[tuple, Collective]:
  """Totals of the module's collectives per ``(label(instruction), kind)``, loops unrolled.

  The walk that both public counters share: see ``count_collectives`` for how
  loops, conditionals, asynchronous pairs and bytes count.
  """

  def collectives(instruction: _Instruction, shapes: dict[str, str]) -> Iterator[tuple]:
    kind = instruction.opcode.removesuffix("-start")
    if kind in KINDS:
      yield (label(instruction), kind), _moved_bytes(instruction, shapes)

  return _unrolled(text, collectives)


def _unrolled(
  text: str, found_in: Callable[[_Instruction, dict[str, str]], Iterable[tuple[Hashable, int]]]
) -> dict[Any, Collective]:
  """Per key, how many times one step runs what ``found_in`` finds, and its bytes, loops unrolled.

  ``found_in(instruction, shapes)`` yields ``(key, bytes)`` for each thing an
  instruction does that is counted; a computation counts once per call, a
  loop body once per trip, an asynchronous op's computation once, at its start.
  """
  computations, entry = parse_module(text)
  shapes = {i.name: i.shape for body in computations.values() for i in body}

  @functools.cache
  def per_execution(name: str) -> dict[Any, Collective]:
    """What one execution of computation ``name`` runs, callees included."""
    totals: dict[Any, Collective] = collections.defaultdict(Collective)
    for instruction in computations.get(name, ()):
      for key, moved in found_in(instruction, shapes):
        totals[key].count += 1
        totals[key].bytes += moved
      if instruction.opcode.endswith(("-done", "-update")):
        continue  # an async op's computation counts once, at its start
      for role, callees in CALLEES.findall(instruction.attributes):
        for callee in re.findall(r"[\w.\-]+", callees.replace("%", " ")):
          inner = per_execution(callee)
          if not any(c.count for c in inner.values()):
            continue
          times = trip_count(instruction, computations) if role == "body" else 1
          for key, counted in inner.items():
            totals[key].count += times * counted.count
            totals[key].bytes += times * counted.bytes
    return dict(totals)

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


def parse_module(hlo: str) -> tuple[dict[str, list[_Instruction]], str]:
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


def trip_count(while_op: _Instruction, computations: dict[str, list[_Instruction]]) -> int:
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


def executions(computations: dict[str, list[_Instruction]], entry: str) -> dict[str, int]:
  """How many times one run of ``entry`` runs each computation it reaches.

  A loop body runs its loop's ``trip_count`` times per run of the loop (nested
  loops multiply); every other callee (fusions, branches, reducers) runs as
  often as its caller; loop conditions are left out.
  """
  counts: dict[str, int] = {}

  def visit(name: str, times: int) -> None:
    counts[name] = counts.get(name, 0) + times
    for instruction in computations.get(name, ()):
      if instruction.opcode.endswith(("-done", "-update")):
        continue  # an asynchronous op's computation runs once, from its start
      for role, callees in CALLEES.findall(instruction.attributes):
        if role == "condition":
          continue
        inner = times * trip_count(instruction, computations) if role == "body" else times
        for callee in re.findall(r"[\w.\-]+", callees.replace("%", " ")):
          visit(callee, inner)

  visit(entry, 1)
  return counts


def _moved_bytes(instruction: _Instruction, shapes: dict[str, str]) -> int:
  """The logical size one collective works on (see ``Collective.bytes``)."""
  operand_bytes = sum(_shape_bytes(shapes[o]) for o in instruction.operands if o in shapes)
  if instruction.opcode == "all-gather":
    return _shape_bytes(instruction.shape)
  if instruction.opcode == "all-gather-start":
    return _shape_bytes(instruction.shape) - operand_bytes  # the shape is (operands, results)
  return operand_bytes


def _device_coordinates(
  hlo: str | jax.stages.Compiled, text: str, mesh: jax.sharding.Mesh
) -> np.ndarray:
  """The mesh coordinates of the device at each position of the program's device list.

  Row ``i`` holds the coordinates (one per mesh axis) of the device that the
  number ``i`` in the HLO's device groups stands for.
  """
  header = re.search(r"^HloModule\b.*$", text, re.MULTILINE)
  program_devices = 1
  for field in ("num_partitions", "replica_count"):
    found = re.search(rf"\b{field}=(\d+)", header.group(0) if header else "")
    program_devices *= int(found.group(1)) if found else 1
  if program_devices > 1 and program_devices != mesh.size:
    raise ValueError(
      f"the program runs on {program_devices} devices but the mesh has {mesh.size} "
      f"({dict(mesh.shape)}); pass the mesh the program was compiled over."
    )
  positions = {device.id: position for position, device in enumerate(mesh.devices.flat)}
  order = list(range(mesh.size))
  executable = None if isinstance(hlo, str) else hlo.runtime_executable()
  if executable is not None:
    devices = executable.local_devices()
    if len(devices) == mesh.size:  # one process sees them all: use the program's own order
      outside = sorted(d.id for d in devices if d.id not in positions)
      if outside:
        raise ValueError(
          f"the program runs on devices {outside} that are not in the mesh; pass the mesh the "
          "program was compiled over."
        )
      order = [positions[device.id] for device in devices]
  return np.stack(np.unravel_index(order, mesh.devices.shape), axis=-1)


_EXPLICIT_GROUPS = re.compile(
  r"(?:replica_groups|source_target_pairs)=\{((?:\s*\{[\d,\s]*\},?)*)\s*\}"
)
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH_GROUPS = re.compile(
  r"replica_groups=mesh\[([^\]]*)\]"
  r"(?:,\s*device_ids=\((\[[\d,]+\](?:T\([\d,]+\))?|[\d,\s]+)\))?\s*\{([^}]*)\}"
)


def _device_groups(instruction: _Instruction, num_devices: int) -> list[tuple[int, ...]]:
  """The groups of device positions a collective runs over (a permute's pairs are groups).

  Examples:
    >>> def groups(attributes, opcode="all-reduce"):
    ...   return _device_groups(_Instruction("c", "f32[8]", opcode, "", (), attributes), 8)
    >>> groups(", replica_groups={{0,2},{1,3}}, to_apply=%add")
    [(0, 2), (1, 3)]
    >>> groups(", replica_groups={}, to_apply=%add")
    [(0, 1, 2, 3, 4, 5, 6, 7)]
    >>> groups(", replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add")
    [(0, 4), (1, 5), (2, 6), (3, 7)]
    >>> groups(", replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, to_apply=%add")
    [(0, 4), (1, 5), (2, 6), (3, 7)]
    >>> groups(", replica_groups=mesh['a'=4,'b'=2], device_ids=([2,2,2]T(0,2,1)) {'a':(2)2}")
    [(0, 1), (2, 3), (4, 5), (6, 7)]
    >>> groups(", source_target_pairs={{0,1},{1,0}}", "collective-permute")
    [(0, 1), (1, 0)]
  """
  attributes = instruction.attributes
  if explicit := _EXPLICIT_GROUPS.search(attributes):
    groups = [
      tuple(int(i) for i in re.findall(r"\d+", group))
      for group in re.findall(r"\{([^}]*)\}", explicit.group(1))
    ]
    if not groups and explicit.group(0).startswith("replica_groups"):
      groups = [tuple(range(num_devices))]  # {}: all devices in one group
  elif iota := _IOTA_GROUPS.search(attributes):
    num_groups, group_size, dims, perm = iota.groups()
    ids = _iota(dims, perm)
    if ids.size != int(num_groups) * int(group_size):
      raise ValueError(f"{iota.group(0)!r}: [{dims}] does not hold {num_groups}x{group_size} ids.")
    groups = [tuple(group) for group in ids.reshape(int(num_groups), int(group_size)).tolist()]
  elif mesh_axes := _MESH_GROUPS.search(attributes):
    groups = _mesh_axes_groups(*mesh_axes.groups())
  elif "replica_groups=" in attributes or "source_target_pairs=" in attributes:
    raise ValueError(
      f"cannot read the device groups of {instruction.opcode} {instruction.name}: "
      f"{attributes.strip(', ')[:200]!r} is in none of the formats zerojax reads "
      "({{0,1},...}, [2,4]<=[8]T(...), mesh[...] {...}); please report it with this HLO line."
    )
  elif instruction.opcode.startswith("collective-permute"):
    raise ValueError(f"{instruction.opcode} {instruction.name} has no source_target_pairs.")
  else:
    groups = [tuple(range(num_devices))]  # no replica_groups: all devices in one group
  outside = sorted({i for group in groups for i in group if i >= num_devices})
  if outside:
    raise ValueError(
      f"{instruction.opcode} {instruction.name} names devices {outside}, but the mesh has "
      f"{num_devices}; pass the mesh the program was compiled over."
    )
  return groups


def _iota(dims: str, perm: str | None) -> np.ndarray:
  """XLA's iota device list ``[dims]T(perm)``: ``arange`` reshaped to ``dims``, transposed."""
  shape = [int(d) for d in dims.split(",")]
  order = [int(p) for p in perm.split(",")] if perm else list(range(len(shape)))
  if sorted(order) != list(range(len(shape))):
    raise ValueError(f"[{dims}]T({perm}) is not an iota device list: T() must permute its dims.")
  return np.arange(math.prod(shape)).reshape(shape).transpose(order)


def _mesh_axes_groups(axes: str, device_ids: str | None, grouped: str) -> list[tuple[int, ...]]:
  """Groups of ``mesh[axes], device_ids=(...) {grouped}``: devices that differ only in ``grouped``.

  A grouped axis is a whole mesh axis (``'a'``) or a sub-axis ``'a':(pre)size``,
  the factor of size ``size`` after the major factors of product ``pre``.
  """
  sizes = {}
  for name, size in re.findall(r"'?([^'=,\s]+)'?\s*=\s*(\d+)", axes):
    sizes[name] = int(size)
  if not sizes:
    raise ValueError(f"cannot read the mesh axes of replica_groups=mesh[{axes}].")
  if device_ids is None:
    ids = np.arange(math.prod(sizes.values()))
  elif device_ids.startswith("["):
    dims, _, perm = device_ids[1:].partition("]")
    ids = _iota(dims, perm.removeprefix("T(").removesuffix(")") or None)
  else:
    ids = np.array([int(i) for i in device_ids.split(",")])
  if ids.size != math.prod(sizes.values()):
    raise ValueError(
      f"mesh[{axes}] has {math.prod(sizes.values())} devices, device_ids {ids.size}."
    )
  sub_axes = collections.defaultdict(list)  # mesh axis -> (pre, size) of its grouped parts
  for name, pre, size in re.findall(r"'?([^':,\s]+)'?(?::\((\d+)\)(\d+))?", grouped):
    if name not in sizes:
      raise ValueError(f"replica_groups names axis {name!r}, which mesh[{axes}] does not have.")
    sub_axes[name].append((int(pre), int(size)) if pre else (1, sizes[name]))
  factors, is_grouped = [], []  # each mesh axis split into factors, major to minor
  for name, full in sizes.items():
    prefix = 1
    for pre, size in sorted(sub_axes[name]):
      if pre < prefix or pre % prefix or full % (pre * size):
        raise ValueError(f"sub-axis {name}:({pre}){size} does not divide axis {name}={full}.")
      if pre > prefix:
        factors.append(pre // prefix)
        is_grouped.append(False)
      factors.append(size)
      is_grouped.append(True)
      prefix = pre * size
    if prefix < full:
      factors.append(full // prefix)
      is_grouped.append(False)
  order = sorted(range(len(factors)), key=is_grouped.__getitem__)  # grouped factors last
  group_size = math.prod(f for f, g in zip(factors, is_grouped, strict=True) if g)
  blocks = ids.reshape(factors).transpose(order).reshape(-1, group_size)
  return [tuple(group) for group in blocks.tolist()]
