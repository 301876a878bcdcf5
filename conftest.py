"""Every pytest run, of the tests or of the doctests under zerojax/ alone, sees 8 CPU devices."""

from tests import environment

environment.prepare()  # before JAX is imported: it reads the environment then

import jax  # noqa: E402
import pytest  # noqa: E402

import zerojax  # noqa: E402

zerojax.distributed.use_cpu_devices(8)

#: The test modules that take longest, in wall time, longest first: pytest-xdist hands modules to
#: its workers in collection order (``--no-loadscope-reorder`` in pyproject.toml), so these start
#: first and the short ones fill in around them, instead of a long one starting last and running
#: alone. Those that mostly wait on subprocesses (SLURM, restarts) lead: the others fill the
#: cores meanwhile. The rest keep their order.
LONGEST_FIRST = (
  "test_slurm",
  "test_fault_tolerance",
  "test_examples",
  "test_equivalence",
  "test_multiprocess",
  "test_overlap",
  "test_pipeline",
  "test_offload",
  "test_elastic",
  "test_ordering",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: modules stay whole


@pytest.fixture(autouse=True, scope="session")
def _eight_devices():
  assert jax.device_count() == 8, "tests need 8 devices; did something start JAX before conftest?"
