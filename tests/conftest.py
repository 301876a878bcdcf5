"""Every test sees 8 CPU devices, so sharding is real; compiled programs are cached for the run.

The tests compile many small programs and run each a few times, so compiling
dominates: XLA's CPU backend compiles without LLVM optimisation, and every
compiled program goes to a persistent cache that lives as long as the run, in a
temporary directory the subprocesses the tests start (workers, launchers,
examples) share through the environment, so that a program compiled twice, in
two tests or two processes, compiles once.
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # read when jax is imported
os.environ["XLA_FLAGS"] = " ".join(
  [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]
).strip()
_CACHE = tempfile.mkdtemp(prefix="zerojax-tests-jax-cache-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ.update(
  JAX_COMPILATION_CACHE_DIR=_CACHE,
  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
)

import jax  # noqa: E402 (the environment above is read when jax is imported)
import pytest  # noqa: E402

import zerojax  # noqa: E402

zerojax.use_cpu_devices(8)


@pytest.fixture(autouse=True, scope="session")
def _eight_devices():
  assert jax.device_count() == 8, "tests need 8 devices; did something start JAX before conftest?"


@pytest.fixture
def mesh():
  return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
