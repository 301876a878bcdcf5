"""The environment the tests and their subprocesses run in, and the test-only XLA flags.

``prepare`` runs before JAX is imported (the root ``conftest.py`` calls it):

* the CPU platform, and ``TF_CPP_MIN_LOG_LEVEL=1``: the accelerator
  compilers the test extra installs (tests/test_accelerators.py) log at INFO
  each time a process loads them; the C++ logger reads the level when it
  starts, so it is set first, for subprocesses too (the CUDA plugin's "no
  driver" line, printed before that logger starts, passes anyway);
* ``FAST_COMPILE``: the tests compile many small programs and run each a few
  times, so compiling dominates. XLA's CPU backend compiles without LLVM
  optimisation and with its older emitters instead of its MLIR fusion
  emitters, in half the time, and each program as one LLVM module instead of
  32 for threads to compile in parallel (on CI's 2 cores, busy with three test
  processes, the split costs 10-20% more CPU). Two programs of different
  shapes (prefetching or not, offloading or not) may round differently under
  these flags as under the default ones: the tests compare such programs to a
  stated tolerance, and bit for bit only the same program run twice (a resume,
  a restart);
* a persistent compilation cache that lives as long as the run, in a
  temporary directory that pytest-xdist's workers and the subprocesses the
  tests start (workers, launchers, examples) share through the environment,
  so that a program compiled twice, in two tests or two processes, compiles
  once.
"""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

#: The repository's root: subprocesses import ``zerojax``, ``tests`` and ``examples`` from it.
ROOT = Path(__file__).resolve().parent.parent
#: Compile in half the time (see the module's docstring).
FAST_COMPILE = (
  "--xla_backend_optimization_level=0",
  "--xla_cpu_use_fusion_emitters=false",
  "--xla_cpu_parallel_codegen_split_count=1",
)
#: A CPU collective stuck for this long aborts the process, instead of hanging the test.
STUCK_COLLECTIVES_ABORT = "--xla_cpu_collective_call_terminate_timeout_seconds=20"
_DEVICE_COUNT = "--xla_force_host_platform_device_count"


def prepare() -> None:
  """Sets the variables JAX reads when it is imported, here and in every subprocess."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
  # xdist's workers inherit the flags, and the cache directory, from the process that starts
  # them (which removes the directory at exit), so every process of a run shares one cache.
  # A flag given already wins: XLA_FLAGS="--xla_backend_optimization_level=3
  # --xla_cpu_use_fusion_emitters=true --xla_cpu_parallel_codegen_split_count=32" runs the tests
  # as users compile (XLA's defaults).
  flags = os.environ.get("XLA_FLAGS", "").split()
  given = {flag.split("=")[0] for flag in flags}
  fast = [flag for flag in FAST_COMPILE if flag.split("=")[0] not in given]
  os.environ["XLA_FLAGS"] = " ".join([*flags, *fast])
  if "ZEROJAX_TESTS_JAX_CACHE" not in os.environ:
    cache = tempfile.mkdtemp(prefix="zerojax-tests-jax-cache-")
    atexit.register(shutil.rmtree, cache, ignore_errors=True)
    os.environ["ZEROJAX_TESTS_JAX_CACHE"] = cache
  os.environ.update(
    JAX_COMPILATION_CACHE_DIR=os.environ["ZEROJAX_TESTS_JAX_CACHE"],
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
  )


def subprocess_env(devices: int | None = None, **variables: str) -> dict[str, str]:
  """This process's environment for a subprocess that imports from the repository.

  Args:
    devices: CPU devices each process of the subprocess gets, through
      ``XLA_FLAGS`` (what ``srun`` and ``sbatch`` tasks read); by default
      whatever the subprocess asks for itself.
    **variables: more variables, or variables to replace.
  """
  env = {**os.environ, "PYTHONPATH": str(ROOT), **variables}
  if devices is not None:
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT)]
    env["XLA_FLAGS"] = " ".join([*flags, f"{_DEVICE_COUNT}={devices}"])
  return env
