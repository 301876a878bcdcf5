"""Every test sees 8 CPU devices, so sharding is real; compiled programs are cached for the run.

The tests compile many small programs and run each a few times, so compiling
dominates. Two things make it cheaper:

* XLA's CPU backend compiles without LLVM optimisation, and with its older
  emitters instead of its MLIR fusion emitters (half the compile time). Both
  round the same in any two programs, but the older emitters do not fuse and
  round as the default ones do across programs of different shapes; the tests
  that claim two such programs agree bit for bit (``users_compiler``) run, all
  together, in one child process that compiles with the default emitters.
* Every compiled program goes to a persistent cache that lives as long as the
  run, in a temporary directory that pytest-xdist's workers and the
  subprocesses the tests start (workers, launchers, examples) share through the
  environment, so that a program compiled twice, in two tests or two processes,
  compiles once.
"""

import atexit
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # read when jax is imported
# The accelerator compilers the test extra installs (tests/test_accelerators.py) log at INFO
# that this machine has no CUDA driver each time a process loads them; the C++ logger reads
# the level when it starts, so it is set before jax is imported, for subprocesses too.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
_IN_CHILD = "ZEROJAX_TESTS_USERS_COMPILER"  # set in the child process, to its report file
_FAST_COMPILE = ["--xla_backend_optimization_level=0"]
if not os.environ.get(_IN_CHILD):
  _FAST_COMPILE.append("--xla_cpu_use_fusion_emitters=false")
for _flag in _FAST_COMPILE:  # xdist's workers inherit them from the process that starts them
  if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()
# pytest-xdist's workers inherit the variable from the process that made the directory (and
# removes it at exit), so they share one cache too.
_CACHE = os.environ.get("ZEROJAX_TESTS_JAX_CACHE")
if _CACHE is None:
  _CACHE = tempfile.mkdtemp(prefix="zerojax-tests-jax-cache-")
  atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ.update(
  ZEROJAX_TESTS_JAX_CACHE=_CACHE,
  JAX_COMPILATION_CACHE_DIR=_CACHE,
  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
)

import jax  # noqa: E402 (the environment above is read when jax is imported)
import pytest  # noqa: E402

import zerojax  # noqa: E402

zerojax.distributed.use_cpu_devices(8)


@pytest.fixture(autouse=True, scope="session")
def _eight_devices():
  assert jax.device_count() == 8, "tests need 8 devices; did something start JAX before conftest?"


@pytest.fixture
def mesh():
  return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def pytest_configure(config):
  config.addinivalue_line(
    "markers",
    "users_compiler: compares the numbers of two programs of different shapes bit for bit, so "
    "it runs (with the other such tests) in a child process compiled as users compile",
  )


_GROUP = "@users_compiler"


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
  for item in items:  # one xdist worker starts the child for all of them (--dist loadgroup)
    if item.get_closest_marker("users_compiler"):
      item.add_marker(pytest.mark.xdist_group("users_compiler"))


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
  if os.environ.get(_IN_CHILD) or not pyfuncitem.get_closest_marker("users_compiler"):
    return None
  __tracebackhide__ = True
  marked = [i.nodeid for i in pyfuncitem.session.items if i.get_closest_marker("users_compiler")]
  ids = tuple(nodeid.removesuffix(_GROUP) for nodeid in marked)  # xdist appends the group
  outcomes = _in_a_child(ids, str(pyfuncitem.config.rootpath))
  outcome, text = outcomes[pyfuncitem.nodeid.removesuffix(_GROUP)]
  if outcome != "passed":
    pytest.fail(f"{outcome} in a process that compiles with XLA's default emitters:\n{text}")
  return True


@functools.cache
def _in_a_child(ids: tuple[str, ...], root: str) -> dict[str, tuple[str, str]]:
  """Runs the tests ``ids`` in one child pytest without the older emitters; their outcomes."""
  report = os.path.join(_CACHE, f"users-compiler-{os.getpid()}.json")
  flags = [f for f in os.environ["XLA_FLAGS"].split() if "fusion_emitters" not in f]
  env = {**os.environ, _IN_CHILD: report, "XLA_FLAGS": " ".join(flags)}
  command = [sys.executable, "-m", "pytest", "-q", "-n", "0", *ids]
  done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
  if not os.path.exists(report):
    raise RuntimeError(f"the child pytest reported nothing:\n{done.stdout[-3000:]}{done.stderr}")
  with open(report) as lines:
    outcomes = dict(json.loads(line) for line in lines)
  missing = {i: ("not run", done.stdout[-3000:]) for i in ids if i not in outcomes}
  return {**outcomes, **missing}


def pytest_runtest_logreport(report):
  if os.environ.get(_IN_CHILD) and (report.when == "call" or report.outcome != "passed"):
    with open(os.environ[_IN_CHILD], "a") as lines:
      print(json.dumps([report.nodeid, [report.outcome, report.longreprtext]]), file=lines)
