"""Command line: per-device memory and communication of each ZeRO stage, per device count.

Examples:
  From a shell::

    python -m zerojax.estimate --params 7.5e9 --devices 1 4 16 64 256 1024
    python -m zerojax.estimate --params 1.3e9 --devices 8 --optimizer adafactor --dtype float32
    python -m zerojax.estimate --params 7.5e9 --devices 8 --replicas 4 --tensor-parallel 2
    python -m zerojax.estimate --params 7.5e9 --devices 64 --quantized-gradients int8
    python -m zerojax.estimate --params 7e9 --devices 8 --offload optimizer
    python -m zerojax.estimate --params 7.5e9 --devices 64 --secondary 8

"""

from zerojax._src.diagnostics.estimate_cli import (
  communication_table,
  hpz_table,
  main,
  state_bytes_per_param,
  table,
)

__all__ = ("communication_table", "hpz_table", "main", "state_bytes_per_param", "table")

if __name__ == "__main__":
  main()
