"""The ``python -m zerojax.estimate`` command line: memory and communication tables per stage."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from zerojax._src.comm import quantized as quantize
from zerojax._src.diagnostics.estimate import (
  STAGES,
  estimate_communication,
  estimate_memory,
  estimate_tree_memory,
)

_STAGE_NAMES = {0: "plain DP", 1: "zero1", 2: "zero2", 3: "zero3"}
#: When pipeline stages reduce their gradients, by --pipeline-reduce.
_REDUCTIONS = {
  None: "once per step at zero2, per micro-batch at zero3",
  "step": "once per step (zero3 then holds its stage's gathered weights too)",
  "microbatch": "per micro-batch at zero2 and zero3",
}
#: The ZeRO paper's mixed-precision Adam: fp32 master copy (4), momentum (4) and variance (4).
_PAPER_STATE_BYTES = 12
_COMMUNICATION_CAPTION = (
  "Communication, GB each device sends per step over a ring (the ZeRO paper's accounting: an\n"
  "all-gather or a reduce-scatter moves its whole array, an all-reduce twice, as it is both;\n"
  "so plain DP moves as much as zero1. zerojax.diagnostics.count_collectives counts an\n"
  "all-reduce once):"
)


def state_bytes_per_param(optimizer_name: str, dtype: str, shape=(4096, 4096)) -> float:
  """Optimizer-state bytes per parameter of ``optax.<optimizer_name>``, by ``jax.eval_shape``.

  Counted on one ``shape`` matrix, so factored optimizers (Adafactor) report
  what they use on a typical weight matrix. A master copy of low-precision
  parameters is not included.

  Raises:
    ValueError: if optax has no optimizer of that name.

  Example:
    >>> from zerojax.estimate import state_bytes_per_param
    >>> round(state_bytes_per_param("adamw", "float32"), 2)  # two float32 moments
    8.0
  """
  params = {"w": jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))}
  factory: Any = getattr(optax, optimizer_name, None)
  try:
    optimizer = factory(1e-3)
    per_device = estimate_tree_memory(params, optimizer, num_devices=1, stage=0)
  except (TypeError, AttributeError):
    raise ValueError(
      f"optax.{optimizer_name}(learning_rate) is not an optax optimizer; try adamw, lion, "
      "adafactor."
    ) from None
  return per_device.optimizer_state / math.prod(shape)


def table(
  num_params: float,
  devices: list[int],
  param_bytes,
  grad_bytes,
  state_bytes,
  replicas: int = 1,
  tensor_parallel: int = 1,
  offload: str | None = None,
  master_bytes: float = 4,
  pipeline_stages: int = 1,
  pipeline_reduce: str | None = None,
) -> str:
  """The table ``main`` prints: GB per device for each stage and data-axis size.

  With ``replicas``, ``tensor_parallel`` or ``pipeline_stages`` above 1, each
  row also gives the job's total device count (replicas x data x tensor
  parallel x pipeline stages). With
  ``offload``, the cells of zero1-3 read "device memory + host memory" (plain
  DP is not offloaded); ``master_bytes`` is the master copy's share of
  ``state_bytes`` (see ``zerojax.estimate_memory``).

  Example:
    The ZeRO paper's Table I, 7.5B parameters with mixed-precision Adam, on 64 devices:

    >>> from zerojax.estimate import table
    >>> print(table(7.5e9, [64], param_bytes=2, grad_bytes=2, state_bytes=12))
     devices   plain DP      zero1      zero2      zero3
    ----------------------------------------------------
          64     120.00      31.41      16.64       1.88

    With the optimizer state (not the fp32 master weights) in host memory:

    >>> print(table(7.5e9, [64], 2, 2, 12, offload="optimizer"))
     devices         plain DP            zero1            zero2            zero3
    ----------------------------------------------------------------------------
          64           120.00     30.47 + 0.94     15.70 + 0.94      0.94 + 0.94
  """

  def row(n):
    for stage in STAGES:
      estimate = estimate_memory(
        num_params,
        num_devices=n,
        stage=stage,
        replicas=replicas,
        tensor_parallel=tensor_parallel,
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        state_bytes=state_bytes,
        master_bytes=master_bytes,
        offload=offload if stage else None,
        pipeline_stages=pipeline_stages,
        pipeline_reduce=pipeline_reduce,
      )
      host = f" + {estimate.host / 1e9:.2f}" if offload and stage else ""
      yield f"{estimate.total / 1e9:.2f}{host}"

  others = replicas * tensor_parallel * pipeline_stages
  return _grid(devices, others, 16 if offload else 10, row)


def communication_table(
  num_params: float,
  devices: list[int],
  param_bytes,
  grad_bytes,
  replicas: int = 1,
  quantized_weights: str | None = None,
  quantized_gradients: str | None = None,
  block_size: int = quantize.DEFAULT_BLOCK_SIZE,
  pipeline: dict[str, Any] | None = None,
) -> str:
  """GB each device sends per step over a ring, per stage and data-axis size.

  The ZeRO paper's accounting: an all-gather or a reduce-scatter moves its
  whole array, an all-reduce twice its array (a ring all-reduce is a
  reduce-scatter and an all-gather; each moves (N - 1) / N of the array, taken
  as 1). So plain data parallelism moves 2Ψ, as stages 1 and 2 do, and zero3
  moves 3Ψ: it gathers every weight twice, the second time in backward under
  remat. That is ``zerojax.estimate_communication``'s total with each
  all-reduce (plain DP's, and hybrid sharding's sum of the shard across
  replicas) counted twice; ``zerojax.diagnostics.count_collectives`` counts it once.

  ``pipeline`` holds ``estimate_communication``'s ``pipeline_stages``,
  ``microbatches`` and ``pipeline_reduce``, for a device of one pipeline stage
  (the pipeline's own activations not counted). With quantization, each cell
  also gives the ratio to the unquantized bytes.
  zerojax quantizes only what zero1-3 move: plain data parallelism and stage 1
  and 2's all-gather of the updated parameters stay as they are.

  Example:
    7.5B parameters with bf16 weights and gradients, on 64 devices:

    >>> from zerojax.estimate import communication_table
    >>> print(communication_table(7.5e9, [64], param_bytes=2, grad_bytes=2))
     devices   plain DP      zero1      zero2      zero3
    ----------------------------------------------------
          64      30.00      30.00      30.00      45.00
    >>> print(communication_table(
    ...   7.5e9, [64], 2, 2, quantized_weights="int8", quantized_gradients="int8"
    ... ))
     devices       plain DP          zero1          zero2          zero3
    --------------------------------------------------------------------
          64   30.00 (1.00)   22.62 (0.75)   22.62 (0.75)   22.85 (0.51)
  """
  quantized = quantized_weights is not None or quantized_gradients is not None

  def row(n):
    for stage in STAGES:
      options = dict(
        num_devices=n,
        stage=stage,
        replicas=replicas,
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        **(pipeline or {}),
      )
      plain = _ring_bytes(num_params, **options)
      if not quantized:
        yield f"{plain / 1e9:.2f}"
        continue
      moved = _ring_bytes(
        num_params,
        **options,
        quantized_weights=quantized_weights if stage == 3 else None,
        quantized_gradients=quantized_gradients if stage else None,
        quantization_block_size=block_size,
      )
      yield f"{moved / 1e9:.2f} ({moved / plain:.2f})" if plain else f"{moved / 1e9:.2f}"

  stages = (pipeline or {}).get("pipeline_stages", 1)
  return _grid(devices, replicas * stages, 14 if quantized else 10, row)


def hpz_table(
  num_params: float,
  devices: list[int],
  secondary: int,
  param_bytes,
  grad_bytes,
  state_bytes,
  replicas: int = 1,
  quantized_weights: str | None = None,
  quantized_gradients: str | None = None,
  block_size: int = quantize.DEFAULT_BLOCK_SIZE,
) -> str:
  """Stage 3 with hpZ (``secondary`` devices per node) against without it, GB per device.

  Memory: zero3's model states, and the secondary partitions hpZ holds during
  a step on top of them. Communication, as ``zerojax.estimate_communication``
  counts it (the logical size of each collective), on the same nodes, split
  into what spans the nodes and what stays inside a node
  (``CommunicationEstimate.inside_nodes``). zero3's gathers and unquantized
  reduce-scatter span the nodes; hpZ's gathers cross them in the forward
  pass only, each device's secondary partition, and gather the secondary
  partitions into whole weights inside the node. Quantized gradients take
  two rounds on nodes, with or without hpZ: the whole gradient inside the
  node, then the node's sums across. A row whose data axes are not two or
  more nodes of ``secondary`` devices is ``-``, and a line under the table
  says why.

  Example:
    >>> from zerojax.estimate import hpz_table
    >>> print(hpz_table(7.5e9, [8, 64], secondary=8, param_bytes=2, grad_bytes=2, state_bytes=12))
     devices  zero3 memory   + secondary  zero3 across  zero3 inside    hpZ across    hpZ inside
    --------------------------------------------------------------------------------------------
           8             -             -             -             -             -             -
          64          1.88          1.88         45.00          0.00         16.88         30.00
    -: 8 devices are one node of 8; hpZ needs two or more nodes (--secondary less than --devices)

    With int8 weights and gradients, the gradients are summed inside the node first, and only
    the node's sums cross:

    >>> print(hpz_table(7.5e9, [64], 8, 2, 2, 12, quantized_weights="int8",
    ...                 quantized_gradients="int8"))
     devices  zero3 memory   + secondary  zero3 across  zero3 inside    hpZ across    hpZ inside
    --------------------------------------------------------------------------------------------
          64          1.88          1.88         16.19          7.62          1.90         37.62
  """
  columns = (
    "zero3 memory",
    "+ secondary",
    "zero3 across",
    "zero3 inside",
    "hpZ across",
    "hpZ inside",
  )

  def communication(num_devices: int, secondary_devices: int | None):
    return estimate_communication(
      num_params,
      num_devices=num_devices,
      stage=3,
      quantized_weights=quantized_weights,
      quantized_gradients=quantized_gradients,
      quantization_block_size=block_size,
      replicas=replicas,
      param_bytes=param_bytes,
      grad_bytes=grad_bytes,
      secondary_devices=secondary_devices,
      devices_per_node=secondary,  # the same nodes, with hpZ or without
    )

  def row(n):
    if n % secondary or n == secondary:
      return ["-"] * len(columns)
    memory = estimate_memory(
      num_params,
      num_devices=n,
      stage=3,
      replicas=replicas,
      param_bytes=param_bytes,
      grad_bytes=grad_bytes,
      state_bytes=state_bytes,
      secondary_devices=secondary,
    )
    plain, hpz = communication(n, None), communication(n, secondary)
    cells = (memory.total, memory.secondary)
    for moved in (plain, hpz):
      cells += (moved.total - moved.inside_nodes, moved.inside_nodes)
    return [f"{gigabytes / 1e9:.2f}" for gigabytes in cells]

  header = f"{'devices':>8} " + " ".join(f"{name:>13}" for name in columns)
  lines = [header, "-" * len(header)]
  lines += [f"{n:>8} " + " ".join(f"{cell:>13}" for cell in row(n)) for n in devices]
  lines += [f"-: {why}" for why in dict.fromkeys(_not_hpz(n, secondary) for n in devices) if why]
  return "\n".join(lines)


def _not_hpz(num_devices: int, secondary: int) -> str | None:
  """Why ``num_devices`` are not two or more nodes of ``secondary`` devices, or ``None``."""
  if num_devices % secondary:
    return (
      f"{num_devices} devices do not split into nodes of {secondary} (--secondary must divide "
      "--devices)"
    )
  if num_devices == secondary:
    return (
      f"{num_devices} devices are one node of {secondary}; hpZ needs two or more nodes "
      "(--secondary less than --devices)"
    )
  return None


def _ring_bytes(num_params: float, *, stage: int, **options) -> float:
  """``estimate_communication``'s total, with each all-reduce counted twice."""
  estimate = estimate_communication(num_params, stage=stage, **options)
  # Quantized, the sum across replicas is an all-to-all and an all-gather, counted as they are.
  all_reduced = 0.0 if options.get("quantized_gradients") else estimate.replica_reductions
  if stage == 0:
    all_reduced += estimate.gradient_reductions
  return estimate.total + all_reduced


def _grid(
  devices: list[int],
  others: int,
  width: int,
  row: Callable[[int], Iterator[str]],
) -> str:
  """A table with one row per data-axis size and one column per stage.

  ``row(n)`` yields the stages' cells for data axes of size ``n``; with
  ``others`` (the devices of the other mesh axes) above 1, each row also gives
  the job's total device count.
  """
  multi_axis = others > 1
  first = f"{'data':>8} {'devices':>8} " if multi_axis else f"{'devices':>8} "
  header = first + " ".join(f"{_STAGE_NAMES[s]:>{width}}" for s in STAGES)
  rows = [header, "-" * len(header)]
  for n in devices:
    lead = f"{n:>8} {n * others:>8} " if multi_axis else f"{n:>8} "
    rows.append(lead + " ".join(f"{cell:>{width}}" for cell in row(n)))
  return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> str | None:
  """Parses ``argv``, prints the memory and communication tables and returns them.

  Returns:
    The printed text; ``None`` when ``argv`` is ``None`` (the command line),
    since the ``zerojax-estimate`` script exits with what ``main`` returns.

  Example:
    From a shell (installed as ``zerojax-estimate`` too)::

      python -m zerojax.estimate --params 7.5e9 --devices 1 4 16 64 256 1024
      python -m zerojax.estimate --params 7.5e9 --devices 64 --quantized-gradients int8

    From Python:

    >>> from zerojax.estimate import main
    >>> text = main(["--params", "7.5e9", "--devices", "64", "--quantized-weights", "int8"])
    ... # doctest: +ELLIPSIS
    Ψ = 7.5e+09 parameters; 2 B/param, 2 B/grad, K = 12 B/param of optimizer state ...
    Communication, GB each device sends per step over a ring (the ZeRO paper's accounting: an
    all-gather or a reduce-scatter moves its whole array, an all-reduce twice, as it is both;
    so plain DP moves as much as zero1. zerojax.diagnostics.count_collectives counts an
    all-reduce once):
     devices   plain DP      zero1      zero2      zero3
    ----------------------------------------------------
          64      30.00      30.00      30.00      45.00
    Quantized (int8 weights in zero3; blocks of 256), with the ratio to unquantized:
     devices       plain DP          zero1          zero2          zero3
    --------------------------------------------------------------------
          64   30.00 (1.00)   30.00 (1.00)   30.00 (1.00)   30.23 (0.67)
  """
  parser = _parser()
  args = parser.parse_args(argv)
  if args.optimizer and args.state_bytes is not None:
    parser.error("give --optimizer or --state-bytes, not both")
  try:
    state_bytes, source = _state_bytes(args)
    communication = _communication(args)
  except ValueError as error:
    parser.error(str(error))
  mesh = ""
  if args.replicas > 1 or args.tensor_parallel > 1:
    axes = [f"{args.replicas} replica(s)"] * (args.replicas > 1) + ["data (the rows)"]
    if args.tensor_parallel > 1:
      axes.append(
        f"{args.tensor_parallel}-way tensor parallelism (every parameter counted as split over it)"
      )
    mesh = f"Mesh: {' x '.join(axes)}.\n"
  if args.pipeline_stages > 1:
    mesh += (
      f"{args.pipeline_stages} pipeline stages (each device holds a stage's share of every "
      f"model state); stage gradients reduce-scattered {_REDUCTIONS[args.pipeline_reduce]}. "
      "Activations not included: a schedule holds zerojax.pipeline_timetable(...).in_flight "
      "micro-batches of them.\n"
    )
  memory = lambda offload: table(
    args.params,
    args.devices,
    args.param_bytes,
    args.grad_bytes,
    state_bytes,
    args.replicas,
    args.tensor_parallel,
    offload,
    master_bytes=jnp.dtype(args.dtype).itemsize,
    pipeline_stages=args.pipeline_stages,
    pipeline_reduce=args.pipeline_reduce,
  )
  offloaded = ""
  if args.offload:
    try:
      offloaded = (
        f"With offload={args.offload!r}, GB per device in device memory + in host memory "
        f"(a host holds that for each of its devices):\n{memory(args.offload)}\n\n"
      )
    except ValueError as error:
      parser.error(str(error))
  text = (
    f"Ψ = {args.params:.3g} parameters; {args.param_bytes:g} B/param, "
    f"{args.grad_bytes:g} B/grad, K = {state_bytes:.3g} B/param of optimizer state "
    f"({source}).\n{mesh}GB per device:\n{memory(None)}\n\n{offloaded}{communication}"
  )
  if args.secondary is not None:
    text += f"\n\n{_hpz(args, state_bytes)}"
  print(text)
  return None if argv is None else text


def _hpz(args: argparse.Namespace, state_bytes: float) -> str:
  """The hpZ part of ``main``'s report (``--secondary``)."""
  if args.pipeline_stages > 1:
    return (
      "hpZ is not estimated in pipeline stages: run the estimate for one stage's data group "
      "(--params divided by the stages, no --pipeline-stages) with --secondary."
    )
  if args.tensor_parallel > 1:
    return (
      "hpZ is not estimated with tensor parallelism: what the data axes move depends on how "
      "the layers are split. Measure a compiled step with "
      "zerojax.diagnostics.count_collectives_by_axes."
    )
  quantized = ", quantized as above" if args.quantized_weights or args.quantized_gradients else ""
  return (
    f"zero3 with hpZ, {args.secondary} devices per node (--secondary){quantized}. GB per device\n"
    "of model states, and of the secondary partitions a step holds on top; GB per device per\n"
    "step that zero3's collectives and hpZ's move across the nodes and inside a node (each\n"
    "collective at its logical size, as zerojax.estimate_communication counts it; quantized\n"
    "gradients sum inside the node first, then send the node's sums across):\n"
    + hpz_table(
      args.params,
      args.devices,
      args.secondary,
      args.param_bytes,
      args.grad_bytes,
      state_bytes,
      args.replicas,
      args.quantized_weights,
      args.quantized_gradients,
      args.block_size,
    )
  )


def _state_bytes(args: argparse.Namespace) -> tuple[float, str]:
  """K, the optimizer-state bytes per parameter, and where it comes from, in words.

  With ``--optimizer``, its state counted on ``--dtype`` parameters, plus a
  master copy in ``--dtype`` when ``--param-bytes`` is narrower (mixed
  precision, as in the ZeRO paper, where K = 12 for Adam).
  """
  if args.state_bytes is not None:
    return args.state_bytes, "--state-bytes"
  if not args.optimizer:
    return _PAPER_STATE_BYTES, "mixed-precision Adam: fp32 master copy, momentum and variance"
  state = state_bytes_per_param(args.optimizer, args.dtype)
  source = f"optax.{args.optimizer} on {args.dtype}: {state:.3g}"
  master = jnp.dtype(args.dtype).itemsize
  if args.param_bytes >= master:
    return state, source
  return state + master, (
    f"{source}, + {master} for the {args.dtype} master copy of the {args.param_bytes:g}-byte "
    "parameters; --param-bytes 4 for none"
  )


def _communication(args: argparse.Namespace) -> str:
  """The communication part of ``main``'s report."""
  if args.tensor_parallel > 1:
    return (
      "Communication is not estimated with tensor parallelism: what the data axes move "
      "depends on how the layers are split. Measure a compiled step with "
      "zerojax.diagnostics.count_collectives_by_axes."
    )
  tables = lambda **quantization: communication_table(
    args.params,
    args.devices,
    args.param_bytes,
    args.grad_bytes,
    args.replicas,
    block_size=args.block_size,
    pipeline=dict(
      pipeline_stages=args.pipeline_stages,
      microbatches=args.microbatches,
      pipeline_reduce=args.pipeline_reduce,
    ),
    **quantization,
  )
  text = f"{_COMMUNICATION_CAPTION}\n{tables()}"
  formats = [
    f"{name} {what}"
    for name, what in (
      (args.quantized_weights, "weights in zero3"),
      (args.quantized_gradients, "gradients"),
    )
    if name is not None
  ]
  if formats:
    quantized = tables(
      quantized_weights=args.quantized_weights, quantized_gradients=args.quantized_gradients
    )
    text += (
      f"\nQuantized ({', '.join(formats)}; blocks of {args.block_size}), "
      f"with the ratio to unquantized:\n{quantized}"
    )
  return text


def _parser() -> argparse.ArgumentParser:
  """The command line's flags; each number is checked as it is read."""
  parser = argparse.ArgumentParser(
    prog="python -m zerojax.estimate",
    description="GB per device of parameters + gradients + optimizer state, per ZeRO stage "
    "(activations and temporaries not included), and GB each device's collectives move "
    "per step.",
  )
  parser.add_argument(
    "--params", type=_number(above=0), required=True, help="number of parameters, e.g. 7.5e9"
  )
  parser.add_argument(
    "--devices",
    type=_whole(least=1),
    nargs="+",
    default=[1, 8, 64, 512],
    help="sizes of the data axes (N, what ZeRO shards over)",
  )
  parser.add_argument(
    "--replicas", type=_whole(least=1), default=1, help="size of the replica axes (hybrid sharding)"
  )
  parser.add_argument(
    "--tensor-parallel", type=_whole(least=1), default=1, help="size of the tensor-parallel axes"
  )
  parser.add_argument(
    "--pipeline-stages",
    type=_whole(least=1),
    default=1,
    help="size of the pipeline's stage axis (zerojax.pipeline): each device holds one stage",
  )
  parser.add_argument(
    "--microbatches",
    type=_whole(least=1),
    default=1,
    help="with --pipeline-stages: the pipeline's micro-batches (for the communication)",
  )
  parser.add_argument(
    "--pipeline-reduce",
    choices=("step", "microbatch"),
    help="with --pipeline-stages: reduce-scatter stage gradients once per step or once per "
    "micro-batch (default: once per step at zero2, per micro-batch at zero3)",
  )
  for name, what in (("param", "bytes per parameter"), ("grad", "bytes per gradient element")):
    parser.add_argument(
      f"--{name}-bytes", type=_number(above=0), default=2, help=f"{what} (default 2: bf16)"
    )
  parser.add_argument(
    "--state-bytes",
    type=_number(above=0, inclusive=True),
    help=f"optimizer-state bytes per parameter (default {_PAPER_STATE_BYTES}: mixed-precision "
    "Adam)",
  )
  parser.add_argument(
    "--optimizer",
    help="an optax optimizer name; its state bytes are counted by eval_shape on --dtype "
    "parameters, plus a --dtype master copy if --param-bytes is narrower",
  )
  parser.add_argument(
    "--dtype",
    choices=("float32", "bfloat16", "float16"),
    default="float32",
    help="master parameter dtype for --optimizer (default %(default)s)",
  )
  for what, stages in (
    ("weights", "zero3 with its weight all-gathers"),
    ("gradients", "zero1-3 with their gradient reduce-scatters"),
  ):
    help = f"also estimate {stages} quantized"
    parser.add_argument(f"--quantized-{what}", choices=sorted(quantize.FORMATS), help=help)
  parser.add_argument(
    "--offload",
    choices=("optimizer", "optimizer+master"),
    help="also give zero1-3 with the optimizer state (and the master copy) in host memory: "
    "GB in device memory + GB in host memory, per device",
  )
  parser.add_argument(
    "--secondary",
    type=_whole(least=1),
    help="also give zero3 with hpZ (ZeRO++'s secondary partition inside a node): the size of "
    "the intra-node data axes, the devices per node",
  )
  parser.add_argument(
    "--block-size",
    type=_whole(least=1),
    default=quantize.DEFAULT_BLOCK_SIZE,
    help=f"elements per quantization scale (default {quantize.DEFAULT_BLOCK_SIZE})",
  )
  return parser


def _number(*, above: float, inclusive: bool = False) -> Callable[[str], float]:
  """An argparse type: a finite number above ``above`` (or equal to it, if ``inclusive``)."""
  bound = f"{'at least' if inclusive else 'above'} {above:g}"

  def parse(text: str) -> float:
    try:
      value = float(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < above or (value == above and not inclusive):
      raise argparse.ArgumentTypeError(f"must be finite and {bound}, got {text}")
    return value

  return parse


def _whole(*, least: int) -> Callable[[str], int]:
  """An argparse type: a whole number of at least ``least``."""

  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < least:
      raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value

  return parse
