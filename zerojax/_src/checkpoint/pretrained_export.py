"""Parameters out in another framework's layout: ``load_safetensors``' ``keys=`` run backwards.

A scanned leaf goes back to one tensor a layer, a transpose is undone, values
are cast (to bfloat16, say) and names mapped, into HuggingFace's sharded
layout: ``model-00001-of-0000N.safetensors`` files of whole tensors and
``model.safetensors.index.json`` naming each tensor's file (or one
``model.safetensors``). A safetensors header fixes every tensor's bytes
before any data, so the headers are written first and then each process
writes, with ``pwrite``, the regions of tensors that its devices hold, a piece
(4 MiB) at a time: no process holds more than a piece beyond its shards.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import json
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from zerojax._src.checkpoint import export as export_lib
from zerojax._src.checkpoint import tensor_files
from zerojax._src.checkpoint.load import (
  PIECE_BYTES,
  KeyLike,
  key_of,
  leaf_name,
  pieces_in_order,
  stray_keys,
)
from zerojax._src.core import transformation as zero_lib
from zerojax._src.sharding import stored as stored_lib

#: HuggingFace's largest file by default (``save_pretrained``'s ``max_shard_size="5GB"``).
MAX_FILE_BYTES = 5 * 10**9

Bounds = tuple[tuple[int, int], ...]


class _Region(NamedTuple):
  """A region of a leaf (logical coordinates) that some processes' devices hold whole."""

  bounds: Bounds
  processes: tuple[int, ...]


class _Leaf(NamedTuple):
  """A parameter to write: its name, logical shape and dtype, and the regions held of it."""

  name: str
  shape: tuple[int, ...]
  dtype: np.dtype
  regions: tuple[_Region, ...]


class _Tensor(NamedTuple):
  """A tensor of the files: of which leaf (and which layer of a stacked one), and how."""

  name: str
  leaf: int
  layer: int | None
  transpose: tuple[int, ...]  # the leaf's (layer's) axis j is the tensor's axis transpose[j]
  shape: tuple[int, ...]
  dtype: np.dtype


class _Write(NamedTuple):
  """A region of a leaf that one process writes into a tensor."""

  tensor: int
  bounds: Bounds  # of the leaf, within one layer if the leaf is stacked


