"""Command line: per-device memory and communication of each ZeRO stage, per device count.

Examples:
  From a shell::

    python -m zerojax.estimate --params 7.5e9 --devices 1 4 16 64 256 1024
    python -m zerojax.estimate --params 1.3e9 --devices 8 --optimizer adafactor --dtype float32
    python -m zerojax.estimate --params 7.5e9 --devices 8 --replicas 4 --tensor-parallel 2
    python -m zerojax.estimate --params 7.5e9 --devices 64 --quantized-gradients int8
    python -m zerojax.estimate --params 7e9 --devices 8 --offload optimizer
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax

from zerojax._src.estimate import (
  STAGES,
  estimate_communication,
  estimate_memory,
  estimate_tree_memory,
)
from zerojax._src.quantize import DEFAULT_BLOCK_SIZE, FORMATS

__all__ = ("communication_table", "main", "state_bytes_per_param", "table")

_STAGE_NAMES = {0: "plain DP", 1: "zero1", 2: "zero2", 3: "zero3"}


def state_bytes_per_param(optimizer_name: str, dtype: str, shape=(4096, 4096)) -> float:
  """Optimizer-state bytes per parameter of ``optax.<optimizer_name>``, by ``jax.eval_shape``.

  Counted on one ``shape`` matrix, so factored optimizers (Adafactor) report
  what they use on a typical weight matrix.

  Example:
    >>> from zerojax.estimate import state_bytes_per_param
    >>> round(state_bytes_per_param("adamw", "float32"), 2)  # two float32 moments
    8.0
  """
  factory = getattr(optax, optimizer_name, None)
  if factory is None:
    raise SystemExit(f"optax has no optimizer {optimizer_name!r}; try adamw, lion, adafactor.")
  params = {"w": jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))}
  per_device = estimate_tree_memory(params, factory(1e-3), num_devices=1, stage=0)
  return per_device.optimizer_state / (shape[0] * shape[1])


def table(
  num_params: float,
  devices: list[int],
  param_bytes,
  grad_bytes,
  state_bytes,
  replicas: int = 1,
  tensor_parallel: int = 1,
  offload: str | None = None,
) -> str:
  """The table ``main`` prints: GB per device for each stage and data-axis size.

  With ``replicas`` or ``tensor_parallel`` above 1, each row also gives the
  job's total device count (replicas x data x tensor parallel). With
  ``offload``, the cells of zero1-3 read "device memory + host memory"
  (plain DP is not offloaded).

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
        offload=offload if stage else None,
      )
      host = f" + {estimate.host / 1e9:.2f}" if offload and stage else ""
      yield f"{estimate.total / 1e9:.2f}{host}"

  return _grid(devices, replicas, tensor_parallel, 16 if offload else 10, row)


