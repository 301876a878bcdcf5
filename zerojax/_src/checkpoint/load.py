"""Pretrained weights from safetensors files straight into a transformation's shards.

Each array is assembled from the shards this process's devices hold (the
regions ``jax.make_array_from_callback`` would ask it for): they are read from
disk a piece at a time (``tensor_files``), cast, zero-filled where the stored
layout pads, and put on their devices one by one; so no process ever holds a
whole leaf it does not store whole (stage 3), let alone the whole model. On
CPU each shard becomes its device's buffer as it is: a process holds its
shards once, and one piece more.
"""

from __future__ import annotations

import collections
import difflib
import itertools
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding

from zerojax._src.checkpoint import spec as spec_lib
from zerojax._src.checkpoint import tensor_files
from zerojax._src.core import checks
from zerojax._src.core import transformation as zero_lib
from zerojax._src.sharding import layout as layout_lib
from zerojax._src.sharding import stored as stored_lib


class FileKey(NamedTuple):
  """Where one leaf is in the files: one tensor, or one per layer stacked, maybe transposed.

  Attributes:
    key: a tensor's name; or a sequence of names, one per index of the leaf's
      leading dimension, stacked along it (the layers of a model scanned with
      ``zerojax.scan``, which HuggingFace files keep apart as ``h.0``,
      ``h.1``, ...). Only the layers a process's shards hold are read.
    transpose: the permutation of each tensor's axes that gives the leaf's
      (``np.transpose``'s ``axes``): ``(1, 0)`` reads a PyTorch ``Linear``
      weight, stored ``(out, in)``, into a Flax ``Dense`` kernel ``(in,
      out)``. ``None`` keeps the axes.

  Example:
    >>> import zerojax
    >>> zerojax.FileKey([f"h.{i}.mlp.c_fc.weight" for i in range(2)])
    FileKey(key=['h.0.mlp.c_fc.weight', 'h.1.mlp.c_fc.weight'], transpose=None)
  """

  key: str | Sequence[str]
  transpose: Sequence[int] | None = None


#: What ``keys`` gives for a leaf: a tensor's name, names to stack, or a ``FileKey``.
KeyLike = str | Sequence[str] | FileKey


class _Source(NamedTuple):
  """A leaf's tensors in the files: ``stacked`` along a new leading axis or one alone."""

  tensors: tuple[tensor_files.FileTensor, ...]
  stacked: bool
  transpose: tuple[int, ...] | None

  @property
  def shape(self) -> tuple[int, ...]:
    shape = self.tensors[0].shape
    if self.transpose is not None:
      shape = tuple(shape[axis] for axis in self.transpose)
    return (len(self.tensors), *shape) if self.stacked else shape

  @property
  def file_order(self) -> tuple[int, ...]:
    """The leaf's axes in the order the files lay them out, from the slowest-varying: the layers,
    then each tensor's axes, which a transpose reorders in the leaf."""
    axes = range(len(self.tensors[0].shape))
    if self.transpose is not None:
      axes = sorted(axes, key=self.transpose.__getitem__)
    return (0, *(axis + 1 for axis in axes)) if self.stacked else tuple(axes)

  def tensor_at(self, index: tuple[int, ...]) -> tensor_files.FileTensor:
    """The tensor the leaf's element at ``index`` is read from."""
    return self.tensors[index[0] if self.stacked else 0]

  def read(self, region: tuple[slice, ...]) -> np.ndarray:
    """The leaf's ``region``, read from the files: only the layers and slices in it."""
    if not self.stacked:
      return self._read_one(self.tensors[0], region)
    layers = range(*region[0].indices(len(self.tensors)))
    if len(layers) == 1:  # a piece of one layer: as it is read, not a second copy
      return self._read_one(self.tensors[layers[0]], region[1:])[np.newaxis]
    extent = [len(range(*s.indices(n))) for s, n in zip(region, self.shape, strict=True)]
    values = np.empty(extent, self.tensors[0].dtype)
    for i, layer in enumerate(layers):
      values[i] = self._read_one(self.tensors[layer], region[1:])
    return values

  def _read_one(self, tensor: tensor_files.FileTensor, region: tuple[slice, ...]) -> np.ndarray:
    if self.transpose is None:
      return tensor.read(region)
    # The leaf's axis j is the file's axis transpose[j].
    file_region = [slice(None)] * len(region)
    for leaf_axis, file_axis in enumerate(self.transpose):
      file_region[file_axis] = region[leaf_axis]
    return np.transpose(tensor.read(tuple(file_region)), self.transpose)


