"""Reading a region of a safetensors tensor: every way of reading gives numpy's slice of it."""

import itertools
import json
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from zerojax._src.checkpoint import tensor_files

SHAPES = [(), (7,), (5, 9), (3, 4, 11), (2, 3, 5, 6)]


@pytest.mark.parametrize(
  # Whole rows through a buffer of 2 rows or of 1; each span alone; the defaults.
  ("rows_buffer", "gap"),
  [(64, 10**9), (8, 10**9), (10**9, 0), (tensor_files.ROWS_BUFFER_BYTES, tensor_files.GAP_BYTES)],
)
def test_every_region_reads_as_numpy_slices_it(tmp_path, monkeypatch, rows_buffer, gap):
  monkeypatch.setattr(tensor_files, "ROWS_BUFFER_BYTES", rows_buffer)
  monkeypatch.setattr(tensor_files, "GAP_BYTES", gap)
  rng = np.random.default_rng(0)
  arrays = {
    f"{dtype.__name__}{shape}": rng.standard_normal(shape).astype(dtype)
    for shape, dtype in itertools.product(SHAPES, (np.float32, ml_dtypes.bfloat16, np.int8))
  }
  save_file(arrays, str(tmp_path / "x.safetensors"))  # HuggingFace's writer
  found = tensor_files.tensors(tmp_path / "x.safetensors")
  for name, array in arrays.items():
    for _ in range(6):
      region = []
      for n in array.shape:
        start = int(rng.integers(0, n + 1))
        region.append(slice(start, int(rng.integers(start, n + 1))))
      got = found[name].read(tuple(region))
      np.testing.assert_array_equal(got, array[tuple(region)], strict=True)
    np.testing.assert_array_equal(found[name].read(()), array, strict=True)


def test_what_it_writes_huggingface_reads(tmp_path):
  arrays: dict[str, np.ndarray] = {
    "b": np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.bfloat16),
    "i": np.arange(4, dtype=np.int64),
  }
  tensor_files.write(tmp_path / "x.safetensors", arrays)
  loaded = load_file(str(tmp_path / "x.safetensors"))
  for name, array in arrays.items():
    np.testing.assert_array_equal(loaded[name], array, strict=True)


def _bytes_read() -> int:
  return int(Path("/proc/self/io").read_text().split("rchar:")[1].split()[0])


@pytest.mark.parametrize(("columns", "gap"), [((1024, 2048), 0), ((0, 4000), 384)])
def test_a_column_slice_reads_its_own_bytes_and_gaps_under_a_page(tmp_path, columns, gap):
  # 16 KiB rows: a quarter of each is 12 KiB apart from the next row's, and read alone; parts a
  # few hundred bytes apart are read with the gaps between them, in whole rows.
  array = np.arange(256 * 4096, dtype=np.float32).reshape(256, 4096)
  tensor_files.write(tmp_path / "x.safetensors", {"x": array})
  tensor = tensor_files.tensors(tmp_path / "x.safetensors")["x"]
  tensor.read((slice(0, 1),))  # what a first read imports
  before = _bytes_read()
  got = tensor.read((slice(None), slice(*columns)))
  read = _bytes_read() - before
  np.testing.assert_array_equal(got, array[:, slice(*columns)], strict=True)
  assert 0 <= read - (got.nbytes + 255 * gap) < 1024  # and reading /proc/self/io itself


def _raw_file(path: Path, header: dict, data: bytes) -> Path:
  """A file of the format with ``header`` written as it is, then ``data``."""
  encoded = json.dumps(header).encode()
  path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + data)
  return path


def _f32(shape: list[int], begin: int, end: int) -> dict:
  return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


