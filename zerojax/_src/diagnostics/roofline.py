"""A roofline estimate of a compiled step's time, from its HLO and a chip's published peaks.

``program_cost`` counts what one step of a compiled program does: the flops of
its matmuls and convolutions, and the bytes its instructions read from and
write to HBM, each computation weighted by how many times a step runs it (a
layer scan's body by its trip count). ``compiled.cost_analysis()`` cannot
serve here: it counts a while loop's body once, whatever its trip count.
``roofline`` divides those counts, and the collective bytes the caller
passes, by a ``Chip``'s peaks. The result is an estimate, not a measurement:
XLA:TPU prints no time estimate of its own, and this is what stands in for one.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Collection

import jax
import numpy as np

from zerojax._src.diagnostics import deviceless
from zerojax._src.diagnostics import hlo as hlo_lib


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator's published peaks, per device.

  Attributes:
    name: the chip.
    bfloat16_flops: peak dense matmul FLOP/s in bfloat16.
    float32_flops: the FLOP/s of a float32 matmul as XLA runs it by default.
    hbm_bytes_per_second: HBM bandwidth.
    within_bytes_per_second: what one device can send at once over the links
      inside its node or slice (NVLink, ICI), one direction, all links summed.
    across_bytes_per_second: what one device can send at once to other nodes
      or slices (InfiniBand, the data-center network), one direction.

  Example:
    >>> from zerojax.diagnostics import chip
    >>> v5e = chip("v5e-8")
    >>> v5e.name, v5e.bfloat16_flops / 1e12, v5e.hbm_bytes_per_second / 1e9
    ('TPU v5e', 197.0, 819.0)
  """

  name: str
  bfloat16_flops: float
  float32_flops: float
  hbm_bytes_per_second: float
  within_bytes_per_second: float
  across_bytes_per_second: float


H100_SXM = Chip(
  "H100 SXM",
  # NVIDIA H100 datasheet, SXM: BF16 Tensor Core 1,979 TFLOPS with sparsity, 989.4 dense.
  bfloat16_flops=989.4e12,
  # The same datasheet: TF32 Tensor Core 989 TFLOPS with sparsity, 494.7 dense. XLA:GPU runs a
  # default-precision float32 dot as TF32; the CUDA-core FP32 peak (66.9 TFLOPS) applies only
  # to precision=HIGHEST, which this estimate does not read.
  float32_flops=494.7e12,
  # The datasheet: 3.35 TB/s of HBM3.
  hbm_bytes_per_second=3.35e12,
  # NVLink 4: 900 GB/s per GPU in both directions together, 450 GB/s each way.
  within_bytes_per_second=450e9,
  # One 400 Gb/s InfiniBand NDR adapter per GPU (DGX H100): 50 GB/s each way.
  across_bytes_per_second=400e9 / 8,
)

TPU_V5E = Chip(
  "TPU v5e",
  # cloud.google.com/tpu/docs/v5e: "Peak compute per chip (bf16) 197 TFLOPs" (Int8: 393 TOPs).
  bfloat16_flops=197e12,
  # Not published. Derived: XLA:TPU runs a default-precision float32 dot as one bfloat16 pass
  # of the MXUs (its operands rounded to bfloat16), so at the bfloat16 rate; precision=HIGHEST
  # takes several passes, which this estimate does not read.
  float32_flops=197e12,
  # The same page: "HBM2 capacity and bandwidth 16 GB, 819 GBps".
  hbm_bytes_per_second=819e9,
  # The same page: "Interchip Interconnect BW 1600 Gbps" (elsewhere "bidirectional ICI bandwidth
  # per chip 400 GBps", 4 ports): 200 GB/s each way.
  within_bytes_per_second=1600e9 / 8,
  # The same page: "Per-host NIC configuration 2 x 100 Gbps" for 8 chips a host, and 6.4 Tbps
  # of data-center network for a 256-chip pod: both 25 Gb/s a chip.
  across_bytes_per_second=2 * 100e9 / 8 / 8,
)


