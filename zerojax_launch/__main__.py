"""``python -m zerojax_launch``: see ``zerojax_launch.launcher.main``."""

import sys

from zerojax_launch.launcher import main

if __name__ == "__main__":
  sys.exit(main())