def export_pretrained(
  directory: str | os.PathLike,
  tx: zero_lib.ZeroTransformation | None,
  params: Any,
  *,
  keys: Mapping[str, KeyLike] | Callable[[str], KeyLike] | None = None,
  dtype: Any = None,
  metadata: Mapping[str, str] | None = None,
  max_file_bytes: int = MAX_FILE_BYTES,
  step: int | None = None,
) -> dict[str, jax.ShapeDtypeStruct]:
  """Writes parameters in another framework's names and layout, as HuggingFace's sharded files.

  What ``load_safetensors(directory, tx, like, keys=keys)`` reads back into the
  same parameters, onto any stage and device count: the same ``keys`` give
  each leaf's tensors, so the mapping is written once. A leaf mapped to a
  sequence of names (a scanned model's layers) is written as one tensor a
  layer; a ``zerojax.FileKey`` 's transpose is undone (a Flax ``(in, out)``
  kernel goes back to PyTorch's ``(out, in)``). The files are HuggingFace's:
  ``model-00001-of-0000N.safetensors``, each of whole tensors up to
  ``max_file_bytes``, and ``model.safetensors.index.json`` (``weight_map``:
  tensor -> file; ``metadata.total_size``), or one ``model.safetensors`` when
  the tensors fit in one (as ``save_pretrained`` does). Weights files of an
  earlier export in ``directory`` are removed; other files are kept.

  Each process writes the tensors, or regions of tensors, that its devices
  hold, a piece (4 MiB) at a time, each piece brought from its device alone,
  transposed and cast: no host holds more than a piece beyond its shards. A
  tensor held whole by one process is written by it (a replicated one by the
  process with the least to write so far), and files group the tensors by
  writer; one split over processes is written by each into its byte ranges,
  which the header, written first, fixes. On several processes,
  ``directory`` is a filesystem they share; every process calls this.

  Args:
    directory: where to write the files (created if missing).
    tx: the transformation that stores ``params``, whose plans give each
      leaf's logical shape: what a stage 1 or 2 master copy
      (``tx.master_params(params, opt_state)``, padded and split) needs.
      ``None`` for a checkpoint directory or for plain arrays.
    params: the parameters as ``tx`` stores them at any stage (stage 3's
      ``zerojax.Stored`` carry their layout), or their master copy, or plain
      arrays; or a directory of ``zerojax.CheckpointManager`` checkpoints,
      whose full-precision parameters are read one leaf at a time, in one
      process (host memory holds about two of its largest leaf).
    keys: the files' name for each leaf, by the leaf's own name (its path,
      keys joined with ``"."``), as ``load_safetensors`` takes them: a
      mapping (leaves not in it keep their own names) or a function; each
      gives a tensor's name, a sequence of names (one per index of the leaf's
      leading dimension), or a ``zerojax.FileKey``. ``None``: own names.
    dtype: the dtype of floating tensors (``jnp.bfloat16``, say); ``None``
      keeps each leaf's. Integer leaves keep theirs.
    metadata: the headers' ``__metadata__``; ``None`` gives ``{"format":
      "pt"}``, which HuggingFace's loaders require and read as PyTorch's
      names (Flax's, ``FlaxPreTrainedModel.from_pretrained``, reads
      ``{"format": "flax"}`` as its own names and shapes).
    max_file_bytes: the most tensor bytes a file holds (a larger tensor gets
      a file of its own).
    step: for a checkpoint directory, which step; the latest by default.

  Returns:
    ``{name: jax.ShapeDtypeStruct}`` of the tensors written.

  Raises:
    ValueError: before anything is written, naming every leaf whose names
      are not one per layer, whose transpose is not a permutation of its
      tensors' axes, each name two tensors share, and each name ``keys`` maps
      that no leaf has; and, when the files are written (and then removed), a
      value the ``dtype`` cannot hold (1e6 in float16 is inf).

  Example:
    >>> import os, tempfile, jax, jax.numpy as jnp, optax, zerojax
    >>> from safetensors.numpy import load_file
    >>> tx = zerojax.zero3(optax.adam(1e-3), mesh=jax.make_mesh((jax.device_count(),), ("data",)))
    >>> full = {"blocks": {"kernel": jnp.ones((2, 4, 1001))}}  # two layers, (in, out)
    >>> keys = {"blocks.kernel": zerojax.FileKey(["h.0.weight", "h.1.weight"], transpose=(1, 0))}
    >>> directory = tempfile.mkdtemp()
    >>> written = zerojax.export_pretrained(directory, tx, tx.shard(full), keys=keys,
    ...                                     dtype=jnp.bfloat16)
    >>> {name: (t.shape, t.dtype.name) for name, t in written.items()}  # (out, in), bf16
    {'h.0.weight': ((1001, 4), 'bfloat16'), 'h.1.weight': ((1001, 4), 'bfloat16')}
    >>> load_file(os.path.join(directory, "model.safetensors"))["h.1.weight"].shape
    (1001, 4)
    >>> params = zerojax.load_safetensors(directory, tx, full, keys=keys)  # and back
    >>> bool((tx.gather(params)["blocks"]["kernel"] == 1).all())
    True
  """
  directory = Path(directory)
  if max_file_bytes < 1:
    raise ValueError(f"max_file_bytes is the most bytes a file holds, got {max_file_bytes}.")
  metadata = {"format": "pt"} if metadata is None else dict(metadata)
  with _source(tx, params, step) as (leaves, fetch):
    tensors, writes, writers = _plan(leaves, keys, dtype)
    files = _files(tensors, writers, max_file_bytes)
    headers = {file: _header(tensors, indices, metadata) for file, indices in files.items()}
    partials = [directory / f"{file}.partial" for file in files]
    try:
      _everyone(lambda: _create(directory, headers), only=0)
      mine = writes.get(jax.process_index(), [])
      _everyone(lambda: _write(directory, leaves, tensors, mine, headers, fetch))
      _everyone(lambda: _publish(directory, files, tensors), only=0)
    finally:
      if jax.process_index() == 0:
        for partial in partials:
          with contextlib.suppress(FileNotFoundError):
            partial.unlink()
  return {t.name: jax.ShapeDtypeStruct(t.shape, t.dtype) for t in tensors}


#: A leaf's region (logical coordinates), on this process, as a host array.
Fetch = Callable[[int, Bounds], np.ndarray]


