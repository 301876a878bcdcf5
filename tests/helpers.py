"""What the test files share: the stages, exact comparisons, checkpoints (their test model and
states, their padding, exported files), worker and launcher runs.

Test files import from here (and from the models in ``tests/models.py`` and
``tests/multi_axis_model.py``), never from each other; so do the tests beside zerojax's private
modules (``zerojax/_src/<folder>/<module>_test.py``).
"""

import functools
import io
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import chex
import filelock
import jax
import jax.numpy as jnp
import numpy as np
import optax

import zerojax
from tests import environment
from zerojax import launch

#: zerojax's stages by number.
STAGES = {1: zerojax.zero1, 2: zerojax.zero2, 3: zerojax.zero3}

#: How close two programs that compute the same numbers in another order agree after a few
#: steps: 8 devices against plain optax on one, prefetching against not, offloading against
#: not. Their sums meet their terms in another order, or fuse and round another way.
ROUNDING = {"rtol": 2e-5, "atol": 2e-6}
#: The same, for programs whose forward and backward passes compute in bf16 or fp16: their
#: difference starts from a rounding of the compute dtype (2**-8 or 2**-11 relative), not fp32's.
LOW_PRECISION_ROUNDING = {"rtol": 2e-3, "atol": 2e-4}


def rounding(precision: Any) -> dict[str, float]:
  """``ROUNDING``, or ``LOW_PRECISION_ROUNDING`` under a bf16 or fp16 precision policy."""
  policy = zerojax.Precision.named(precision) if isinstance(precision, str) else precision
  fp32 = policy is None or np.dtype(policy.compute_dtype(np.float32)) == np.float32
  return ROUNDING if fp32 else LOW_PRECISION_ROUNDING


#: fp16 compute with fp32 master weights and reductions, and a dynamic loss scale small enough
#: that the clean steps of the test models do not overflow in fp16.
FP16 = zerojax.Precision(
  params="fp32",
  compute="fp16",
  reduce="fp32",
  loss_scale=zerojax.DynamicLossScale(initial=2.0**10, growth_interval=2),
)

#: The checkpoint tests' kinds of mesh axes: jax.make_mesh's default (explicit sharding in
#: types) and the compiler-decides kind.
AXIS_TYPES = {"explicit": jax.sharding.AxisType.Explicit, "auto": jax.sharding.AxisType.Auto}

#: The checkpoint tests' model. "w" has no dimension that 2, 4 or 8 divides, so its stored
#: shape changes with the device count (and stage 1 stores the params unpadded); "b" never
#: pads; "scale" is too small to shard.
CHECKPOINT_MODEL = {
  "w": jax.ShapeDtypeStruct((5, 1001), jnp.float32),
  "b": jax.ShapeDtypeStruct((64, 64), jnp.float32),
  "scale": jax.ShapeDtypeStruct((3,), jnp.float32),
}


@functools.cache
def checkpoint_tx(
  num_devices: int, stage: int, precision: str | None = None, axis_type: str = "auto"
):
  """One transformation per setting of the checkpoint tests, shared (and its compiled steps).

  Without ``precision``, every leaf is kept in its own dtype.
  """
  mesh = jax.make_mesh(
    (num_devices,),
    ("data",),
    devices=jax.devices()[:num_devices],
    axis_types=(AXIS_TYPES[axis_type],),
  )
  return STAGES[stage](optax.adam(1e-2), mesh=mesh, precision=precision)


def random_state(spec: zerojax.StateSpec) -> Any:
  """A state of ``spec`` with random values in every leaf, without compiling a step.

  Padding is zeros, and a separate master copy's parameters are that copy
  rounded to their dtype, as ``tx.shard`` makes them: what a restore remakes.
  """
  rng = np.random.default_rng(0)

  def fill(logical, stored):
    if jnp.issubdtype(logical.dtype, jnp.floating):
      values = rng.standard_normal(logical.shape).astype(logical.dtype)
    else:
      values = rng.integers(0, 100, logical.shape).astype(logical.dtype)
    return pad_to(values, stored)

  state = jax.tree.map(fill, spec.logical, spec.stored)
  master = state["opt_state"].master
  if master is not None:
    params = jax.tree.map(
      lambda x, struct: pad_to(x.astype(struct.dtype), struct),
      unpadded(master, spec.logical["params"]),
      spec.stored["params"],
    )
    state = {**state, "params": params}
  return state


def pad_to(values: np.ndarray, stored: jax.ShapeDtypeStruct) -> jax.Array:
  """``values`` zero-padded at the end of each dimension to ``stored``'s shape, placed as it."""
  padded = np.zeros(stored.shape, values.dtype)
  padded[tuple(slice(0, n) for n in values.shape)] = values
  return jax.device_put(padded, stored.sharding)


def checkpoint_spec(tx, model=CHECKPOINT_MODEL):
  """The training state spec of ``tx`` on ``model``, with a step and an rng."""
  return zerojax.train_state_spec(tx, model, step=jnp.int32(0), rng=jax.random.PRNGKey(0))


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
  """An independent reader of the format: 8-byte header length, JSON header, raw data."""
  with open(path, "rb") as file:
    header = json.loads(file.read(int.from_bytes(file.read(8), "little")))
    data = file.read()
  dtypes = {"F32": np.float32, "I32": np.int32}
  return {
    name: np.frombuffer(data[begin:end], dtypes[info["dtype"]]).reshape(info["shape"])
    for name, info in header.items()
    for begin, end in [info["data_offsets"]]
  }


