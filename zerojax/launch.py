"""Command line: run a script as N local CPU processes of one multi-process JAX job.

Example:
  python -m zerojax.launch -n 2 --devices-per-process 4 examples/train_lm.py --model tiny
"""

import sys

from zerojax._src.launch import main

if __name__ == "__main__":
  sys.exit(main())
