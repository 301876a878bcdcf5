"""Reading a region of a safetensors tensor: every way of reading gives numpy's slice of it."""

import itertools
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

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
  from safetensors.numpy import load_file

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
