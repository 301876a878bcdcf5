"""Every pytest run, of the tests or of the doctests under zerojax/ alone, sees 8 CPU devices."""

import pytest

from tests import environment

environment.prepare()  # before JAX is imported: it reads the environment then

#: Seconds each module takes on CI (a worker's wall time, from a run of the suite; the doctests of a
#: zerojax module under its name, the tests beside one under theirs, ``*_test``), rounded; the
#: ``*_test`` modules and what they left behind are estimated from local runs. pytest-xdist hands
#: whole modules to its workers in collection order (``--no-loadscope-reorder`` in pyproject.toml),
#: so the longest go first and the short ones fill in around them, instead of a long one starting
#: last and running alone. The long ones include those that mostly wait on subprocesses (SLURM,
#: restarts), which start early so that the others fill the cores meanwhile. A module not listed
#: counts as shorter than any listed.
MODULE_SECONDS = {
  "test_equivalence": 143,
  "test_overlap": 135,
  "test_examples": 120,
  "test_offload": 113,
  "test_fault_tolerance": 104,
  "test_slurm": 103,
  "test_pipeline": 103,
  "test_multiprocess": 88,
  "test_checkpoint": 79,
  "test_docs": 75,
  "test_flax": 66,
  "test_big_models": 60,
  "test_accelerators": 80,
  "test_user_layers": 50,
  "test_plan": 60,
  "test_export_pretrained": 40,
  "test_activation_offload": 35,
  "test_quantize": 46,
  "test_pipeline_models": 45,
  "test_nonfinite": 45,
  "test_meshes": 38,
  "test_memory_and_communication": 36,
  "test_precision": 30,
  "test_api": 29,
  "test_elastic": 28,
  "test_hpz": 27,
  "ordering_test": 26,
  "test_bad_input": 24,
  "quantized_test": 16,
  "test_huggingface": 30,
  "test_forward": 13,
  "test_nodes": 13,
  "linen": 12,
  "test_accumulation": 12,
  "test_estimate": 12,
  "test_init": 10,
  "test_load_multiprocess": 30,
  "layout_test": 9,
  "test_transformation": 9,
  "test_equinox": 8,
  "export_test": 7,
  "test_cli_errors": 7,
  "test_export": 6,
  "test_packed_gathers": 6,
  "nnx": 6,
  "scan": 6,
  "test_randomness": 5,
}


def pytest_configure(config: pytest.Config) -> None:
  # pytest-xdist's controller only hands tests out: JAX is for the processes that run them
  # (its workers, or this one with -n 0), and starting it here would delay the workers' start.
  distributing = getattr(config.option, "numprocesses", None) and not config.option.collectonly
  if distributing and not hasattr(config, "workerinput"):
    return
  import zerojax

  zerojax.distributed.use_cpu_devices(8)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
  seconds = lambda item: MODULE_SECONDS.get(item.path.stem, 0)
  items.sort(key=seconds, reverse=True)  # stable: modules stay whole, in their order if unlisted


@pytest.fixture(autouse=True, scope="session")
def _eight_devices():
  import jax

  assert jax.device_count() == 8, "tests need 8 devices; did something start JAX before conftest?"
