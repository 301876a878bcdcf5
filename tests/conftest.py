"""Every test sees 8 CPU devices, so sharding is real."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # read when jax is imported

import jax
import pytest

import zerojax

zerojax.use_cpu_devices(8)


@pytest.fixture(autouse=True, scope="session")
def _eight_devices():
  assert jax.device_count() == 8, "tests need 8 devices; did something start JAX before conftest?"


@pytest.fixture
def mesh():
  return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
