"""Checks of what users pass to a ZeRO-wrapped optimizer, with errors that say how to fix it."""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from zerojax._src.sharding import layout as layout_lib

if TYPE_CHECKING:
  from zerojax._src.core.settings import Settings


def params(tree: Any, stored: layout_lib.Layout, settings: Settings) -> None:
  """Raises unless ``tree`` holds parameters as ``tx.shard`` places them for ``settings``."""
  for (path, x), leaf in zip(
    jax.tree_util.tree_flatten_with_path(tree)[0], stored.leaves, strict=True
  ):
    where = f"params{jax.tree_util.keystr(path)}"
    if tuple(np.shape(x)) != leaf.stored_shape:
      raise ValueError(
        f"{where} has shape {np.shape(x)} but stage {settings.stage.number} stores it as "
        f"{leaf.stored_shape}: place the params with tx.shard(params) first."
      )
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
      raise ValueError(
        f"{where} is {leaf.dtype}, and a gradient is taken only of floating-point "
        "parameters: keep integer and boolean leaves (step counters, masks, ids) out of "
        "the trained params, and pass them to the loss as batch arguments or by closure."
      )
  on_mesh(tree, settings.mesh, "params", "place the params with tx.shard(params)")


def not_manual(settings: Settings) -> None:
  """Raises if ``value_and_grad`` runs where its batch axes are already manual.

  Its ``shard_map`` would bind them a second time, which XLA refuses to lower
  ("Cannot lower jaxpr with verifier errors").
  """
  bound = sorted(set(jax.sharding.get_abstract_mesh().manual_axes) & set(settings.batch_axes))
  if bound:
    raise ValueError(
      f"zerojax.value_and_grad was called where the mesh axes {bound} are already manual "
      "(inside a jax.shard_map over them, or inside zerojax.pipeline's stage_fn), and its "
      "own shard_map over them would bind them again. Call it around the whole loss: "
      "inside loss_fn, run the pipeline stages with zerojax.pipeline, and put code that must "
      "run per stage in its stage_fn or loss_fn (a differentiated jax.shard_map of your own "
      "does not lower inside value_and_grad)."
    )


def on_mesh(tree: Any, mesh: Mesh, what: str, fix: str) -> None:
  """Raises if a leaf of ``tree`` lives on another mesh than ``mesh``, saying ``fix``.

  Concrete arrays are compared by their mesh; inside ``jax.jit`` a tracer
  carries the abstract mesh of its input, which is compared by axis names and
  sizes (a 4-device transformation's arrays fed to an 8-device one, say).
  """
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    where = f"{what}{jax.tree_util.keystr(path)}"
    if isinstance(x, Tracer):
      found = jax.typeof(x).sharding.mesh
      if found.empty or found.shape_tuple == mesh.abstract_mesh.shape_tuple:
        continue
    else:
      found = getattr(getattr(x, "sharding", None), "mesh", None)
      if found is None or found == mesh:
        continue
    raise ValueError(
      f"{where} lives on a mesh of {_shown(found)}, not on this transformation's mesh of "
      f"{_shown(mesh)}: {fix}, or build the transformation with that mesh."
    )


def stored_on_mesh(tree: Any, mesh: Mesh, what: str = "params") -> None:
  """``on_mesh`` for stored parameters (or gradients): those of a transformation of another mesh
  are stored for that mesh, and only that transformation can read them."""
  on_mesh(
    tree,
    mesh,
    what,
    "use the transformation that stored them, or move them to this mesh: "
    "tx.shard(that_tx.gather(params))",
  )


def in_device_memory(state: Any, settings: Settings) -> None:
  """Raises if a leaf of ``state`` (a ``ZeroState``) is in host memory where ``settings`` keep it
  in device memory (a state made with ``offload=``, given to a transformation without)."""
  for name in state._fields:
    if name in settings.offload.fields:
      continue
    for path, x in jax.tree_util.tree_flatten_with_path(getattr(state, name))[0]:
      if isinstance(x, Tracer):
        in_host = jax.typeof(x).memory_space == jax.memory.Space.Host
      else:
        in_host = getattr(getattr(x, "sharding", None), "memory_kind", None) in _HOST_KINDS
      if in_host:
        raise ValueError(
          f"opt_state.{name}{jax.tree_util.keystr(path)} is in host memory, but this "
          f"transformation (offload={settings.offload.mode!r}) keeps it in device memory: "
          "update the state with the transformation that made it (the same offload=), or "
          "bring it to device memory first: jax.device_put(opt_state, tx.state_shardings(params))."
        )


_HOST_KINDS = ("pinned_host", "unpinned_host")


