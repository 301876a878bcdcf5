"""A checkpoint's parameters as full-precision host arrays, or one ``.safetensors`` file.

Offline: it needs the checkpoint directory, not the mesh that trained it.
Each leaf is read alone, already unpadded, from the full-precision copy of the
parameters the checkpoint recorded (the master copy when the training kept one
apart), so host memory holds about two leaves' worth at a time (Orbax's read
of one leaf and its float32 copy), whatever the model's size.

From the command line (also installed as ``zerojax-export``)::

  python -m zerojax.export CHECKPOINT_DIR model.safetensors [--step N]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import math
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from zerojax._src.checkpoint import directory as directory_lib
from zerojax._src.checkpoint import master as master_lib
from zerojax._src.checkpoint import spec as spec_lib
from zerojax._src.checkpoint import tensor_files


def full_precision(dtype: np.dtype) -> np.dtype:
  """float32 for floating dtypes narrower than it; other dtypes unchanged."""
  dtype = np.dtype(dtype)
  if jnp.issubdtype(dtype, np.floating) and dtype.itemsize < 4:
    return np.dtype(np.float32)
  return dtype


class _Leaf(NamedTuple):
  keys: list[str | int]  # from the state's root
  name: list[str | int]  # from the parameters' root
  shape: tuple[int, ...]
  dtype: np.dtype  # as saved


@contextlib.contextmanager
def _master_leaves(directory: str | os.PathLike, step: int | None):
  """Yields the full-precision parameters' leaves, a function that reads one, and their tree.

  The tree is the saved parameters' containers (dicts and lists) with Orbax's
  metadata as leaves.
  """
  if jax.process_count() > 1:
    raise RuntimeError(
      f"exporting reads a checkpoint in one process, but this is process "
      f"{jax.process_index()} of a {jax.process_count()}-process job. Export after "
      "training, from one process: python -m zerojax.export CHECKPOINT_DIR "
      "model.safetensors (or, inside the job, zerojax.distributed.gather_to_host(tx, "
      "tx.master_params(params, opt_state), process=0) for the full-precision copy)."
    )
  with (
    _quiet(_READ_ONLY_NOTICE),
    directory_lib.open_manager(
      directory, read_only=True, create=False, save_interval_steps=0
    ) as manager,
  ):
    step, layout = directory_lib.read_layout(manager, step)
    prefix = layout["master_path"]
    leaves = [
      _Leaf(
        leaf["keys"], leaf["keys"][len(prefix) :], tuple(leaf["shape"]), np.dtype(leaf["dtype"])
      )
      for leaf in layout["leaves"].values()
      if leaf["keys"][: len(prefix)] == prefix
    ]
    # The containers as Orbax saved them (tuples become lists), which a read's
    # template must repeat.
    saved = manager.item_metadata(step)["state"].tree
    yield leaves, functools.partial(_read, manager, step, saved), master_lib.at(saved, prefix)


# Orbax logs this warning whenever a read-only manager is made or used: what
# export asks for, so nothing to warn about.
_READ_ONLY_NOTICE = "Given directory is read only"


@contextlib.contextmanager
def _quiet(notice: str):
  """Drops log records containing ``notice`` from the ``absl`` logger, while inside."""
  drop = lambda record: notice not in record.getMessage()
  logger = logging.getLogger("absl")
  logger.addFilter(drop)
  try:
    yield
  finally:
    logger.removeFilter(drop)


def _read(manager: ocp.CheckpointManager, step: int, saved: Any, leaf: _Leaf) -> np.ndarray:
  """One leaf on the host, in its logical shape (reading the logical region drops the padding)."""
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  restore_args = ocp.ArrayRestoreArgs(sharding=device, global_shape=leaf.shape, strict=False)
  args = ocp.args.PyTreeRestore(
    item=_only(saved, leaf.keys, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)),
    restore_args=_only(saved, leaf.keys, restore_args),
  )
  restored = master_lib.at(
    manager.restore(step, args=ocp.args.Composite(state=args))["state"], leaf.keys
  )
  array = np.asarray(restored)
  del restored
  widened = array.astype(full_precision(array.dtype), copy=False)
  del array
  return widened


def _only(saved: Any, keys: list[str | int], value: Any) -> Any:
  """``saved``'s tree with ``value`` at ``keys`` and placeholders (not read) everywhere else."""
  if not keys:
    return value
  template = jax.tree.map(lambda _: ocp.PLACEHOLDER, saved)
  parent = master_lib.at(template, keys[:-1])
  parent[keys[-1]] = value
  return template


def load_params(directory: str | os.PathLike, *, step: int | None = None) -> Any:
  """The checkpoint's full-precision parameters, unpadded, as nested dicts and lists of arrays.

  Args:
    directory: a directory of ``zerojax`` checkpoints.
    step: which checkpoint; the latest by default.

  Returns:
    The parameters, in the parameter tree's dicts, with lists where it had
    lists or tuples (Orbax saves both as lists); floating leaves in float32 or
    wider.

  Example:
    >>> import tempfile, jax, jax.numpy as jnp, optax, zerojax
    >>> tx = zerojax.zero3(optax.adam(1e-3), mesh=jax.make_mesh((jax.device_count(),), ("data",)))
    >>> full = {"w": jnp.ones((5, 1001), jnp.bfloat16)}
    >>> params = tx.shard(full)
    >>> directory = tempfile.mkdtemp()
    >>> spec = zerojax.train_state_spec(tx, full)
    >>> with zerojax.CheckpointManager(directory, spec) as checkpoints:
    ...   checkpoints.save(0, {"params": params, "opt_state": tx.init(params)})
    True
    >>> params = zerojax.load_params(directory)
    >>> params["w"].shape, params["w"].dtype
    ((5, 1001), dtype('float32'))
  """
  with _master_leaves(directory, step) as (leaves, read, saved):
    by_name = {tuple(leaf.name): leaf for leaf in leaves}
    return jax.tree_util.tree_map_with_path(
      lambda path, _: read(by_name[tuple(spec_lib.key_name(key) for key in path)]), saved
    )


