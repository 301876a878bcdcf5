"""Loading into shards on 2 processes x 4 CPU devices: each process reads only the bytes of its
own shards, and its peak memory grows by about its half of the file, not the file.

The job runs ``tests/load_worker.py`` under ``python -m zerojax_launch``; its numbers are
measured in benchmarks/loading.py (docs/loading.md), this checks a loose bound.
"""

import json
import subprocess
import sys

from tests import environment, load_worker


def test_each_process_reads_and_holds_only_its_half(tmp_path):
  load_worker.write_model(tmp_path / "model.safetensors")
  done = subprocess.run(
    [
      *(sys.executable, "-m", "zerojax_launch", "-n", "2", "--devices-per-process", "4"),
      *("--timeout", "300", "tests/load_worker.py", str(tmp_path)),
    ],
    cwd=environment.ROOT,
    env=environment.subprocess_env(),
    capture_output=True,
    text=True,
    timeout=330,
  )
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
  layers = {0: ["layers.0", "layers.1"], 1: ["layers.2", "layers.3"]}
  for process in (0, 1):
    report = json.loads((tmp_path / f"p{process}.json").read_text())
    assert report["exact"], report
    assert abs(report["held_mib"] - report["file_mib"] / 2) < 0.1, report  # its half
    # Its half (on CPU, where the devices' memory is the process's), plus a leaf's share and
    # the runtime's buffers: measured about 0.65 of the file; reading the file whole is >= 1.
    assert report["growth_mib"] < 0.75 * report["file_mib"], report
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
