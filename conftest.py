"""Every pytest run, of the tests or of the doctests under zerojax/ alone, sees 8 CPU devices."""

from tests import environment

environment.prepare()  # before JAX is imported: it reads the environment then

import jax  # noqa: E402
import pytest  # noqa: E402

import zerojax  # noqa: E402

zerojax.distributed.use_cpu_devices(8)


@pytest.fixture(autouse=True, scope="session")
def _eight_devices():
  assert jax.device_count() == 8, "tests need 8 devices; did something start JAX before conftest?"
