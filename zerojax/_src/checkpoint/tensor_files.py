"""safetensors files: their headers, HuggingFace's index, one region's bytes read, and writing.

The format is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the raw little-endian data, each
tensor in row-major order. A region is read with ``readinto`` straight into
its own array, one contiguous span of the file at a time (a slice of some
columns is one span a row), so a process reads its own bytes and no others;
only spans closer together than a page are read as whole rows, through a
bounded buffer. Never through a memory map: the pages of a mapped file that a
strided slice touches count in the process's resident memory (``ru_maxrss``),
so a column slice through ``safetensors.safe_open(...).get_slice`` holds the
whole tensor resident (benchmarks/loading.py measures it).
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

#: The dtypes of the format, by its names (little-endian, as it stores them).
DTYPES: dict[str, np.dtype] = {
  name: np.dtype(dtype).newbyteorder("<")
  for name, dtype in {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "U16": np.uint16,
    "I16": np.int16,
    "U32": np.uint32,
    "I32": np.int32,
    "U64": np.uint64,
    "I64": np.int64,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F32": np.float32,
    "F64": np.float64,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
  }.items()
}

#: HuggingFace's name for the index of a model split over several files.
INDEX_FILE = "model.safetensors.index.json"

#: Spans of a region less than this many bytes apart are read in whole rows (with the gaps
#: between them, which the disk reads anyway: it reads whole pages); farther apart, each alone.
GAP_BYTES = 4096
#: Whole rows are read through a buffer of at most this many bytes.
ROWS_BUFFER_BYTES = 4 * 2**20
#: Larger headers are not safetensors headers (the format's own limit is 100 MB).
_MAX_HEADER_BYTES = 100 * 2**20


@dataclasses.dataclass(frozen=True)
class FileTensor:
  """One tensor of a safetensors file: where its bytes are, and what they hold.

  Attributes:
    path: the file.
    name: its name in the file.
    dtype_name: the format's name of its dtype (``"BF16"``, ``"F32"``, ...).
    shape: its shape.
    offset: where its data starts in the file, in bytes from the file's start.
  """

  path: str
  name: str
  dtype_name: str
  shape: tuple[int, ...]
  offset: int

  @property
  def dtype(self) -> np.dtype:
    """Its numpy dtype (bfloat16 and float8 from ``ml_dtypes``).

    Raises:
      ValueError: for a dtype this reader does not know.
    """
    if self.dtype_name not in DTYPES:
      raise ValueError(
        f"tensor {self.name!r} in {self.path} is {self.dtype_name}, which zerojax cannot read; "
        f"it reads {sorted(DTYPES)}. Convert the file, or leave the tensor out of the tree."
      )
    return DTYPES[self.dtype_name]

  def read(self, index: Sequence[slice]) -> np.ndarray:
    """The region ``index`` (one slice of step 1 per dimension) of this tensor, from disk.

    Example:
      >>> import os, tempfile, numpy as np
      >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
      >>> write(path, {"x": np.arange(12, dtype=np.float32).reshape(3, 4)})
      >>> tensors(path)["x"].read((slice(1, 3), slice(2, 4))).tolist()
      [[6.0, 7.0], [10.0, 11.0]]
    """
    index = tuple(index) + (slice(None),) * (len(self.shape) - len(index))
    region = [_bounds(s, n) for s, n in zip(index, self.shape, strict=True)]
    out = np.empty([stop - start for start, stop in region], self.dtype)
    if out.size:
      with open(self.path, "rb", buffering=0) as file:
        try:
          _read_region(file, self.offset, self.shape, region, out)
        except EOFError:
          where = f"before the data of tensor {self.name!r}"
          raise _truncated(self.path, where, "it was cut after its header was read") from None
    return out


def _bounds(index: slice, size: int) -> tuple[int, int]:
  start, stop, step = index.indices(size)
  if step != 1:
    raise ValueError(f"a region is read with slices of step 1, got {index}")
  return start, max(start, stop)


def _read_region(
  file: io.FileIO, offset: int, shape: tuple[int, ...], region: list[tuple[int, int]], out: Any
) -> None:
  """Fills ``out`` with ``region`` of the row-major tensor of ``shape`` at ``offset``.

  ``out`` (C-contiguous) is filled in order by the region's contiguous spans of
  the file: each is the extent of its last axis not taken whole, times the
  axes after it. Spans follow one another along the axis before it (``stride``
  bytes apart) and jump along the axes before that.
  """
  dest = out.reshape(-1).view(np.uint8)
  whole = len(shape)
  while whole and region[whole - 1] == (0, shape[whole - 1]):
    whole -= 1
  if not whole:
    _read_exactly(file, offset, dest)  # the whole tensor
    return
  steps = [math.prod(shape[axis + 1 :]) * out.itemsize for axis in range(whole)]
  start, stop = region[whole - 1]
  span = (stop - start) * steps[whole - 1]
  offset += start * steps[whole - 1]
  if whole == 1:
    _read_exactly(file, offset, dest)  # some rows: one span
    return
  first, last = region[whole - 2]
  outer = itertools.product(*(range(a, b) for a, b in region[: whole - 2]))
  count, done = last - first, 0
  for index in outer:
    at = offset + sum(i * step for i, step in zip(index, steps, strict=False))
    at += first * steps[whole - 2]
    _read_strided(file, at, count, span, steps[whole - 2], dest[done : done + count * span])
    done += count * span


def _read_strided(
  file: io.FileIO, offset: int, count: int, span: int, stride: int, dest: Any
) -> None:
  """``count`` spans of ``span`` bytes, ``stride`` bytes apart from ``offset``, into ``dest``."""
  gap = stride - span
  if gap >= GAP_BYTES:
    for i in range(count):  # each span alone: no byte of the gaps is read
      _read_exactly(file, offset + i * stride, dest[i * span : (i + 1) * span])
    return
  # Spans close together: whole rows through a bounded buffer, one read for several.
  rows_per_read = max(1, ROWS_BUFFER_BYTES // stride)
  spans = dest.reshape(count, span)
  for first in range(0, count, rows_per_read):
    rows = min(rows_per_read, count - first)
    buffer = np.empty(rows * stride, np.uint8)
    _read_exactly(file, offset + first * stride, buffer[: rows * stride - gap])
    spans[first : first + rows] = buffer.reshape(rows, stride)[:, :span]


def _read_exactly(file: io.FileIO, offset: int, dest: np.ndarray) -> None:
  """Fills the bytes ``dest`` from ``offset``."""
  view = dest.data
  file.seek(offset)
  done = 0
  while done < len(view):
    count = file.readinto(view[done:])
    if not count:
      raise EOFError(offset + done)
    done += count


def _truncated(path: str, where: str, sizes: str) -> ValueError:
  return ValueError(
    f"{path} ends {where}: the file is truncated (an interrupted download or copy?); {sizes}. "
    "Fetch it again."
  )


def _damaged(what: str) -> ValueError:
  return ValueError(
    f"{what}: the file is damaged (HuggingFace's safetensors refuses it too). Fetch it again."
  )


def tensors(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> dict[str, FileTensor]:
  """Every tensor of the files, by name, from their headers (no tensor data is read).

  Args:
    paths: a ``.safetensors`` file; a HuggingFace index
      (``model.safetensors.index.json``, whose ``weight_map`` names each
      tensor's file); a directory holding an index, or else ``.safetensors``
      files (all of them are read); or a sequence of these.

  Returns:
    ``{name: FileTensor}``.

  Raises:
    ValueError: for a path that is none of these, a file that is not in the
      format, or a tensor name found in two files.

  Example:
    >>> import os, tempfile, numpy as np
    >>> directory = tempfile.mkdtemp()
    >>> write(os.path.join(directory, "a.safetensors"), {"x": np.zeros((2, 3), np.float32)})
    >>> tensors(directory)["x"].shape
    (2, 3)
  """
  if isinstance(paths, (str, os.PathLike)):
    paths = [paths]
  found: dict[str, FileTensor] = {}
  for file in dict.fromkeys(f for path in paths for f in _files(Path(path))):
    for name, tensor in _header(file).items():
      if name in found:
        raise ValueError(
          f"tensor {name!r} is in both {found[name].path} and {tensor.path}: pass the files "
          "of one model (or its index.json)."
        )
      found[name] = tensor
  return found


def _files(path: Path) -> list[str]:
  """The ``.safetensors`` files that ``path`` stands for."""
  if path.is_dir():
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if path.joinpath(INDEX_FILE).exists():
      indexes = [path / INDEX_FILE]
    if indexes:
      return _files(indexes[0])
    files = sorted(str(p) for p in path.glob("*.safetensors"))
    if not files:
      raise ValueError(f"{path} holds no .safetensors files (nor a {INDEX_FILE}).")
    return files
  if not path.exists():
    raise ValueError(f"{path} does not exist: pass a .safetensors file, an index or a directory.")
  if path.name.endswith(".json"):
    try:
      weight_map = json.loads(path.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError):
      raise ValueError(
        f"{path} is not a safetensors index: it has no JSON object with a 'weight_map' "
        "naming each tensor's file."
      ) from None
    files = [str(path.parent / name) for name in dict.fromkeys(weight_map.values())]
    absent = [f for f in files if not os.path.exists(f)]
    if absent:
      raise ValueError(
        f"{path} names {len(files)} files, and {os.path.basename(absent[0])} of them is not "
        f"beside it{f' (nor {len(absent) - 1} more)' * (len(absent) > 1)}: download every file "
        "the index names into its directory."
      )
    return files
  return [str(path)]


def _header(path: str) -> dict[str, FileTensor]:
  with open(path, "rb") as file:
    file.seek(0, os.SEEK_END)
    size = file.tell()
    file.seek(0)
    length = int.from_bytes(file.read(8), "little")
    opening = file.read(1)
    if size < 8:
      raise _truncated(
        path, "inside its first 8 bytes, its header's length", f"it has {size} bytes"
      )
    if opening in (b"{", b"") and size - 8 < length <= _MAX_HEADER_BYTES:  # the start of one
      sizes = f"its first 8 bytes give a header of {length} bytes, and it has {size - 8} after them"
      raise _truncated(path, "inside its header", sizes)
    if not 2 <= length <= min(_MAX_HEADER_BYTES, size - 8):
      raise ValueError(f"{path} is not a safetensors file (its first 8 bytes give no header).")
    file.seek(8)
    try:
      header = json.loads(file.read(length))
      entries = {name: _entry(entry) for name, entry in header.items() if name != "__metadata__"}
    except (ValueError, TypeError, KeyError, AttributeError):
      raise ValueError(
        f"{path} is not a safetensors file (its header is not a JSON object giving each "
        "tensor's dtype, shape and data_offsets)."
      ) from None
  _check_data_offsets(path, entries, size - 8 - length)
  return {
    name: FileTensor(path, name, dtype_name, shape, 8 + length + begin)
    for name, (dtype_name, shape, begin, _) in entries.items()
  }


def _check_data_offsets(
  path: str, entries: dict[str, tuple[str, tuple[int, ...], int, int]], data_size: int
) -> None:
  """HuggingFace's checks of a header: sorted by where they begin, the tensors' bytes follow one
  another from the data's first byte to its last, each as many as its shape and dtype take."""
  ordered = sorted(entries.items(), key=lambda entry: entry[1][2:])
  previous, start, at = None, 0, 0  # the tensor before, and where its bytes start and end
  for name, (dtype_name, shape, begin, end) in ordered:
    tensor = f"tensor {name!r} in {path}"
    if not 0 <= begin <= end:
      raise _damaged(
        f"{tensor} has data_offsets [{begin}, {end}], which are no range of the data's bytes"
      )
    if begin < at:
      raise _damaged(
        f"{tensor} starts at byte {begin} of the data, inside tensor {previous!r} (bytes {start} "
        f"to {at})"
      )
    if begin > at:
      raise _damaged(
        f"{tensor} starts at byte {begin} of the data, and no tensor holds bytes {at} to {begin}"
      )
    if dtype_name in DTYPES and end - begin != math.prod(shape) * DTYPES[dtype_name].itemsize:
      raise _damaged(f"{tensor} has {end - begin} bytes for shape {shape} of {dtype_name}")
    if end > data_size:
      total = max(entry[3] for entry in entries.values())
      sizes = f"its header gives {total} bytes of data, and it has {data_size} after the header"
      raise _truncated(path, f"before the data of tensor {name!r}", sizes)
    previous, start, at = name, begin, end
  if at < data_size:
    held = f"{path} holds {data_size - at} bytes"
    if previous is None:
      raise _damaged(f"{held} of data after its header, which names no tensor")
    raise _damaged(f"{held} after the data of its last tensor, {previous!r}, which no tensor holds")


def _entry(entry: Any) -> tuple[str, tuple[int, ...], int, int]:
  """A header's entry for a tensor: its dtype's name, shape, and where its data begins and ends."""
  begin, end = entry["data_offsets"]
  return str(entry["dtype"]), tuple(int(n) for n in entry["shape"]), int(begin), int(end)


def header_bytes(tensors: dict[str, Any]) -> bytes:
  """The start of a file of ``tensors`` (``{name: array or jax.ShapeDtypeStruct}``, in the order
  their data follows): the header's length, then the header, padded so the data starts 8-byte
  aligned.

  Raises:
    ValueError: for a dtype the format cannot hold.
  """
  names = {dtype: name for name, dtype in DTYPES.items()}
  header, offset = {}, 0
  for name, tensor in tensors.items():
    dtype = np.dtype(tensor.dtype).newbyteorder("<")
    if dtype not in names:
      raise ValueError(
        f"parameter {name} is {np.dtype(tensor.dtype).name}, which safetensors cannot hold; "
        f"it holds {sorted(np.dtype(d).name for d in DTYPES.values())}."
      )
    size = math.prod(tensor.shape) * dtype.itemsize
    header[name] = {
      "dtype": names[dtype],
      "shape": list(tensor.shape),
      "data_offsets": [offset, offset + size],
    }
    offset += size
  encoded = json.dumps(header, separators=(",", ":")).encode()
  encoded += b" " * (-len(encoded) % 8)
  return len(encoded).to_bytes(8, "little") + encoded


def data_bytes(array: np.ndarray) -> memoryview:
  """``array``'s data as the format stores it: C-contiguous, little-endian bytes."""
  contiguous = np.ascontiguousarray(array, np.dtype(array.dtype).newbyteorder("<"))
  return contiguous.reshape(-1).view(np.uint8).data


def write(path: str | os.PathLike, arrays: dict[str, np.ndarray]) -> None:
  """Writes ``arrays`` to one ``.safetensors`` file, in order.

  Example:
    >>> import os, tempfile, numpy as np
    >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
    >>> write(path, {"x": np.ones(3, np.float32)})
    >>> tensors(path)["x"].dtype_name
    'F32'
  """
  with open(path, "wb") as file:
    file.write(header_bytes(arrays))
    for array in arrays.values():
      file.write(data_bytes(array))