def communication_table(
  num_params: float,
  devices: list[int],
  param_bytes,
  grad_bytes,
  replicas: int = 1,
  quantized_weights: str | None = None,
  quantized_gradients: str | None = None,
  block_size: int = DEFAULT_BLOCK_SIZE,
) -> str:
  """GB per device per step that each stage moves, per data-axis size.

  Each collective counts the full array it gathers or reduces, as
  ``zerojax.count_collectives`` counts it (see
  ``zerojax.estimate_communication``); zero3 gathers every weight twice, the
  second time in backward under remat. With quantization, each cell also
  gives the ratio to the unquantized bytes. zerojax quantizes only what
  zero1-3 move: plain data parallelism and stage 1 and 2's all-gather of the
  updated parameters stay as they are.

  Example:
    7.5B parameters with bf16 weights and gradients, on 64 devices:

    >>> from zerojax.estimate import communication_table
    >>> print(communication_table(7.5e9, [64], param_bytes=2, grad_bytes=2))
     devices   plain DP      zero1      zero2      zero3
    ----------------------------------------------------
          64      15.00      30.00      30.00      45.00
    >>> print(communication_table(
    ...   7.5e9, [64], 2, 2, quantized_weights="int8", quantized_gradients="int8"
    ... ))
     devices       plain DP          zero1          zero2          zero3
    --------------------------------------------------------------------
          64   15.00 (1.00)   22.62 (0.75)   22.62 (0.75)   22.85 (0.51)
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
      )
      plain = estimate_communication(num_params, **options).total
      if not quantized:
        yield f"{plain / 1e9:.2f}"
        continue
      moved = estimate_communication(
        num_params,
        **options,
        quantized_weights=quantized_weights if stage == 3 else None,
        quantized_gradients=quantized_gradients if stage else None,
        quantization_block_size=block_size,
      ).total
      yield f"{moved / 1e9:.2f} ({moved / plain:.2f})" if plain else f"{moved / 1e9:.2f}"

  return _grid(devices, replicas, 1, 14 if quantized else 10, row)


def _grid(devices, replicas, tensor_parallel, width, row) -> str:
  """A table with one row per data-axis size and one column per stage.

  ``row(n)`` yields the stages' cells for data axes of size ``n``; with
  ``replicas`` or ``tensor_parallel`` above 1, each row also gives the job's
  total device count.
  """
  multi_axis = replicas > 1 or tensor_parallel > 1
  first = f"{'data':>8} {'devices':>8} " if multi_axis else f"{'devices':>8} "
  header = first + " ".join(f"{_STAGE_NAMES[s]:>{width}}" for s in STAGES)
  rows = [header, "-" * len(header)]
  for n in devices:
    lead = f"{n:>8} {n * replicas * tensor_parallel:>8} " if multi_axis else f"{n:>8} "
    rows.append(lead + " ".join(f"{cell:>{width}}" for cell in row(n)))
  return "\n".join(rows)


def main(argv: list[str] | None = None) -> str | None:
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
    Communication, GB per device per step, as zerojax.count_collectives counts it (each
    collective's array; a ring all-reduce moves twice its array, so plain DP moves as much
    as zero1):
     devices   plain DP      zero1      zero2      zero3
    ----------------------------------------------------
          64      15.00      30.00      30.00      45.00
    Quantized (int8 weights in zero3; blocks of 256), with the ratio to unquantized:
     devices       plain DP          zero1          zero2          zero3
    --------------------------------------------------------------------
          64   15.00 (1.00)   30.00 (1.00)   30.00 (1.00)   30.23 (0.67)
  """
  parser = argparse.ArgumentParser(
    prog="python -m zerojax.estimate",
    description="GB per device of parameters + gradients + optimizer state, per ZeRO stage "
    "(activations and temporaries not included), and GB each device's collectives move "
    "per step.",
  )
  parser.add_argument(
    "--params", type=float, required=True, help="number of parameters, e.g. 7.5e9"
  )
  parser.add_argument(
    "--devices",
    type=int,
    nargs="+",
    default=[1, 8, 64, 512],
    help="sizes of the data axes (N, what ZeRO shards over)",
  )
  parser.add_argument(
    "--replicas", type=int, default=1, help="size of the replica axes (hybrid sharding)"
  )
  parser.add_argument(
    "--tensor-parallel", type=int, default=1, help="size of the tensor-parallel axes"
  )
  parser.add_argument("--param-bytes", type=float, default=2, help="bytes per parameter (2: bf16)")
  parser.add_argument("--grad-bytes", type=float, default=2, help="bytes per gradient element")
  parser.add_argument(
    "--state-bytes",
    type=float,
    default=None,
    help="optimizer-state bytes per parameter (default 12: mixed-precision Adam)",
  )
  parser.add_argument(
    "--optimizer", help="an optax optimizer name; its state bytes are counted by eval_shape"
  )
  parser.add_argument("--dtype", default="float32", help="parameter dtype for --optimizer")
  parser.add_argument(
    "--quantized-weights",
    choices=sorted(FORMATS),
    help="also estimate zero3 with its weight all-gathers quantized",
  )
  parser.add_argument(
    "--quantized-gradients",
    choices=sorted(FORMATS),
    help="also estimate zero1-3 with their gradient reduce-scatters quantized",
  )
  parser.add_argument(
    "--block-size",
    type=int,
    default=DEFAULT_BLOCK_SIZE,
    help=f"elements per quantization scale (default {DEFAULT_BLOCK_SIZE})",
  )
  parser.add_argument(
    "--offload",
    choices=["optimizer", "optimizer+master"],
    help="also give zero1-3 with the optimizer state (and the fp32 master weights) in host "
    "memory: GB in device memory + GB in host memory, per device",
  )
  args = parser.parse_args(argv)
  if args.optimizer and args.state_bytes is not None:
    parser.error("give --optimizer or --state-bytes, not both")
  state_bytes = args.state_bytes if args.state_bytes is not None else 12
  source = "--state-bytes" if args.state_bytes is not None else "mixed-precision Adam"
  if args.optimizer:
    state_bytes = state_bytes_per_param(args.optimizer, args.dtype)
    source = f"optax.{args.optimizer} on {args.dtype}"
  for name in ("replicas", "tensor_parallel"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be at least 1")
  try:
    communication = _communication(args)
  except ValueError as error:
    parser.error(str(error))
  mesh = ""
  if args.replicas > 1 or args.tensor_parallel > 1:
    mesh = (
      f"{args.replicas} replica(s) x data x {args.tensor_parallel}-way tensor parallelism "
      "(every parameter counted as split over it).\n"
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
  )
  offloaded = ""
  if args.offload:
    try:
      offloaded = (
        f"\nWith offload={args.offload!r}, GB per device in device memory + in host memory "
        f"(a host holds that for each of its devices):\n{memory(args.offload)}\n"
      )
    except ValueError as error:
      parser.error(str(error))
  text = (
    f"Ψ = {args.params:.3g} parameters; {args.param_bytes:g} B/param, "
    f"{args.grad_bytes:g} B/grad, K = {state_bytes:.3g} B/param of optimizer state "
    f"({source}).\n{mesh}GB per device:\n" + memory(None) + "\n" + offloaded + "\n" + communication
  )
  print(text)
  return None if argv is None else text


def _communication(args: argparse.Namespace) -> str:
  """The communication part of ``main``'s report."""
  if args.tensor_parallel > 1:
    return (
      "Communication is not estimated with tensor parallelism: what the data axes move "
      "depends on how the layers are split. Measure a compiled step with "
      "zerojax.count_collectives_by_axes."
    )
  tables = lambda **quantization: communication_table(
    args.params,
    args.devices,
    args.param_bytes,
    args.grad_bytes,
    args.replicas,
    block_size=args.block_size,
    **quantization,
  )
  text = (
    "Communication, GB per device per step, as zerojax.count_collectives counts it (each\n"
    "collective's array; a ring all-reduce moves twice its array, so plain DP moves as much\n"
    "as zero1):\n" + tables()
  )
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


if __name__ == "__main__":
  main()