@contextlib.contextmanager
def _source(tx: Any, params: Any, step: int | None) -> Iterator[tuple[list[_Leaf], Fetch]]:
  """The leaves of ``params`` (a tree, or a checkpoint directory) and a function that fetches a
  region of one."""
  if isinstance(params, (str, os.PathLike)):
    with export_lib._master_leaves(params, step) as (saved, read, _):
      leaves = [
        _Leaf(
          ".".join(str(key) for key in leaf.name),
          leaf.shape,
          export_lib.full_precision(leaf.dtype),
          (_Region(_whole(leaf.shape), (0,)),),
        )
        for leaf in saved
      ]
      held: dict[int, np.ndarray] = {}  # one leaf, read whole: the writes go leaf by leaf

      def fetch_saved(i: int, bounds: Bounds) -> np.ndarray:
        if i not in held:
          held.clear()
          held[i] = read(saved[i])
        return held[i][_slices(bounds)]

      yield leaves, fetch_saved
    return
  named, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=stored_lib.is_stored)
  shapes = [_logical_shape(x) for _, x in named]
  if tx is not None and not stored_lib.wraps(params):
    # A stage 1 or 2 master copy is stored padded: its plan has the logical shapes.
    shapes = [leaf.shape for leaf in zero_lib.unwrap(tx).plans(params).sharded.leaves]
  values = [x.value if stored_lib.is_stored(x) else x for _, x in named]
  leaves = [
    _Leaf(leaf_name(path), shape, np.dtype(value.dtype), _regions(value, shape))
    for (path, _), shape, value in zip(named, shapes, values, strict=True)
  ]

  def fetch(i: int, bounds: Bounds) -> np.ndarray:
    value = values[i]
    if not isinstance(value, jax.Array):
      return np.asarray(value)[_slices(bounds)]
    out, filled, seen = None, 0, set()
    for shard in value.addressable_shards:
      held = _clipped(_index_bounds(shard.index, value.shape), leaves[i].shape)
      overlap = _overlap(held, bounds) if bounds else ()
      if overlap is None or held in seen:  # not in it, or a replica of a region copied already
        continue
      seen.add(held)
      starts = np.asarray([a - h for (a, _), (h, _) in zip(overlap, held, strict=True)], np.int32)
      # Only the piece leaves its device.
      part = np.asarray(_piece(shard.data, starts, _extent(overlap)))
      if overlap == bounds:
        return part
      if out is None:
        out = np.empty(_extent(bounds), part.dtype)
      out[tuple(slice(a - b, e - b) for (a, e), (b, _) in zip(overlap, bounds, strict=True))] = part
      filled += part.size
    if out is None or filled != out.size:
      raise AssertionError(f"the devices of this process do not hold {bounds} of {leaves[i].name}")
    return out

  yield leaves, fetch


@functools.partial(jax.jit, static_argnums=2)
def _piece(shard: jax.Array, starts: jax.Array, sizes: tuple[int, ...]) -> jax.Array:
  # Starts traced: one program for the pieces of a size, wherever they are.
  return jax.lax.dynamic_slice(shard, tuple(starts), sizes)


def _logical_shape(x: Any) -> tuple[int, ...]:
  return tuple(x.layout.shape) if stored_lib.is_stored(x) else tuple(np.shape(x))


def _regions(value: Any, shape: tuple[int, ...]) -> tuple[_Region, ...]:
  """The distinct non-empty regions of the logical leaf that devices hold, and whose they are."""
  if not isinstance(value, jax.Array):  # on every host
    return (_Region(_whole(shape), tuple(range(jax.process_count()))),)
  held: dict[Bounds, set[int]] = collections.defaultdict(set)
  for device, index in value.sharding.devices_indices_map(tuple(value.shape)).items():
    bounds = _clipped(_index_bounds(index, value.shape), shape)
    if all(a < b for a, b in bounds):
      held[bounds].add(device.process_index)
  return tuple(_Region(bounds, tuple(sorted(p))) for bounds, p in held.items())


def _whole(shape: Sequence[int]) -> Bounds:
  return tuple((0, n) for n in shape)


def _slices(bounds: Bounds) -> tuple[slice, ...]:
  return tuple(slice(a, b) for a, b in bounds)


def _index_bounds(index: Sequence[slice], shape: Sequence[int]) -> Bounds:
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def _clipped(bounds: Bounds, shape: Sequence[int]) -> Bounds:
  """``bounds`` inside the logical ``shape``: the padding cut off."""
  return tuple((min(a, n), min(b, n)) for (a, b), n in zip(bounds, shape, strict=True))


