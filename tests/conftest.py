"""Fixtures the test files share (the environment and the 8 devices: the root conftest.py).

pytest-xdist's controller loads this file too, and runs no test: what the fixtures need is
imported when they run, so that the controller starts its workers without starting JAX.
"""

import subprocess
import sys

import pytest


@pytest.fixture
def mesh():
  import jax

  return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


@pytest.fixture(scope="session")
def uninterrupted() -> dict:
  """The final parameters of ``checkpoint_worker.py`` trained straight through, without faults."""
  from tests.helpers import CHECKPOINT_WORKER, CHECKPOINT_WORKER_STEPS, computed_once, final_params

  train = lambda directory: subprocess.run(
    [sys.executable, CHECKPOINT_WORKER, "train", directory, str(CHECKPOINT_WORKER_STEPS)],
    check=True,
    capture_output=True,
    timeout=120,
  )
  return final_params(computed_once("uninterrupted", train))
