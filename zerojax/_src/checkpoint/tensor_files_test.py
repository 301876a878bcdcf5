"""Reading a region of a safetensors tensor: every way of reading gives numpy's slice of it."""

import itertools

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from zerojax._src.checkpoint import tensor_files

SHAPES = [(), (7,), (5, 9), (3, 4, 11), (2, 3, 5, 6)]


@pytest.mark.parametrize(
  # Whole rows through a buffer of 2 rows or of 1; each row's part alone; the defaults.
  ("rows_buffer", "min_span"),
  [(64, 10**9), (8, 10**9), (10**9, 1), (tensor_files.ROWS_BUFFER_BYTES, 0)],
)
def test_every_region_reads_as_numpy_slices_it(tmp_path, monkeypatch, rows_buffer, min_span):
  monkeypatch.setattr(tensor_files, "ROWS_BUFFER_BYTES", rows_buffer)
  monkeypatch.setattr(tensor_files, "MIN_SPAN_BYTES", min_span)
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
