"""Loading into shards on 2 processes x 4 CPU devices: each process reads only the bytes of its
own shards, and its peak memory grows by its share of the file and a read piece, not the file.

The jobs run ``tests/load_worker.py`` under ``python -m zerojax_launch``; their numbers are
measured in benchmarks/loading.py (docs/loading.md), these check bounds.
"""

import json

import pytest

from tests import load_worker
from tests.helpers import AXIS_TYPES, launch_worker
from zerojax._src.checkpoint import load

#: A piece as the file stores it and as cast (each at most ``PIECE_BYTES``): what a process may
#: hold beyond its shards.
PIECE_MIB = 2 * load.PIECE_BYTES / 2**20
#: What its peak may grow by beyond those: the heap's slack and the runtime's own buffers
#: (measured: 0 to 2 MiB).
ALLOWANCE_MIB = 2


def test_each_process_reads_and_holds_only_its_half(tmp_path):
  load_worker.write_model(tmp_path / "model.safetensors")
  launch_worker("tests/load_worker.py", str(tmp_path))
  layers = {0: ["layers.0", "layers.1"], 1: ["layers.2", "layers.3"]}
  for process in (0, 1):
    report = json.loads((tmp_path / f"p{process}.json").read_text())
    assert report["exact"], report
    assert abs(report["held_mib"] - report["file_mib"] / 2) < 0.1, report  # its half
    # Its half (on CPU, where the devices' memory is the process's) and a piece: measured 68
    # MiB, 0.53 of the file; reading the file whole is >= 1.
    assert report["growth_mib"] <= report["held_mib"] + PIECE_MIB + ALLOWANCE_MIB, report
    # A leaf split over columns: its half of each row alone (the file's header aside), where
    # reading whole rows reads the leaf whole.
    assert report["wide_held_mib"] == 4, report
    assert 4 <= report["wide_read_mib"] < 4.01, report
    # Stage 2 with init=True: its half of an 8 MiB leaf's master copy, not the whole leaf.
    assert 4 <= report["init_read_mib"] < 4.01, report
    # Its own bytes (and the padded leaf's), each read once.
    assert report["read_mib"] < report["held_mib"] + 0.1, report
    # Layers split over a "stage" axis whose entries are the processes: only its own are read.
    assert report["layers_read"] == layers[process], report


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_each_process_holds_its_share_and_one_piece_more(tmp_path, axis_type):
  # A file written by HuggingFace's safetensors, loaded with keys that stack and transpose its
  # layers, cast a bfloat16 tensor and pad: on CPU the devices' memory is the process's, so its
  # share is part of its peak, and the floor.
  load_worker.write_huggingface_model(tmp_path / "huggingface.safetensors")
  launch_worker("tests/load_worker.py", str(tmp_path), "--floor", axis_type)
  for process in (0, 1):
    report = json.loads((tmp_path / f"floor.p{process}.json").read_text())
    assert report["exact"], report  # each shard, as HuggingFace's reader reads the file
    assert abs(report["held_mib"] - 32) < 0.1, report  # its half: 24 MiB of layers, 4 + 4 more
    # Its share and a piece: measured 37.9 MiB, where a host copy of each shard held beside its
    # device's grew by 58 MiB.
    assert report["growth_mib"] <= report["held_mib"] + PIECE_MIB + ALLOWANCE_MIB, report