def same_on_every_process(tree: Any, what: str, fix: str) -> None:
  """In a multi-process run, raises unless every process passes ``tree`` with the same structure,
  shapes and dtypes (one tiny all-gather of a checksum, which has one size on every process,
  unlike the arrays: a collective of arrays that differ would abort in gloo).

  Raises:
    ValueError: naming the processes that differ from process 0, and this one's leaves.
  """
  if jax.process_count() == 1:
    return
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  described = [
    f"{jax.tree_util.keystr(path) or '(root)'}: {np.shape(x)} {np.result_type(x)}"
    for path, x in leaves
  ]
  signature = zlib.crc32(repr((str(treedef), described)).encode())
  everyone = np.asarray(multihost_utils.process_allgather(np.uint32(signature))).ravel()
  differ = [int(p) for p in np.flatnonzero(everyone != everyone[0])]
  if differ:
    raise ValueError(
      f"the processes' {what} differ: process(es) {differ} passed another structure, shapes "
      f"or dtypes than process 0. {fix} Process {jax.process_index()} passed "
      f"{{{', '.join(described)}}}."
    )


def same_model_on_every_process(params: Any) -> None:
  """``same_on_every_process`` for the parameters: every process must build the same model."""
  same_on_every_process(
    params, "parameters", "Every process must build the same model (the same code, flags, config)."
  )


def _shown(mesh: Any) -> str:
  axes = ", ".join(f"{name!r}: {size}" for name, size in mesh.shape_tuple)
  return f"{{{axes}}}"


def batch(arguments: tuple[Any, ...], settings: Settings, microbatches: int) -> None:
  """Raises unless every batch leaf splits evenly, and all agree on the batch size."""
  n = settings.num_shards * settings.num_replicas
  first = None
  for index, argument in enumerate(arguments):
    for path, x in jax.tree_util.tree_flatten_with_path(argument)[0]:
      shape, where = np.shape(x), f"batch argument {index}{jax.tree_util.keystr(path)}"
      if not shape or shape[0] % (n * microbatches):
        raise ValueError(
          f"{where} has shape {shape}: its leading dimension must divide by the "
          f"{_split(settings, microbatches)}. Use a batch size that is a multiple of "
          f"{n * microbatches}; pass per-step constants by closing over them instead of "
          "as batch arguments."
        )
      if first is None:
        first = (where, shape[0], _is_key(x))
      elif shape[0] != first[1]:
        keys = _is_key(x) or first[2]
        raise ValueError(
          f"{where} has {shape[0]} rows but {first[0]} has {first[1]}: every batch "
          "argument is split along its leading axis, so they must agree (each device "
          "would pair rows that do not belong together). Pass arrays of the same batch "
          "size, and per-step constants by closing over them."
          + (_KEYS.format(rows=max(shape[0], first[1])) if keys else "")
        )


#: What ``batch`` adds when a mismatched batch argument holds random keys.
_KEYS = (
  " Random keys are a batch argument like any other, split with the batch: give one key per "
  "example, jax.random.split(key, {rows}), and draw each example's numbers from its own key "
  "(jax.vmap over the examples), which gives the numbers one device gives on the whole batch; "
  "for one key per device, close over the key and fold in "
  "jax.lax.axis_index(tx.batch_axes) instead. See docs/guide.md, 'Randomness: dropout'."
)


def _is_key(x: Any) -> bool:
  """Whether ``x`` is an array of random keys: typed (``jax.random.key``) or raw uint32 pairs."""
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    return False
  if jnp.issubdtype(dtype, jax.dtypes.prng_key):
    return True
  return np.dtype(dtype) == np.uint32 and np.ndim(x) == 2 and np.shape(x)[-1] == 2


def _split(settings: Settings, microbatches: int) -> str:
  n, axes = settings.num_shards * settings.num_replicas, settings.batch_axes
  named = f"mesh axes {axes}" if len(axes) > 1 else f"mesh axis {''.join(axes)!r}"
  split = f"{n} devices of {named}"
  if settings.replica_axes:
    split += f" ({settings.num_replicas} replicas x {settings.num_shards} shards)"
  if microbatches > 1:
    split += f" times {microbatches} micro-batches"
  return split


def full_precision(tree: Any, sharded: layout_lib.Layout) -> None:
  """Raises unless ``tree``'s float leaves are in the master dtype (for ``init``'s master copy)."""
  for (path, x), leaf in zip(
    jax.tree_util.tree_flatten_with_path(tree)[0], sharded.leaves, strict=True
  ):
    if np.dtype(x.dtype) != leaf.dtype:
      raise ValueError(
        f"init makes the {leaf.dtype} master copy of the parameters, but "
        f"params{jax.tree_util.keystr(path)} is {np.dtype(x.dtype)}: call "
        "tx.init(params) on the full-precision parameters, before tx.shard(params) "
        f"casts them (or cast them with jax.tree.map(lambda p: p.astype('{leaf.dtype}'), params))."
      )


def shapes(tree: Any, layout: layout_lib.Layout, what: str) -> None:
  """Raises unless ``tree`` has ``layout``'s structure and stored shapes."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  if treedef != layout.treedef:
    raise ValueError(
      f"{what} does not have the structure this transformation expects: got "
      f"{treedef}, expected {layout.treedef}. Use the {what} that init returned "
      "for these parameters."
    )
  for (path, x), leaf in zip(leaves, layout.leaves, strict=True):
    if tuple(np.shape(x)) != leaf.stored_shape:
      raise ValueError(
        f"{what} leaf {jax.tree_util.keystr(path)} has shape {np.shape(x)}, "
        f"expected {leaf.stored_shape}: it was made for another model, stage "
        "or device count."
      )