def _plan(
  leaves: list[_Leaf], keys: Any, dtype: Any
) -> tuple[list[_Tensor], dict[int, list[_Write]], list[int | None]]:
  """The tensors of the files; what each process writes of them; and each one's one writer (or
  ``None``: split over processes). The same on every process, from the leaves' shardings.

  Raises:
    ValueError: naming every leaf whose keys do not fit it.
  """
  tensors: list[_Tensor] = []
  problems: list[str] = []
  taken: dict[str, str] = {}
  for i, leaf in enumerate(leaves):
    key = key_of(leaf.name, keys)
    stacked = not isinstance(key.key, str)
    names = [key.key] if isinstance(key.key, str) else list(key.key)
    shape = leaf.shape[1:] if stacked else leaf.shape
    if stacked and (not leaf.shape or len(names) != leaf.shape[0]):
      dimension = f"a leading dimension of {leaf.shape[0]}" if leaf.shape else "a scalar"
      problems.append(
        f"{leaf.name}: {len(names)} names for {dimension}: give one name per layer, or one name "
        "for the whole leaf"
      )
      continue
    transpose = tuple(range(len(shape))) if key.transpose is None else tuple(key.transpose)
    if sorted(transpose) != list(range(len(shape))):
      problems.append(
        f"{leaf.name}: transpose={transpose} is not a permutation of the axes of its "
        f"tensors, {tuple(range(len(shape)))}"
      )
      continue
    file_shape = [0] * len(shape)
    for leaf_axis, file_axis in enumerate(transpose):
      file_shape[file_axis] = shape[leaf_axis]
    out = leaf.dtype
    if dtype is not None and jnp.issubdtype(leaf.dtype, jnp.floating):
      out = np.dtype(dtype)
    for layer, name in enumerate(names):
      if name in taken:
        problems.append(f"{name!r} names both {taken[name]} and {leaf.name}: name each once")
      taken[name] = leaf.name
      tensors.append(
        _Tensor(name, i, layer if stacked else None, transpose, tuple(file_shape), out)
      )
  problems += stray_keys(keys, [leaf.name for leaf in leaves])
  if problems:
    shown = "\n".join(f"  {line}" for line in problems)
    raise ValueError(
      f"keys do not fit the parameters, so nothing was written:\n{shown}\nkeys take what "
      "load_safetensors takes: {leaf name: file name (or names to stack, one per layer, or "
      "zerojax.FileKey(name, transpose=...))}, or a function of the leaf's name."
    )
  writes, writers = _writers(leaves, tensors)
  return tensors, writes, writers


def _writers(
  leaves: list[_Leaf], tensors: list[_Tensor]
) -> tuple[dict[int, list[_Write]], list[int | None]]:
  """Who writes what: a tensor whose every region one process holds, by one of those (the one
  with the least to write so far); else each region by one of the processes holding it. A
  process's regions of a tensor that tile a box are written as that box, whole rows at a time."""
  load: collections.Counter[int] = collections.Counter()
  writes: dict[int, list[_Write]] = collections.defaultdict(list)
  writers: list[int | None] = []
  least = lambda processes: min(processes, key=lambda p: (load[p], p))
  for k, tensor in enumerate(tensors):
    leaf = leaves[tensor.leaf]
    within = _whole(leaf.shape)
    if tensor.layer is not None:  # one layer of the stacked leaf
      within = ((tensor.layer, tensor.layer + 1), *within[1:])
    regions = [
      _Region(overlap, region.processes)
      for region in leaf.regions
      if (overlap := _overlap(region.bounds, within)) is not None
    ]
    common = set.intersection(*(set(r.processes) for r in regions)) if regions else set()
    if common:
      regions = [_Region(r.bounds, (least(common),)) for r in regions]
    mine: dict[int, list[Bounds]] = collections.defaultdict(list)
    for region in regions:
      writer = least(region.processes)
      mine[writer].append(region.bounds)
      load[writer] += math.prod(_extent(region.bounds)) * tensor.dtype.itemsize
    for writer, bounds in mine.items():
      box = _tiled_box(bounds)
      writes[writer] += [_Write(k, b) for b in ([box] if box is not None else bounds)]
    writers.append(next(iter(mine)) if len(mine) == 1 else None)
  return writes, writers


def _tiled_box(regions: list[Bounds]) -> Bounds | None:
  """The box the (disjoint) ``regions`` tile exactly, or ``None`` if they leave gaps in it."""
  box = tuple(
    (min(r[d][0] for r in regions), max(r[d][1] for r in regions)) for d in range(len(regions[0]))
  )
  tiled = math.prod(_extent(box)) == sum(math.prod(_extent(r)) for r in regions)
  return box if tiled else None