def chip(target: str | deviceless.DevicelessTarget) -> Chip:
  """The chip a deviceless target is made of.

  Args:
    target: one of ``DEVICELESS_TARGETS`` (``"h100x8"`` ... ``"h100x128"``,
      ``"v5e-8"``, ``"2xv5e-16"``, ...) or a ``DevicelessTarget``.

  Returns:
    ``H100_SXM`` for the H100 nodes, ``TPU_V5E`` for the v5e slices.

  Raises:
    ValueError: for a target zerojax does not know, or one made of a chip
      whose peaks it has not recorded.

  Example:
    >>> from zerojax.diagnostics import chip
    >>> chip("h100x16").name, chip("2xv5e-16").name
    ('H100 SXM', 'TPU v5e')
  """
  found = deviceless.find_target(target)
  if found.platform == "cuda" and found.description == "h100_sxm.txtpb":
    return H100_SXM
  if found.platform == "tpu" and found.topology.startswith("v5e:"):
    return TPU_V5E
  raise ValueError(f"no published peaks recorded for {found.name}'s chip; pass a Chip.")


@dataclasses.dataclass(frozen=True)
class Cost:
  """What one step of a compiled program does, loops counted as many times as they run.

  Attributes:
    flops_by_dtype: floating-point operations of the matmuls (``dot``, and
      XLA:GPU's cuBLAS calls) and convolutions, by the type they multiply
      in: ``"f32"`` if an operand is float32 (or wider), else the left
      operand's type (``"bf16"``, ...).
      Elementwise operations and reductions are not counted: they run on
      vector units, off the matmul peak, and are few beside a layer's matmuls.
    bytes: an estimate of the HBM traffic: for each instruction outside
      fusions, the bytes of its operands and of its result (a fusion's
      internals stay on chip), a slice or an in-place update counting only
      the part it reads or writes; arrays in XLA's alternate memory space
      (``S(1)``, on chip on TPUs) are not counted.

  Example:
    >>> from zerojax.diagnostics import Cost
    >>> Cost({"bf16": 6e12, "f32": 1e12}, bytes=4e9).flops
    7000000000000.0
  """

  flops_by_dtype: dict[str, float]
  bytes: float

  @property
  def flops(self) -> float:
    """The matmul and convolution flops of every type together."""
    return float(sum(self.flops_by_dtype.values()))