def save_for_export(directory: Path, tx: Any, full: Any) -> Any:
  """Saves ``tx``'s state of the parameters ``full`` as step 0; returns them as stored."""
  params = tx.shard(full)
  with zerojax.CheckpointManager(directory, zerojax.train_state_spec(tx, full)) as checkpoints:
    checkpoints.save(0, {"params": params, "opt_state": tx.init(full)})
  return params


#: Trains a fast model in its own process, saving checkpoints (``tests/checkpoint_worker.py``).
CHECKPOINT_WORKER = Path(__file__).with_name("checkpoint_worker.py")
CHECKPOINT_WORKER_STEPS = 6


def as_bits(tree: Any) -> list[np.ndarray]:
  """Every leaf's bits, as unsigned integers of its width.

  ``chex.assert_trees_all_equal(as_bits(a), as_bits(b))`` says ``a`` and ``b``
  are the same bit for bit: -0.0 is not 0.0, and a NaN is its own payload.
  """
  return [np.asarray(x).view(f"u{np.asarray(x).dtype.itemsize}") for x in jax.tree.leaves(tree)]


def is_stored(x: Any) -> bool:
  return isinstance(x, zerojax.Stored)


def arrays(tree: Any) -> Any:
  """``tree`` with each ``zerojax.Stored`` replaced by its stored array (a plain tree)."""
  return jax.tree.map(lambda x: x.value if is_stored(x) else x, tree, is_leaf=is_stored)


def unpadded(tree: Any, logical: Any) -> Any:
  """Every leaf on the host, cut to ``logical``'s shapes; checks what is cut off is zeros."""

  def unpad(x, logical):
    x = np.asarray(x)
    inside = tuple(slice(0, n) for n in logical.shape)
    padding = x.copy()
    padding[inside] = 0
    assert not padding.any(), "padding must stay zeros"
    return x[inside]

  return jax.tree.map(unpad, arrays(tree), logical)


def assert_placed(state: Any, spec: zerojax.StateSpec) -> None:
  """``state`` has the stored shapes, dtypes and shardings (memory kinds too) of ``spec``."""
  chex.assert_trees_all_equal_shapes_and_dtypes(state, spec.stored)
  for x, stored in zip(jax.tree.leaves(state), jax.tree.leaves(spec.stored), strict=True):
    assert x.sharding.is_equivalent_to(stored.sharding, x.ndim), (x.sharding, stored.sharding)


def run_checkpoint_worker(
  directory: Path, fault: str, max_restarts: int
) -> subprocess.CompletedProcess:
  """``CHECKPOINT_WORKER`` under ``python -m zerojax_launch``, with ``fault`` injected."""
  return subprocess.run(
    [
      *(sys.executable, "-m", "zerojax_launch", "-n", "1", "--max-restarts", str(max_restarts)),
      *("--timeout", "200", str(CHECKPOINT_WORKER), "train", str(directory)),
      str(CHECKPOINT_WORKER_STEPS),
    ],
    cwd=environment.ROOT,
    env=environment.subprocess_env(CHECKPOINT_WORKER_FAULT=fault),
    capture_output=True,
    text=True,
    timeout=240,
  )


def final_params(directory: Path) -> dict[str, np.ndarray]:
  """The parameters ``CHECKPOINT_WORKER`` saved at its last step, by name."""
  return dict(np.load(directory / "final.npz"))


def computed_once(name: str, compute: Callable[[Path], object]) -> Path:
  """The directory ``compute(directory)`` filled, once a test run, whichever worker asks first.

  pytest-xdist's workers share the run's temporary directory (``tests/environment.py``):
  the first to ask computes under a lock while the others wait, then every one reads
  the same files. A computation that failed is made again by the next to ask.
  """
  root = Path(os.environ["ZEROJAX_TESTS_JAX_CACHE"])
  directory, done = root / name, root / f"{name}.done"
  with filelock.FileLock(root / f"{name}.lock"):
    if not done.exists():
      shutil.rmtree(directory, ignore_errors=True)
      directory.mkdir()
      compute(directory)
      done.touch()
  return directory


def launch_worker(script: str, *args: str) -> None:
  """Runs ``script *args`` (a file under tests/) as 2 processes of 4 CPU devices, to its end."""
  done = subprocess.run(
    [
      *(sys.executable, "-m", "zerojax_launch", "-n", "2", "--devices-per-process", "4"),
      *("--timeout", "300", script, *args),
    ],
    cwd=environment.ROOT,
    env=environment.subprocess_env(),
    capture_output=True,
    text=True,
    timeout=330,
  )
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def launch_code(code: str, **options: Any) -> tuple[int, str]:
  """``zerojax.launch`` of ``python -c code`` (2 processes unless told): status and messages."""
  err = io.StringIO()
  options = {"num_processes": 2, **options}
  status = launch.launch(
    [sys.executable, "-c", code], stdout=io.StringIO(), stderr=err, timeout=60, **options
  )
  return status, err.getvalue()