def _overlap(a: Bounds, b: Bounds) -> Bounds | None:
  both = tuple((max(x[0], y[0]), min(x[1], y[1])) for x, y in zip(a, b, strict=True))
  return both if all(start < stop for start, stop in both) else None


def _extent(bounds: Bounds) -> tuple[int, ...]:
  return tuple(stop - start for start, stop in bounds)


def _files(
  tensors: list[_Tensor], writers: list[int | None], max_file_bytes: int
) -> dict[str, list[int]]:
  """The files' names and their tensors: grouped by writer (those split over processes last),
  then by layer, in the leaves' order; a new file whenever the next tensor would pass
  ``max_file_bytes`` (HuggingFace's rule)."""
  last = jax.process_count()
  order = sorted(
    range(len(tensors)),
    key=lambda k: (
      last if writers[k] is None else writers[k],
      -1 if tensors[k].layer is None else tensors[k].layer,
      tensors[k].leaf,
    ),
  )
  groups: list[list[int]] = []
  size, writer = 0, object()
  for k in order:
    nbytes = math.prod(tensors[k].shape) * tensors[k].dtype.itemsize
    if not groups or writers[k] != writer or (groups[-1] and size + nbytes > max_file_bytes):
      groups.append([])
      size, writer = 0, writers[k]
    groups[-1].append(k)
    size += nbytes
  if len(groups) <= 1:
    return {WEIGHTS_FILE: groups[0] if groups else []}
  count = len(groups)
  return {f"model-{i + 1:05d}-of-{count:05d}.safetensors": g for i, g in enumerate(groups)}


#: HuggingFace's name for the weights in one file.
WEIGHTS_FILE = "model.safetensors"
#: The names of the weights files of an export (and of HuggingFace's save_pretrained).
_WEIGHTS_FILES = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")


class _Header(NamedTuple):
  """A file's start (its header), and where in the file each of its tensors' data starts."""

  start: bytes
  offsets: dict[int, int]  # by tensor index
  size: int  # the whole file's


def _header(tensors: list[_Tensor], indices: list[int], metadata: dict[str, str]) -> _Header:
  structs = {
    tensors[k].name: jax.ShapeDtypeStruct(tensors[k].shape, tensors[k].dtype) for k in indices
  }
  header = json.loads(tensor_files.header_bytes(structs)[8:])
  if metadata:
    header = {"__metadata__": metadata, **header}
  encoded = json.dumps(header, separators=(",", ":")).encode()
  encoded += b" " * (-len(encoded) % 8)  # the data 8-byte aligned, as HuggingFace's writer does
  start = len(encoded).to_bytes(8, "little") + encoded
  offsets = {k: len(start) + header[tensors[k].name]["data_offsets"][0] for k in indices}
  data = sum(
    header[tensors[k].name]["data_offsets"][1] - header[tensors[k].name]["data_offsets"][0]
    for k in indices
  )
  return _Header(start, offsets, len(start) + data)


def _create(directory: Path, headers: dict[str, _Header]) -> None:
  """Each file, as ``.partial``: its header, then room for its data."""
  directory.mkdir(parents=True, exist_ok=True)
  for file, header in headers.items():
    with open(directory / f"{file}.partial", "wb") as opened:
      opened.write(header.start)
      opened.truncate(header.size)