def program_cost(hlo: str | jax.stages.Compiled, only: Collection[str] | None = None) -> Cost:
  """The flops and HBM bytes of one step of a compiled program, loops unrolled.

  Each computation counts as many times as one step runs it: a while loop's
  body its trip count times (XLA's ``known_trip_count``, else the bound of an
  ``i < constant`` condition, as for ``count_collectives``), a fusion as
  often as the computation that holds it. ``compiled.cost_analysis()``
  counts a loop's body once, so it undercounts a layer scan by its length.

  A ``dot`` (or an XLA:GPU cuBLAS ``custom-call``) counts 2 x its output's
  elements x the product of its contracting dimensions; a ``convolution``
  2 x its output's elements x its kernel's elements per output feature.
  See ``Cost`` for the bytes.

  Args:
    hlo: a ``jax.stages.Compiled`` or its ``as_text()``.
    only: count only these computations (by name, with what they call), as
      often as a step runs them: the loop bodies XLA:GPU's scheduler left
      out of its estimate (``StepEstimate.silent``), say. ``None``: all.

  Returns:
    The ``Cost`` of one step, per device.

  Raises:
    ValueError: if the text has no entry computation, or a while loop with
      neither a known trip count nor an ``i < constant`` condition.

  Examples:
    Four matmuls of 8 x 64 by 64 x 64 in a scan, each 2 x 8 x 64 x 64 flops:

    >>> import jax, jax.numpy as jnp, zerojax
    >>> def f(x, ws):
    ...   return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, ws)[0]
    >>> compiled = jax.jit(f).lower(jnp.ones((8, 64)), jnp.ones((4, 64, 64))).compile()
    >>> zerojax.diagnostics.program_cost(compiled).flops_by_dtype
    {'f32': 262144.0}

    From HLO text, a bfloat16 matmul run 3 times:

    >>> hlo = '''
    ... %b (p: bf16[8,16]) -> bf16[8,16] {
    ...   %p = bf16[8,16]{1,0} parameter(0)
    ...   %c = bf16[16,16]{1,0} constant({...})
    ...   ROOT %d = bf16[8,16]{1,0} dot(%p, %c), lhs_contracting_dims={1}, rhs_contracting_dims={0}
    ... }
    ...
    ... ENTRY %main (a: bf16[8,16]) -> bf16[8,16] {
    ...   %a = bf16[8,16]{1,0} parameter(0)
    ...   ROOT %w = bf16[8,16] while(%a), body=%b, backend_config={"known_trip_count":{"n":"3"}}
    ... }
    ... '''
    >>> cost = zerojax.diagnostics.program_cost(hlo)
    >>> cost.flops_by_dtype, cost.bytes  # 3 x 2*8*16*16; 3 x (256 + 512 + 256)
    ({'bf16': 12288.0}, 3072.0)
  """
  computations, entry = hlo_lib.parse_module(hlo_lib.text_of(hlo))
  program = _Program(computations)
  counts = hlo_lib.executions(computations, entry)
  if only is not None:
    counts = {name: counts[name] for name in _reached(computations, only) if name in counts}
  flops: dict[str, float] = {}
  hbm_bytes = 0.0
  for name in _control_flow(computations, entry) & counts.keys():
    hbm_bytes += counts.get(name, 0) * sum(map(program.bytes, computations.get(name, ())))
  for name, times in counts.items():
    for instruction in computations.get(name, ()):
      if instruction.opcode in ("dot", "convolution") or _is_gemm(instruction):
        dtype = program.multiply_type(instruction)
        flops[dtype] = flops.get(dtype, 0.0) + times * program.flops(instruction)
  return Cost(dict(sorted(flops.items())), hbm_bytes)


@dataclasses.dataclass(frozen=True)
class Roofline:
  """A lower bound of a step's time: each unit's busy time at its published peak.

  ``step_seconds`` is the largest of the four: the step if compute, HBM and
  both kinds of links all ran at their peaks at once, overlapping perfectly.
  A real step takes longer (kernels below peak, collectives waiting on
  compute, launch and latency costs). An estimate from published numbers,
  not a measurement: compare setups with it, and call it a roofline estimate.

  Attributes:
    chip: the peaks it divides by.
    cost: the program's flops and HBM bytes.
    compute_seconds: each type's matmul flops at its peak (``Chip``).
    memory_seconds: ``cost.bytes`` at the HBM bandwidth.
    within_seconds: the collective bytes inside a node or slice at the
      link bandwidth (``Chip.within_bytes_per_second``).
    across_seconds: the collective bytes across nodes or slices at the
      network bandwidth.

  Example:
    >>> from zerojax.diagnostics import Cost, Roofline, chip
    >>> estimate = Roofline(chip("v5e-8"), Cost({}, 0.0), 2.0, 1.0, 3.0, 0.5)
    >>> estimate.step_seconds, estimate.bound
    (3.0, 'within')
  """

  chip: Chip
  cost: Cost
  compute_seconds: float
  memory_seconds: float
  within_seconds: float
  across_seconds: float

  @property
  def step_seconds(self) -> float:
    """The busiest unit's seconds, a lower bound of the step's time."""
    return max(self.compute_seconds, self.memory_seconds, self.within_seconds, self.across_seconds)

  @property
  def bound(self) -> str:
    """The busiest unit, ``"compute"``, ``"memory"``, ``"within"`` or ``"across"``."""
    seconds = {
      "compute": self.compute_seconds,
      "memory": self.memory_seconds,
      "within": self.within_seconds,
      "across": self.across_seconds,
    }
    return max(seconds, key=seconds.__getitem__)


