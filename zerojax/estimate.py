"""Command line: per-device memory of model states across ZeRO stages and device counts.

Examples:
  From a shell::

    python -m zerojax.estimate --params 7.5e9 --devices 1 4 16 64 256 1024
    python -m zerojax.estimate --params 1.3e9 --devices 8 --optimizer adafactor --dtype float32
    python -m zerojax.estimate --params 7.5e9 --devices 8 --replicas 4 --tensor-parallel 2
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax

from zerojax._src.estimate import STAGES, estimate_memory, estimate_tree_memory

__all__ = ("main", "state_bytes_per_param", "table")

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
) -> str:
  """The table ``main`` prints: GB per device for each stage and data-axis size.

  With ``replicas`` or ``tensor_parallel`` above 1, each row also gives the
  job's total device count (replicas x data x tensor parallel).

  Example:
    The ZeRO paper's Table I, 7.5B parameters with mixed-precision Adam, on 64 devices:

    >>> from zerojax.estimate import table
    >>> print(table(7.5e9, [64], param_bytes=2, grad_bytes=2, state_bytes=12))
     devices   plain DP      zero1      zero2      zero3
    ----------------------------------------------------
          64     120.00      31.41      16.64       1.88
  """
  multi_axis = replicas > 1 or tensor_parallel > 1
  first = f"{'data':>8} {'devices':>8} " if multi_axis else f"{'devices':>8} "
  header = first + " ".join(f"{_STAGE_NAMES[s]:>10}" for s in STAGES)
  rows = [header, "-" * len(header)]
  for n in devices:
    cells = (
      estimate_memory(
        num_params,
        num_devices=n,
        stage=stage,
        replicas=replicas,
        tensor_parallel=tensor_parallel,
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        state_bytes=state_bytes,
      ).total
      / 1e9
      for stage in STAGES
    )
    lead = f"{n:>8} {n * replicas * tensor_parallel:>8} " if multi_axis else f"{n:>8} "
    rows.append(lead + " ".join(f"{gb:>10.2f}" for gb in cells))
  return "\n".join(rows)


def main(argv: list[str] | None = None) -> str:
  """Parses ``argv``, prints the table and returns it.

  Example:
    From a shell (installed as ``zerojax-estimate`` too)::

      python -m zerojax.estimate --params 7.5e9 --devices 1 4 16 64 256 1024
  """
  parser = argparse.ArgumentParser(
    prog="python -m zerojax.estimate",
    description="GB per device of parameters + gradients + optimizer state, per ZeRO stage "
    "(activations and temporaries not included).",
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
  mesh = ""
  if args.replicas > 1 or args.tensor_parallel > 1:
    mesh = (
      f"{args.replicas} replica(s) x data x {args.tensor_parallel}-way tensor parallelism "
      "(every parameter counted as split over it).\n"
    )
  text = (
    f"Ψ = {args.params:.3g} parameters; {args.param_bytes:g} B/param, "
    f"{args.grad_bytes:g} B/grad, K = {state_bytes:.3g} B/param of optimizer state "
    f"({source}).\n{mesh}GB per device:\n"
    + table(
      args.params,
      args.devices,
      args.param_bytes,
      args.grad_bytes,
      state_bytes,
      args.replicas,
      args.tensor_parallel,
    )
  )
  print(text)
  return text


if __name__ == "__main__":
  main()