def export_safetensors(
  directory: str | os.PathLike, path: str | os.PathLike, *, step: int | None = None
) -> dict[str, jax.ShapeDtypeStruct]:
  """Writes the checkpoint's full-precision parameters to one ``.safetensors`` file.

  Leaves are read, converted and written one at a time (peak host memory is
  about two of the largest leaf in float32, whatever the model's size). A
  tensor's name is its path in the parameters, keys joined with ``"."``;
  floating leaves are written in float32 (or wider, if they are).

  Args:
    directory: a directory of ``zerojax`` checkpoints.
    path: the file to write.
    step: which checkpoint; the latest by default.

  Returns:
    ``{name: jax.ShapeDtypeStruct}`` of the tensors written.

  Raises:
    ValueError: for a dtype safetensors cannot hold, two parameters whose keys
      join to the same name, or a ``path`` that is a directory or whose
      directory does not exist (checked before anything is read).

  Example:
    >>> import os, tempfile, jax, jax.numpy as jnp, optax, zerojax
    >>> tx = zerojax.zero2(optax.sgd(0.1), mesh=jax.make_mesh((jax.device_count(),), ("data",)))
    >>> params = {"layer": {"kernel": jnp.ones((4, 1024))}}
    >>> directory = tempfile.mkdtemp()
    >>> with zerojax.CheckpointManager(directory, zerojax.train_state_spec(tx, params)) as saver:
    ...   saver.save(0, {"params": tx.shard(params), "opt_state": tx.init(params)})
    True
    >>> zerojax.export_safetensors(directory, os.path.join(directory, "model.safetensors"))
    {'layer.kernel': ShapeDtypeStruct(shape=(4, 1024), dtype=float32)}

    From a shell: ``python -m zerojax.export CHECKPOINT_DIR model.safetensors``.
  """
  check_output(path)
  with _master_leaves(directory, step) as (leaves, read, _):
    # The header, which lists every tensor's offsets, comes first; the layout
    # record gives the shapes, so the data can follow leaf by leaf.
    tensors = {}
    for leaf in leaves:
      name = ".".join(str(key) for key in leaf.name)
      if name in tensors:
        raise ValueError(
          f"two parameters would both be called {name!r} in the safetensors file "
          f"(keys joined with '.'): rename one, or use load_params to get the tree."
        )
      tensors[name] = jax.ShapeDtypeStruct(leaf.shape, full_precision(leaf.dtype))
    header = tensor_files.header_bytes(tensors)
    # Written beside ``path`` and renamed when complete, so that a failed export
    # neither leaves a partial file nor destroys an earlier one.
    partial = f"{os.fspath(path)}.partial"
    try:
      with open(partial, "wb") as file:
        file.write(header)
        for leaf in leaves:  # one expression, so that no leaf outlives its write
          file.write(tensor_files.data_bytes(read(leaf)))
      os.replace(partial, path)
    finally:
      with contextlib.suppress(FileNotFoundError):
        os.remove(partial)
  return tensors


def check_output(path: str | os.PathLike) -> None:
  """Raises a ``ValueError`` unless ``path`` can be written as a file: not a directory, in one."""
  path = os.path.abspath(path)
  if os.path.isdir(path):
    raise ValueError(
      f"{path} is a directory; name the .safetensors file to write, e.g. "
      f"{os.path.join(path, 'model.safetensors')}."
    )
  parent = os.path.dirname(path)
  if not os.path.isdir(parent):
    raise ValueError(f"{parent} does not exist (or is not a directory): create it first.")


def main(argv: list[str] | None = None) -> None:
  """``python -m zerojax.export``: a checkpoint's parameters to one ``.safetensors`` file.

  Example:
    From a shell (installed as ``zerojax-export`` too)::

      python -m zerojax.export ckpt model.safetensors --step 600
  """
  parser = argparse.ArgumentParser(
    prog="python -m zerojax.export",
    description="Write a zerojax checkpoint's full-precision parameters, unpadded, to one "
    ".safetensors file, one leaf at a time (host memory holds about two leaves). Needs only "
    "the checkpoint directory, not the devices that trained it.",
  )
  parser.add_argument("checkpoint_dir", help="a directory of zerojax checkpoints")
  parser.add_argument("output", help="the .safetensors file to write")
  parser.add_argument("--step", type=int, default=None, help="which checkpoint (the latest)")
  args = parser.parse_args(argv)
  try:
    check_output(args.output)
  except ValueError as error:
    parser.error(str(error))
  try:
    tensors = export_safetensors(args.checkpoint_dir, args.output, step=args.step)
  except (OSError, ValueError) as error:
    parser.exit(1, f"python -m zerojax.export: error: {error}\n")
  size = sum(math.prod(t.shape) * t.dtype.itemsize for t in tensors.values())
  print(f"wrote {len(tensors)} tensors, {size / 2**20:.2f} MiB, to {args.output}")