def roofline(
  hlo: str | jax.stages.Compiled,
  target: str | deviceless.DevicelessTarget | Chip,
  collective_bytes_within: float = 0.0,
  collective_bytes_across: float = 0.0,
  *,
  only: Collection[str] | None = None,
) -> Roofline:
  """A roofline estimate of one step of a compiled program on ``target``'s chips.

  A lower bound of the step's time from published peaks (see ``Roofline``),
  for where the compiler gives no estimate of its own (XLA:TPU). Per device:
  the program's matmul flops (``program_cost``) at the chip's bfloat16 peak,
  or its float32 rate for float32 matmuls; its HBM bytes at the HBM
  bandwidth; and the collective bytes at the link bandwidths.

  Args:
    hlo: a ``jax.stages.Compiled`` (compiled for ``target``) or its ``as_text()``.
    target: one of ``DEVICELESS_TARGETS``, a ``DevicelessTarget``, or a ``Chip``.
    collective_bytes_within: the bytes each device sends per step over the
      links inside its node or slice. A ring all-gather or reduce-scatter of
      an array of ``n`` bytes over ``d`` devices sends ``n * (d - 1) / d``
      (``count_collectives`` reports ``n``), an all-reduce twice that.
    collective_bytes_across: the same over the links between nodes or slices.
    only: as for ``program_cost``: the computations to count.

  Returns:
    The ``Roofline``.

  Raises:
    ValueError: what ``program_cost`` and ``chip`` reject.

  Example:
    A 4096 x 4096 float32 matmul (compiled here for the CPU) on a v5e:
    137 Gflop, which XLA:TPU runs at the bfloat16 rate, and 201 MB of HBM:

    >>> import jax, jax.numpy as jnp, zerojax
    >>> x = jnp.ones((4096, 4096))
    >>> compiled = jax.jit(jnp.matmul).lower(x, x).compile()
    >>> estimate = zerojax.diagnostics.roofline(compiled, "v5e-8", collective_bytes_within=50e6)
    >>> estimate.bound, round(estimate.step_seconds * 1e3, 3)  # milliseconds
    ('compute', 0.698)
    >>> round(estimate.memory_seconds * 1e3, 3), round(estimate.within_seconds * 1e3, 3)
    (0.246, 0.25)
  """
  peaks = target if isinstance(target, Chip) else chip(target)
  cost = program_cost(hlo, only)
  compute = sum(
    flops / (peaks.float32_flops if dtype in _FLOAT32_RATE else peaks.bfloat16_flops)
    for dtype, flops in cost.flops_by_dtype.items()
  )
  return Roofline(
    peaks,
    cost,
    compute_seconds=compute,
    memory_seconds=cost.bytes / peaks.hbm_bytes_per_second,
    within_seconds=collective_bytes_within / peaks.within_bytes_per_second,
    across_seconds=collective_bytes_across / peaks.across_bytes_per_second,
  )


#: Types whose matmuls run at ``Chip.float32_flops``; the others run at the bfloat16 peak.
_FLOAT32_RATE = ("f32", "f64", "c64", "c128")
#: Instructions that touch no HBM themselves: bookkeeping, or a computation counted on its own.
_NO_TRAFFIC = frozenset(
  {
    "parameter",
    "constant",
    "tuple",
    "get-tuple-element",
    "bitcast",
    "while",
    "conditional",
    "call",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
    "add-dependency",
    "domain",
  }
)
#: One array of an HLO shape, with its layout: (type, bit width, dimensions, layout).
_ARRAY = re.compile(r"\b(pred|[a-z]+(\d+)\w*)\[([<=\d,]*)\](\{[^}]*\})?")
#: The cuBLAS matmuls XLA:GPU calls, with a dot's dimension numbers in their backend config.
_GEMM = re.compile(r'custom_call_target="__cublas\$(gemm|lt\$matmul)"')
#: The memory space of XLA's memory-space assignment's alternate memory (on chip on TPUs).
_ON_CHIP = re.compile(r"S\(1\)")