#: Headers HuggingFace's reader refuses, each with the data after it and what zerojax says.
DAMAGED = {
  "overlap": (
    {"embed": _f32([2, 4], 0, 32), "b": _f32([2], 8, 16)},
    32,
    "tensor 'b' in ... starts at byte 8 of the data, inside tensor 'embed' (bytes 0 to 32)",
  ),
  "overlap at the start": (
    {"embed": _f32([2], 0, 8), "b": _f32([2], 0, 8)},
    8,
    "tensor 'b' in ... starts at byte 0 of the data, inside tensor 'embed' (bytes 0 to 8)",
  ),
  "gap": (
    {"a": _f32([2], 0, 8), "b": _f32([2], 16, 24)},
    24,
    "tensor 'b' in ... starts at byte 16 of the data, and no tensor holds bytes 8 to 16",
  ),
  "reversed": (
    {"a": _f32([2], 8, 0)},
    8,
    r"tensor 'a' in ... has data_offsets [8, 0], which are no range of the data's bytes",
  ),
  "negative": (
    {"a": _f32([2], -8, 0)},
    8,
    r"tensor 'a' in ... has data_offsets [-8, 0], which are no range of the data's bytes",
  ),
  "size": ({"a": _f32([4], 0, 12)}, 12, "tensor 'a' in ... has 12 bytes for shape (4,) of F32"),
  "trailing bytes": (
    {"a": _f32([2], 0, 8)},
    16,
    "... holds 8 bytes after the data of its last tensor, 'a', which no tensor holds",
  ),
  "no tensor": ({}, 8, "... holds 8 bytes of data after its header, which names no tensor"),
}


def _pattern(message: str) -> str:
  return "(?s)" + ".*".join(re.escape(part) for part in message.split("..."))


@pytest.mark.parametrize("case", DAMAGED)
def test_a_header_whose_tensors_do_not_tile_the_data_is_refused_as_huggingface_does(tmp_path, case):
  # safetensors' own validation: sorted by where they start, the tensors' bytes follow one
  # another from the data's first byte to its last, each as many as its shape and dtype take.
  header, size, message = DAMAGED[case]
  path = _raw_file(tmp_path / "x.safetensors", header, bytes(size))
  with pytest.raises(SafetensorError):
    load_file(str(path))
  with pytest.raises(ValueError, match=_pattern(f"{message}: the file is damaged")):
    tensor_files.tensors(path)


def test_what_huggingface_reads_is_read(tmp_path):
  # Empty tensors take no bytes, wherever they are; the header lists tensors in any order.
  header = {"after": _f32([0], 8, 8), "a": _f32([2], 0, 8), "empty": _f32([0, 3], 0, 0)}
  path = _raw_file(tmp_path / "x.safetensors", header, np.ones(2, np.float32).tobytes())
  loaded = load_file(str(path))
  found = tensor_files.tensors(path)
  for name, array in loaded.items():
    np.testing.assert_array_equal(found[name].read(()), array, strict=True)


def test_a_file_cut_anywhere_is_said_to_be_truncated(tmp_path):
  save_file({"a": np.ones(2, np.float32), "b": np.ones(3, np.float32)}, str(tmp_path / "x"))
  data = (tmp_path / "x").read_bytes()
  length = int.from_bytes(data[:8], "little")
  for cut in range(len(data)):
    (tmp_path / "cut.safetensors").write_bytes(data[:cut])
    with pytest.raises(SafetensorError):
      load_file(str(tmp_path / "cut.safetensors"))
    if cut < 8:
      where, sizes = "inside its first 8 bytes, its header's length", f"it has {cut} bytes"
    elif cut < 8 + length:
      where = "inside its header"
      sizes = f"its first 8 bytes give a header of {length} bytes, and it has {cut - 8} after them"
    else:
      where = f"before the data of tensor {'a' if cut < 8 + length + 8 else 'b'!r}"
      sizes = f"its header gives 20 bytes of data, and it has {cut - 8 - length} after the header"
    message = f"cut.safetensors ends {where}: the file is truncated (an interrupted download or "
    with pytest.raises(ValueError, match=_pattern(f"{message}copy?); {sizes}. Fetch it again.")):
      tensor_files.tensors(tmp_path / "cut.safetensors")