def load_safetensors(
  paths: str | os.PathLike | Iterable[str | os.PathLike],
  tx: zero_lib.ZeroTransformation,
  like: Any,
  *,
  keys: Mapping[str, KeyLike] | Callable[[str], KeyLike] | None = None,
  init: bool = False,
) -> Any:
  """Reads parameters from safetensors files into ``tx``'s shards, as ``tx.shard`` places them.

  What ``tx.shard(params)`` returns for the parameters in the files, without
  making them whole anywhere: each process reads from disk only the regions
  its devices store (what ``jax.make_array_from_callback`` would ask it for), a
  piece at a time. Stage 3's leaves come back as ``zerojax.Stored``,
  zero-padded where the layout pads (each padded shard is filled on its own); stages 1 and 2
  replicate whole parameters, so every process reads them whole. Each value
  is cast from the file's dtype to ``like``'s, then to the stored dtype, as
  ``tx.shard`` of parameters in ``like``'s dtypes would: a bfloat16 file
  loads exactly into float32 master parameters.

  Reads the files ``zerojax.export_safetensors`` writes (round trips are
  exact, onto any stage and device count) and HuggingFace's: one file, or a
  model split over several with a ``model.safetensors.index.json``.

  To train from the loaded values, pass ``init=True`` for the optimizer state
  too, made of the full-precision values as ``tx.init`` makes it: under a
  precision policy with a lower compute dtype, stages 1 and 2 return the
  parameters rounded to it (as ``tx.shard`` does), of which ``tx.init`` would
  make a rounded master copy (and so refuses them).

  Args:
    paths: a ``.safetensors`` file, a HuggingFace index (``...index.json``), a
      directory holding one of those (an index first, else every
      ``.safetensors`` file in it), or a sequence of such paths.
    tx: the transformation the parameters are for.
    like: the parameters' tree, abstract: ``jax.ShapeDtypeStruct`` s (or
      arrays) of the logical shapes and dtypes, e.g. ``jax.eval_shape(lambda:
      model.init(key, x)["params"])``. A leaf's ``sharding``, if it has one,
      places it on other mesh axes (tensor parallelism), as in ``tx.shard``.
    keys: the files' name for each leaf, by the leaf's own name: its path in
      ``like``, keys joined with ``"."`` (``"layers.0.kernel"``, the name
      ``export_safetensors`` gives it). A mapping of those names (leaves not
      in it keep their own names), or a function of them. Each gives a
      tensor's name, a sequence of names to stack along the leaf's leading
      dimension (scanned layers), or a ``zerojax.FileKey`` (to transpose).
      ``None`` (the default): every leaf keeps its own name. Tensors that no
      leaf names are not read.
    init: also make the optimizer state, and return ``(params, opt_state)``
      as ``tx.sharded_init``'s function does: what ``tx.shard(full)`` and
      ``tx.init(full)`` give for the full-precision parameters ``full`` in the
      files. Each process then reads only the full-precision shards its
      devices keep of the master copy (1/N of the file), and the parameters
      replicated at stages 1 and 2 are gathered from them over the devices.

  Returns:
    The parameters in ``like``'s structure, as ``tx.shard`` would return them;
    with ``init=True``, the pair ``(params, opt_state)``.

  Raises:
    ValueError: naming every leaf whose tensor is missing from the files (and
      the closest names there), whose shape differs from ``like``'s (and the
      ``FileKey`` that would fit, if a transpose or a stack would), whose
      stack names a tensor twice, or whose dtype cannot become the leaf's (a
      float tensor for an integer leaf, or a dtype zerojax cannot read), and
      every name ``keys`` maps that no leaf has (and the closest leaves); for
      a value that the leaf's dtype, or the one it is stored in, cannot hold
      (1e6 into float16 would be inf); or for a path that is not
      safetensors, or a file that is truncated or damaged (a header that
      HuggingFace's reader refuses, such as tensors whose bytes overlap).
    TypeError: for ``keys`` that is neither a mapping nor a function, or that
      gives a leaf something other than names or a ``zerojax.FileKey``.

  Example:
    >>> import os, tempfile, jax, jax.numpy as jnp, ml_dtypes, numpy as np, optax, zerojax
    >>> from zerojax._src.checkpoint.tensor_files import write
    >>> tx = zerojax.zero3(optax.adam(1e-3), mesh=jax.make_mesh((jax.device_count(),), ("data",)))
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> layers = {f"h.{i}.weight": np.full((1001, 4), i, ml_dtypes.bfloat16) for i in range(2)}
    >>> write(path, layers)  # two layers as HuggingFace keeps them: bf16, (out, in)
    >>> like = {"kernel": jax.ShapeDtypeStruct((2, 4, 1001), jnp.float32)}  # scanned, (in, out)
    >>> keys = {"kernel": zerojax.FileKey(list(layers), transpose=(1, 0))}
    >>> params = zerojax.load_safetensors(path, tx, like, keys=keys)
    >>> params["kernel"].value.addressable_shards[0].data.shape, params["kernel"].layout.shape
    ((2, 4, 126), (2, 4, 1001))
    >>> tx.gather(params)["kernel"][1, 0, :3].tolist()
    [1.0, 1.0, 1.0]

    Stage 2 with bfloat16 compute: the optimizer state (its float32 master
    copy) made of the file's float32 values, not of the rounded parameters.

    >>> write(path, {"w": np.full((8, 128), 1 + 2**-10, np.float32)})
    >>> tx = zerojax.zero2(optax.adam(1e-3), mesh=tx.mesh, precision="bf16")
    >>> like = {"w": jax.ShapeDtypeStruct((8, 128), jnp.float32)}
    >>> params, opt_state = zerojax.load_safetensors(path, tx, like, init=True)
    >>> params["w"].dtype, float(params["w"][0, 0]), float(tx.gather(opt_state.master)["w"][0, 0])
    (dtype(bfloat16), 1.0, 1.0009765625)
  """
  optimizer = zero_lib.unwrap(tx)
  settings = optimizer.settings
  logical = stored_lib.logical(like)
  checks.same_model_on_every_process(logical)
  plans = optimizer.plans(logical)
  found = tensor_files.tensors(paths)
  named, treedef = jax.tree_util.tree_flatten_with_path(logical)
  sources = _sources(found, [(leaf_name(path), leaf) for path, leaf in named], keys, paths)
  # The stored parameters, or with init=True the master copy: full precision, split as the
  # optimizer state is (stage 3 stores it as the parameters).
  layout = plans.sharded if init else plans.params

  def place(stored: layout_lib.LeafLayout, path: Any, leaf: Any, source: _Source) -> jax.Array:
    sharding = NamedSharding(settings.mesh, stored.partition_spec)
    return _place(leaf_name(path), source, stored, np.dtype(leaf.dtype), sharding)

  placed = jax.tree.unflatten(
    treedef,
    [
      place(stored, path, leaf, source)
      for stored, (path, leaf), source in zip(layout.leaves, named, sources, strict=True)
    ],
  )
  if not init:
    return stored_lib.wrap(layout, placed) if settings.stage.splits_params else placed
  master = stored_lib.wrap(layout, placed)
  opt_state = tx.init(master)
  if settings.stage.splits_params and plans.master is None:
    return master, opt_state  # stage 3 stores the master copy as its parameters
  with jax.set_mesh(settings.mesh):
    # Inside jit, where the replicated parameters are gathered from the shards.
    return jax.jit(tx.shard)(master), opt_state