def _write(
  directory: Path,
  leaves: list[_Leaf],
  tensors: list[_Tensor],
  writes: list[_Write],
  headers: dict[str, _Header],
  fetch: Fetch,
) -> None:
  """This process's ``writes``, a piece at a time, into the files' byte ranges."""
  where = {k: (file, at) for file, header in headers.items() for k, at in header.offsets.items()}
  descriptors: dict[str, int] = {}
  try:
    for write in sorted(writes, key=lambda w: tensors[w.tensor].leaf):  # each leaf once
      tensor = tensors[write.tensor]
      file, offset = where[write.tensor]
      if file not in descriptors:
        descriptors[file] = os.open(directory / f"{file}.partial", os.O_WRONLY)
      layer = write.bounds[1:] if tensor.layer is not None else write.bounds
      region = [(0, 0)] * len(layer)
      for leaf_axis, file_axis in enumerate(tensor.transpose):
        region[file_axis] = layer[leaf_axis]
      itemsize = max(tensor.dtype.itemsize, leaves[tensor.leaf].dtype.itemsize)
      for piece in pieces_in_order(tuple(region), max(1, PIECE_BYTES // itemsize)):
        wanted = tuple(piece[file_axis] for file_axis in tensor.transpose)
        if tensor.layer is not None:
          wanted = ((tensor.layer, tensor.layer + 1), *wanted)
        values = fetch(tensor.leaf, wanted)
        if tensor.layer is not None:
          values = values[0]
        values = np.transpose(values, np.argsort(tensor.transpose))
        values = _cast(tensor, piece, values)
        _write_region(descriptors[file], offset, tensor.shape, piece, values)
  finally:
    for descriptor in descriptors.values():
      os.close(descriptor)


def _cast(tensor: _Tensor, piece: Bounds, values: np.ndarray) -> np.ndarray:
  """``values`` in the tensor's dtype, refusing a finite value it makes infinite."""
  if values.dtype == tensor.dtype:
    return values
  with np.errstate(over="ignore"):
    cast = values.astype(tensor.dtype)
  if jnp.issubdtype(tensor.dtype, jnp.floating):
    lost = np.isinf(cast) & np.isfinite(values)
    if lost.any():
      at = tuple(int(i) for i in np.argwhere(lost)[0])
      index = tuple(start + i for (start, _), i in zip(piece, at, strict=True))
      raise ValueError(
        f"tensor {tensor.name!r} holds {values[at]} (at {index}), beyond the range of "
        f"{tensor.dtype.name}: cast, it would be {cast[at]}. Export in a wider dtype (dtype=None "
        "keeps the parameters'), or rescale the parameter."
      )
  return cast


def _write_region(
  descriptor: int, offset: int, shape: tuple[int, ...], region: Bounds, values: np.ndarray
) -> None:
  """Writes ``values``, ``region`` of the row-major tensor of ``shape`` at ``offset``, one
  contiguous span of the file at a time (the region's extent along its last axis not taken
  whole, times the axes after it)."""
  data = tensor_files.data_bytes(values)
  whole = len(shape)
  while whole and region[whole - 1] == (0, shape[whole - 1]):
    whole -= 1
  if not whole:
    _write_all(descriptor, data, offset)
    return
  steps = [math.prod(shape[axis + 1 :]) * values.dtype.itemsize for axis in range(len(shape))]
  start, stop = region[whole - 1]
  span = (stop - start) * steps[whole - 1]
  outer = itertools.product(*(range(a, b) for a, b in region[: whole - 1]))
  for n, index in enumerate(outer):
    at = offset + start * steps[whole - 1] + sum(i * s for i, s in zip(index, steps, strict=False))
    _write_all(descriptor, data[n * span : (n + 1) * span], at)


def _write_all(descriptor: int, data: memoryview, offset: int) -> None:
  done = 0
  while done < len(data):
    done += os.pwrite(descriptor, data[done:], offset + done)


def _publish(directory: Path, files: dict[str, list[int]], tensors: list[_Tensor]) -> None:
  """The files under their names, the index (for more than one), and an earlier export's gone."""
  for file in files:
    os.replace(directory / f"{file}.partial", directory / file)
  index = directory / tensor_files.INDEX_FILE
  if len(files) > 1:
    weight_map = {tensors[k].name: file for file, indices in files.items() for k in indices}
    total = sum(math.prod(t.shape) * t.dtype.itemsize for t in tensors)
    content = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    index.write_text(json.dumps(content, indent=2) + "\n")
  for path in directory.iterdir():
    stale = _WEIGHTS_FILES.fullmatch(path.name) or (path == index and len(files) == 1)
    if stale and path.name not in files and path.is_file():
      path.unlink()


def _everyone(action: Callable[[], Any], *, only: int | None = None) -> None:
  """Runs ``action`` (on process ``only``, or on every process), then waits for every process:
  if one failed, every one raises."""
  error = None
  if only is None or jax.process_index() == only:
    try:
      action()
    except Exception as raised:  # raised below, once the others know
      error = raised
  failed = [jax.process_index()] if error is not None else []
  if jax.process_count() > 1:
    flags = multihost_utils.process_allgather(np.int32(error is not None))
    failed = [int(p) for p in np.flatnonzero(np.asarray(flags).ravel())]
  if error is not None:
    raise error
  if failed:
    raise RuntimeError(
      f"process {failed[0]} failed to write its part of the export (its own error says why); "
      "nothing was written."
    )