def _hbm_bytes(shape: str) -> int:
  """Bytes of the arrays of ``shape`` that live in HBM (a tuple sums its elements).

  Examples:
    >>> _hbm_bytes("(f32[2,128]{1,0:T(8,128)}, bf16[128]{0:T(128)(2,1)S(1)}, pred[3])")
    1027
  """
  total = 0
  for _, bits, dims, layout in _ARRAY.findall(shape):
    if not _ON_CHIP.search(layout):
      elements = math.prod(int(d) for d in re.findall(r"\d+", dims))
      total += -(-elements * (int(bits) if bits else 8) // 8)
  return total


def _is_gemm(instruction: hlo_lib._Instruction) -> bool:
  """Whether an instruction is XLA:GPU's call of a cuBLAS matmul (Triton's are fused ``dot`` s)."""
  return instruction.opcode == "custom-call" and bool(_GEMM.search(instruction.attributes))


def _convolution_flops(
  instruction: hlo_lib._Instruction, lhs: list[int], kernel: list[int], output: list[int]
) -> float:
  """2 x the multiply-adds of a convolution: for each output element, its kernel's input
  features times the window taps that land on the input rather than on padding or between
  dilated elements. XLA:TPU writes a ``dot_general`` 's batch dimensions as a window that
  meets the input once per output element (``window={size=16 pad=15_15 rhs_reversal=1}``,
  ``window={size=8 stride=7 lhs_dilate=8}``), which a count of every tap overstates by the
  window's size.

  Example:
    A batched matmul as XLA:TPU writes it: 16 batches of (2048 x 1024) @ (1024 x 128).

    >>> line = ("%c = bf16[2048,16,128]{2,0,1} convolution(%a, %b), "
    ...         "window={size=16 pad=15_15 rhs_reversal=1}, dim_labels=bf0_0oi->b0f")
    >>> c = hlo_lib._parse_instruction(line)
    >>> _convolution_flops(c, [2048, 1024, 1], [16, 128, 1024], [2048, 16, 128]) / 1e9
    8.589934592
  """
  labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", instruction.attributes)
  if labels is None:
    raise ValueError(f"convolution {instruction.name} has no dim_labels: {instruction.attributes}")
  lhs_labels, kernel_labels, output_labels = labels.groups()
  window = re.search(r"window=\{([^}]*)\}", instruction.attributes)
  fields = dict(re.findall(r"(\w+)=(\S+)", window.group(1))) if window else {}
  spatial = sorted(c for c in output_labels if c.isdigit())
  per_dim = lambda name, default: (
    [int(v) for v in fields[name].split("x")] if name in fields else [default] * len(spatial)
  )
  sizes, strides = per_dim("size", 1), per_dim("stride", 1)
  lhs_dilation, rhs_dilation = per_dim("lhs_dilate", 1), per_dim("rhs_dilate", 1)
  pads = (
    [tuple(map(int, p.split("_"))) for p in fields["pad"].split("x")]
    if "pad" in fields
    else ([(0, 0)] * len(spatial))
  )
  taps = 1
  for k, digit in enumerate(spatial):
    n, out = lhs[lhs_labels.index(digit)], output[output_labels.index(digit)]
    place = (
      np.arange(out)[:, None] * strides[k]
      + np.arange(sizes[k])[None, :] * rhs_dilation[k]
      - pads[k][0]
    )
    on_input = (place >= 0) & (place <= (n - 1) * lhs_dilation[k]) & (place % lhs_dilation[k] == 0)
    taps *= int(on_input.sum())
  others = math.prod(output) // max(math.prod(output[output_labels.index(d)] for d in spatial), 1)
  return 2.0 * others * kernel[kernel_labels.index("i")] * taps


def _dimensions(shape: str) -> list[int]:
  """The dimensions of an array shape: ``"f32[8,16]{1,0}"`` -> ``[8, 16]``."""
  found = _ARRAY.search(shape)
  return [int(d) for d in re.findall(r"\d+", found.group(3))] if found else []


def _reached(computations, names: Collection[str]) -> set[str]:
  """``names`` and every computation they call, directly or not."""
  found: set[str] = set()
  todo = list(names)
  while todo:
    name = todo.pop()
    if name not in found:
      found.add(name)
      for instruction in computations.get(name, ()):
        for _, callees in hlo_lib.CALLEES.findall(instruction.attributes):
          todo += re.findall(r"[\w.\-]+", callees.replace("%", " "))
  return found


def _control_flow(computations, entry: str) -> set[str]:
  """The computations whose instructions read and write HBM: the entry, loop bodies, branches.

  Fusions' computations run on chip, and reducers (``to_apply`` of a reduce,
  an all-reduce, a scatter, ...) per element: they are neither.
  """
  found = {entry}
  for instructions in computations.values():
    for instruction in instructions:
      for role, callees in hlo_lib.CALLEES.findall(instruction.attributes):
        if role in ("body", "true_computation", "false_computation", "branch_computations") or (
          role == "to_apply" and instruction.opcode == "call"
        ):
          found.update(re.findall(r"[\w.\-]+", callees.replace("%", " ")))
  return found


class _Program:
  """The module's instructions by name, and what each costs."""

  def __init__(self, computations: dict[str, list[hlo_lib._Instruction]]):
    self.computations = computations
    self.instructions = {i.name: i for body in computations.values() for i in body}
    self.parameter_reads: dict[tuple[str, int], float | None] = {}

  def shape(self, name: str) -> str:
    instruction = self.instructions.get(name)
    return instruction.shape if instruction is not None else ""

  def flops(self, instruction: hlo_lib._Instruction) -> float:
    """A dot's or a convolution's multiply-adds, times 2."""
    output = math.prod(_dimensions(instruction.shape))  # a cuBLAS call's first array
    if instruction.opcode != "convolution":
      lhs = _dimensions(self.shape(instruction.operands[0]))
      found = re.search(
        r'lhs_contracting_dims=\{([\d,]*)\}|"lhs_contracting_dimensions":\[([\d",]*)\]',
        instruction.attributes,
      )
      contracted = (
        [int(d) for d in re.findall(r"\d+", "".join(filter(None, found.groups())))] if found else []
      )
      return 2.0 * output * math.prod(lhs[d] for d in contracted)
    return _convolution_flops(
      instruction,
      _dimensions(self.shape(instruction.operands[0])),
      _dimensions(self.shape(instruction.operands[1])),
      _dimensions(instruction.shape),
    )

  def multiply_type(self, instruction: hlo_lib._Instruction) -> str:
    """The type a dot or convolution multiplies in (see ``Cost.flops_by_dtype``)."""
    types = [_ARRAY.search(self.shape(o)) for o in instruction.operands[:2]]
    names = [found.group(1) for found in types if found]
    wide = [name for name in names if name in _FLOAT32_RATE]
    return wide[0] if wide else (names[0] if names else "unknown")

  def bytes(self, instruction: hlo_lib._Instruction) -> float:
    """The HBM bytes one execution of an instruction outside fusions reads and writes."""
    opcode = instruction.opcode
    if opcode in _NO_TRAFFIC or opcode.endswith(("-done", "-update")):
      return 0
    if opcode.endswith("-start"):  # its shape holds its operands and its results
      return _hbm_bytes(instruction.shape)
    if opcode == "dynamic-slice":  # reads the slice, writes it
      return 2 * _hbm_bytes(instruction.shape)
    if opcode == "dynamic-update-slice":  # in place: reads the update, writes it
      return 2 * _hbm_bytes(self.shape(instruction.operands[1])) if self._in_hbm(instruction) else 0
    if opcode == "fusion":
      return self._fusion_bytes(instruction)
    if _is_gemm(instruction):  # its operands and its result, not its scratch workspace
      output = _ARRAY.search(instruction.shape)
      written = _hbm_bytes(output.group(0)) if output else 0
      return written + sum(_hbm_bytes(self.shape(o)) for o in instruction.operands)
    return _hbm_bytes(instruction.shape) + sum(
      _hbm_bytes(self.shape(o)) for o in instruction.operands
    )

  def _in_hbm(self, instruction: hlo_lib._Instruction) -> bool:
    return _hbm_bytes(instruction.shape) > 0

  def _fusion_bytes(self, fusion: hlo_lib._Instruction) -> float:
    """A fusion reads the parts of its operands it uses and writes its result."""
    body = self._callee(fusion)
    total = 0.0
    for index, operand in enumerate(fusion.operands):
      full = _hbm_bytes(self.shape(operand))
      read = self._parameter_reads(body, index) if full else None
      total += full if read is None else min(read, full)
    return total + self._written(body, self.computations.get(body, [None])[-1], fusion.shape)

  def _callee(self, fusion: hlo_lib._Instruction) -> str:
    found = re.search(r"calls=%?([\w.\-]+)", fusion.attributes)
    return found.group(1) if found else ""

  def _parameter_reads(self, body: str, index: int) -> float | None:
    """The bytes fused computation ``body`` reads of its parameter ``index``, None for all."""
    if (body, index) not in self.parameter_reads:
      parameter = next(
        (
          i.name
          for i in self.computations.get(body, ())
          if i.opcode == "parameter" and i.arguments == str(index)
        ),
        None,
      )
      reads = None if parameter is None else self._reads(body, parameter)
      self.parameter_reads[body, index] = reads
    return self.parameter_reads[body, index]

  def _reads(self, body: str, name: str) -> float | None:
    """The bytes ``body``'s users of value ``name`` read of it: slices read a part, None for all."""
    total = 0.0
    for user in self.computations.get(body, ()):
      positions = [k for k, operand in enumerate(user.operands) if operand == name]
      if not positions:
        continue
      if user.opcode == "bitcast":
        read = self._reads(body, user.name)
      elif user.opcode in ("dynamic-slice", "slice", "gather") and positions == [0]:
        read = _hbm_bytes(user.shape)
      elif user.opcode == "dynamic-update-slice" and positions == [0]:
        read = 0.0  # updated in place: only the update moves
      elif user.opcode == "fusion":
        inner = [self._parameter_reads(self._callee(user), k) for k in positions]
        known = [r for r in inner if r is not None]
        read = sum(known) if len(known) == len(inner) else None
      else:
        return None
      if read is None:
        return None
      total += read
    return total

  def _written(self, body: str, root: hlo_lib._Instruction | None, shape: str) -> float:
    """The HBM bytes a fusion whose computation ``body`` ends in ``root`` writes.

    An in-place ``dynamic-update-slice`` writes its update alone; the printed
    computation ends in its root.
    """
    if root is None:
      return _hbm_bytes(shape)
    defined = {i.name: i for i in self.computations.get(body, ())}
    total = 0.0
    elements = root.operands if root.opcode == "tuple" else (root.name,)
    for element in elements:
      value = defined.get(element)
      while value is not None and value.opcode == "bitcast":
        value = defined.get(value.operands[0])
      if value is None:
        continue
      if value.opcode == "dynamic-update-slice":
        total += _hbm_bytes(self.shape(value.operands[1])) if self._in_hbm(value) else 0
      elif value.opcode == "fusion":
        inner = self._callee(value)
        total += self._written(inner, self.computations.get(inner, [None])[-1], value.shape)
      else:
        total += _hbm_bytes(value.shape)
    return total