def leaf_name(path: tuple[Any, ...]) -> str:
  """A leaf's name as ``keys=`` spells it: its path's keys joined with ``"."``."""
  return ".".join(str(spec_lib.key_name(key)) for key in path)


#: A leaf is read in pieces of at most this many bytes (after its cast), each scattered into the
#: shards it overlaps: the bound on what host memory holds beyond the shards themselves.
PIECE_BYTES = 4 * 2**20


def _place(
  name: str,
  source: _Source,
  stored: layout_lib.LeafLayout,
  dtype: np.dtype,
  sharding: NamedSharding,
) -> jax.Array:
  """The stored leaf, made of the shards this process's devices hold, each read from the files.

  Shards that tile a box (adjacent shards, replicas) are filled in one pass
  over it, a piece at a time; shards of the padded region beyond the logical
  leaf stay zeros. Each becomes its first device's buffer (on CPU, where the
  runtime takes an aligned host array as it is, not a copy) and is copied
  from there to the other devices that hold it.
  """
  shape = stored.stored_shape
  devices = {
    device: _bounds(index, shape)
    for device, index in sharding.addressable_devices_indices_map(shape).items()
  }
  shards = {region: _aligned_zeros(_extent(region), stored.dtype) for region in devices.values()}
  box = _tiled_box(set(shards))
  itemsize = max(stored.dtype.itemsize, dtype.itemsize, source.tensors[0].dtype.itemsize)
  for cover in [box] if box is not None else list(shards):
    pieces = _pieces(_clipped(cover, stored.shape), PIECE_BYTES // itemsize, source.file_order)
    for piece in pieces:
      values = source.read(tuple(slice(a, b) for a, b in piece))
      for cast_to, held_by in ((dtype, _LIKE), (stored.dtype, _STORED)):
        cast = _cast(values, cast_to)
        lost = _lost(values, cast)
        if lost is not None:
          raise _unheld(name, source, piece, values, cast, lost, held_by)
        values = cast
      for region, shard in shards.items():
        _copy_overlap(values, piece, shard, region)
  arrays, placed = [], {}
  for device, region in devices.items():
    if region in placed:  # a replica: its own copy, never the same memory as another device's
      arrays.append(jax.device_put(placed[region], device))
      continue
    # Handed over and dropped here: on CPU the device keeps this memory as its buffer, where a
    # copy would hold the shard twice until the runtime frees the host array (when it next
    # collects the references its threads dropped: not before the leaf's other shards are made).
    placed[region] = jax.device_put(shards.pop(region), device, may_alias=True)
    arrays.append(placed[region])
  return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


#: XLA's CPU runtime takes a host array as a device's buffer, without copying it, if its data
#: starts at a multiple of this many bytes (numpy's start 16 bytes into a page).
_ALIGNMENT = 64


def _aligned_zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
  """``np.zeros(shape, dtype)`` whose data starts at a multiple of ``_ALIGNMENT`` bytes."""
  size = math.prod(shape) * dtype.itemsize
  memory = np.zeros(size + _ALIGNMENT, np.uint8)  # zero pages: untouched until written
  start = -memory.ctypes.data % _ALIGNMENT
  return memory[start : start + size].view(dtype).reshape(shape)


Bounds = tuple[tuple[int, int], ...]

#: Whose dtype a value is cast to, and how to give it one that holds the value: ``like``'s,
#: then the one the precision policy stores the leaf in.
_LIKE = (
  "the leaf's dtype in `like`",
  "Give the leaf a dtype that holds it in `like` (the file's does)",
)
_STORED = (
  "the dtype the precision policy stores the leaf in",
  "Choose a precision policy whose dtypes hold it (bfloat16 has float32's range)",
)


def _cast(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
  with np.errstate(over="ignore"):  # what numpy would warn of, _lost finds
    return values.astype(dtype, copy=False)


def _range(dtype: np.dtype) -> tuple[Any, Any]:
  info = ml_dtypes.finfo(dtype) if jnp.issubdtype(dtype, jnp.inexact) else np.iinfo(dtype)
  return info.min, info.max


def _lost(values: np.ndarray, cast: np.ndarray) -> tuple[int, ...] | None:
  """Where in ``values`` is the one of largest magnitude that ``cast`` (``values`` in another dtype
  of the same kind) lost: a finite float made infinite, or an integer wrapped round; or ``None``.

  Made of masks of one piece, only where the dtype's range narrows: no copy of a whole leaf.
  """
  if values.dtype == cast.dtype:
    return None
  (low, high), (cast_low, cast_high) = _range(values.dtype), _range(cast.dtype)
  if cast_low <= low and high <= cast_high:
    return None
  if jnp.issubdtype(cast.dtype, jnp.inexact):
    lost = np.isinf(cast)
    if not lost.any():
      return None
    lost &= np.isfinite(values)  # inf in the file stays inf
  else:
    lost = (values < cast_low) | (values > cast_high)
  if not lost.any():
    return None
  magnitudes = np.where(lost, np.abs(values.astype(np.float64)), -1)
  return tuple(int(i) for i in np.unravel_index(np.argmax(magnitudes), values.shape))


def _unheld(
  name: str,
  source: _Source,
  piece: Bounds,
  values: np.ndarray,
  cast: np.ndarray,
  lost: tuple[int, ...],
  held_by: tuple[str, str],
) -> ValueError:
  """The error for the value at ``lost`` in the ``piece`` of leaf ``name`` read from ``source``."""
  index = tuple(start + i for (start, _), i in zip(piece, lost, strict=True))
  tensor = source.tensor_at(index)
  low, high = _range(cast.dtype)
  whose, fix = held_by
  return ValueError(
    f"{name}: tensor {tensor.name!r}, {tensor.dtype.name}, holds {values[lost]} (at {index} of "
    f"the leaf), beyond the range of {cast.dtype.name} ({low} to {high}), {whose}: cast, it "
    f"would be {cast[lost]}. {fix}, or rescale the tensor in the file."
  )


def _bounds(index: Any, shape: tuple[int, ...]) -> Bounds:
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def _extent(bounds: Bounds) -> tuple[int, ...]:
  return tuple(stop - start for start, stop in bounds)


def _tiled_box(regions: set[Bounds]) -> Bounds | None:
  """The box the (disjoint) ``regions`` tile exactly, or ``None`` if they leave gaps in it."""
  ndim = len(next(iter(regions)))
  box = tuple((min(r[d][0] for r in regions), max(r[d][1] for r in regions)) for d in range(ndim))
  return box if math.prod(_extent(box)) == sum(math.prod(_extent(r)) for r in regions) else None


def _clipped(bounds: Bounds, shape: tuple[int, ...]) -> Bounds:
  """``bounds`` inside the logical ``shape`` (the padding cut off; maybe empty)."""
  return tuple((min(a, n), min(b, n)) for (a, b), n in zip(bounds, shape, strict=True))


def _pieces(box: Bounds, elements: int, order: Sequence[int]) -> Iterator[Bounds]:
  """``box`` cut into boxes of at most ``elements`` (or one row of the last axis in ``order``).

  Cut across the axes in ``order`` (the files' layout of the leaf's axes), the first first, so a
  piece of a transposed leaf is rows of its tensor, each row's part one span of the file, and not
  a few columns of every row.
  """
  inverse = np.argsort(order)
  for piece in pieces_in_order(tuple(box[axis] for axis in order), elements):
    yield tuple(piece[axis] for axis in inverse)


def pieces_in_order(box: Bounds, elements: int) -> Iterator[Bounds]:
  """``box`` cut into boxes of at most ``elements`` (or one row of its last dimension)."""
  sizes = _extent(box)
  if not box:
    yield box
  if 0 in sizes or not box:
    return
  axis = next((d for d in range(len(box)) if math.prod(sizes[d + 1 :]) <= elements), len(box) - 1)
  step = max(1, elements // math.prod(sizes[axis + 1 :]))
  for outer in itertools.product(*(range(a, b) for a, b in box[:axis])):
    start, stop = box[axis]
    for first in range(start, stop, step):
      cut = ((first, min(first + step, stop)),)
      yield tuple((i, i + 1) for i in outer) + cut + box[axis + 1 :]


def _copy_overlap(values: np.ndarray, piece: Bounds, shard: np.ndarray, region: Bounds) -> None:
  """Copies where ``piece`` (holding ``values``) overlaps ``region`` (held by ``shard``)."""
  overlap = [(max(p[0], r[0]), min(p[1], r[1])) for p, r in zip(piece, region, strict=True)]
  if any(a >= b for a, b in overlap):
    return
  within = lambda origin: tuple(
    slice(a - o[0], b - o[0]) for (a, b), o in zip(overlap, origin, strict=True)
  )
  shard[within(region)] = values[within(piece)]


def _sources(
  found: dict[str, tensor_files.FileTensor],
  leaves: list[tuple[str, Any]],
  keys: Mapping[str, KeyLike] | Callable[[str], KeyLike] | None,
  paths: Any,
) -> list[_Source]:
  """Each leaf's tensors, checked against it; one error naming every leaf that does not fit."""
  sources, problems = [], []
  for name, leaf in leaves:
    key = key_of(name, keys)
    names = [key.key] if isinstance(key.key, str) else list(key.key)
    missing = [n for n in names if n not in found]
    if missing:
      problems.append(_missing(name, missing, found, keys))
      sources.append(None)
      continue
    tensors = tuple(found[n] for n in names)
    transpose = None if key.transpose is None else tuple(int(a) for a in key.transpose)
    problem = _unfit(name, leaf, tensors, transpose, stacked=not isinstance(key.key, str))
    if problem:
      problems.append(problem)
    sources.append(_Source(tensors, not isinstance(key.key, str), transpose))
  strays = stray_keys(keys, [n for n, _ in leaves])
  if problems or strays:
    lines = [*problems, *strays]
    shown = "\n".join(f"  {line}" for line in lines[:20])
    more = f"\n  ... and {len(lines) - 20} more" if len(lines) > 20 else ""
    what, held = [], ""
    if problems:
      what.append(
        f"{len(problems)} of {len(leaves)} leaves do not fit the tensors in {_shown(paths)}"
      )
      names = list(found)
      listed = f"{', '.join(names[:4])}{', ...' * (len(names) > 4)}"
      held = f"The files hold {len(names)} tensors ({listed}). "
    if strays:
      what.append("keys maps names that no leaf has")
    raise ValueError(
      f"{', and '.join(what)}:\n{shown}{more}\n{held}A leaf's name is its path in `like`, keys "
      "joined with '.'; pass keys={leaf name: file name (or names to stack, or "
      "zerojax.FileKey(name, transpose=...))} or a function of the leaf's name."
    )
  return sources


def key_of(name: str, keys: Any) -> FileKey:
  """The file tensors of the leaf ``name`` under ``keys=`` (a mapping, a function or ``None``)."""
  if keys is None:
    key = name
  elif isinstance(keys, Mapping):
    key = keys.get(name, name)
  elif callable(keys):
    key = keys(name)
  else:
    raise TypeError(
      f"keys is a mapping or a function of a leaf's name, got {type(keys).__name__}; e.g. "
      "keys={'blocks.kernel': ['h.0.weight', 'h.1.weight']} or keys=lambda name: ..."
    )
  names: Any = key.key if isinstance(key, FileKey) else key
  if isinstance(names, str) or (
    isinstance(names, Sequence) and names and all(isinstance(k, str) for k in names)
  ):
    return key if isinstance(key, FileKey) else FileKey(names)
  raise TypeError(
    f"keys gave {key!r} for leaf {name!r}: give a tensor's name, a non-empty sequence of "
    "names (stacked along the leading dimension), or a zerojax.FileKey."
  )


def _missing(name: str, missing: list[str], found: dict[str, Any], keys: Any) -> str:
  close = difflib.get_close_matches(missing[0], list(found), n=3, cutoff=0.5)
  hint = f"; the closest there: {close}" if close else ""
  mapped = keys is not None and (not isinstance(keys, Mapping) or name in keys)
  given = " (from keys)" if mapped else ""
  what = f"tensor {missing[0]!r}" if len(missing) == 1 else f"tensors {missing[:3]}..."
  return f"{name}: {what}{given} is not in the files{hint}"


def stray_keys(keys: Any, leaves: list[str]) -> list[str]:
  """A line for each name that ``keys`` maps and no leaf has, with the leaves closest to it."""
  if not isinstance(keys, Mapping):
    return []
  known, lines = set(leaves), []
  for key in (k for k in keys if k not in known):
    close = difflib.get_close_matches(str(key), leaves, n=3, cutoff=0.5)
    hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
    lines.append(f"keys maps {key!r}, which names no leaf{hint}")
  return lines


def _unfit(
  name: str,
  leaf: Any,
  tensors: tuple[tensor_files.FileTensor, ...],
  transpose: tuple[int, ...] | None,
  stacked: bool,
) -> str | None:
  """What keeps ``tensors`` from being read into ``leaf``, or ``None``."""
  first = tensors[0]
  counts = collections.Counter(t.name for t in tensors)
  repeated = next((n for n, count in counts.items() if count > 1), None)
  if repeated is not None:
    layers = [str(i) for i, t in enumerate(tensors) if t.name == repeated]
    return (
      f"{name}: tensor {repeated!r} is stacked into it as layers {', '.join(layers[:-1])} and "
      f"{layers[-1]}: name each layer's own tensor, one per index of the leaf's leading dimension"
    )
  try:
    dtypes = {t.dtype for t in tensors}
  except ValueError as error:
    return f"{name}: {error}"
  if len(dtypes) > 1 or len({t.shape for t in tensors}) > 1:
    other = next(t for t in tensors if (t.dtype, t.shape) != (first.dtype, first.shape))
    return (
      f"{name}: the tensors stacked into it differ: {first.name!r} is {first.dtype_name} "
      f"{first.shape}, {other.name!r} {other.dtype_name} {other.shape}. Stack one tensor per "
      "layer, each of a layer's shape."
    )
  want = np.dtype(leaf.dtype)
  if _kind(first.dtype) != _kind(want):
    kind = _kind(first.dtype)
    return (
      f"{name}: tensor {first.name!r} is {first.dtype.name} and the leaf {want.name}; "
      f"{'an' if kind == 'integer' else 'a'} {kind} tensor is not read into a {_kind(want)} "
      "leaf. Give the leaf the file's kind of dtype in `like`."
    )
  if transpose is not None and sorted(transpose) != list(range(len(first.shape))):
    return (
      f"{name}: transpose={transpose} is not a permutation of the axes of {first.name!r}, "
      f"{tuple(range(len(first.shape)))}"
    )
  shape = _Source(tensors, stacked, transpose).shape
  if shape == tuple(leaf.shape):
    return None
  fix = ""
  axes = tuple(reversed(range(len(first.shape))))
  reversed_shape = tuple(reversed(first.shape))
  if not stacked and transpose is None and reversed_shape == tuple(leaf.shape):
    fix = f"; transposed it fits: zerojax.FileKey({first.name!r}, transpose={axes})"
  elif stacked and transpose is None and reversed_shape == tuple(leaf.shape[1:]):
    fix = (
      f"; each layer transposed it fits: zerojax.FileKey(names, transpose={axes}), with the "
      f"{len(tensors)} names"
    )
  elif not stacked and tuple(leaf.shape[1:]) == first.shape:
    fix = f"; it fits one layer: give {leaf.shape[0]} names to stack, one per layer"
  return f"{name}: tensor {first.name!r} gives shape {shape}, the leaf has {tuple(leaf.shape)}{fix}"


def _kind(dtype: np.dtype) -> str:
  if jnp.issubdtype(dtype, jnp.inexact):
    return "floating"
  return "boolean" if dtype == np.bool_ else "integer"


def _shown(paths: Any) -> str:
  if isinstance(paths, (str, os.PathLike)):
    return os.fspath(paths)
  paths = [os.fspath(p) for p in paths]
  return paths[0] if len(paths) == 1 else f"{paths[0]} and {len(paths) - 1} more"
