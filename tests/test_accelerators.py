"""The programs an 8 x H100 host and a TPU v5e-8 would run, compiled here without them.

tests/accelerator_worker.py compiles a small training step for each setup in a
process of its own (the compilers read their environment when they load), and
these tests read what it reports: per-device memory from
``memory_analysis()``, each layer loop's collectives from the scheduled
program, and on GPU XLA's own estimate of the step. The CPU backend cannot
show any of it: its collectives are synchronous and it lays memory out its
own way. docs/performance.md has the same measurements on bigger models
(``python benchmarks/accelerators.py``).
"""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import accelerator_worker as worker
from zerojax.diagnostics import deviceless_environment

#: One layer's weights (what a gather makes whole), in bytes.
LAYER = 4 * 2 * worker.D * worker.F
#: One layer of the biased model, gathered in bfloat16: two matrices of the odd width, two biases.
BIASED_LAYER = 2 * (2 * worker.D * worker.ODD + worker.ODD + worker.D)
ZERO3 = (
  "zero3 scan",
  "zero3 scan, deferred reductions",
  "zero3 scan, prefetch=0",
  "zero3 gather",
  "zero3 drop-in",
)
# XLA:TPU takes 15-30 s of CPU per program here, so CI compiles for it the two paths that
# open shards differently (the prefetching loop, and gather's derivative rule) and the
# baseline; benchmarks/accelerators.py compiles every path.
TPU_ZERO3 = ("zero3 scan", "zero3 gather")
#: The biased model's paths held to a layer of GSPMD FSDP. Not "zero3 gather (biased)": a
#: jax.lax.scan of zerojax.gather holds 1.26 of its layers more on GPU, where XLA pipelines each
#: iteration's reduce-scatters into the next (docs/performance.md).
BIASED = ("zero3 scan (biased)", "zero3 scan, prefetch=0 (biased)")
TPU_SETUPS = ("GSPMD FSDP", *TPU_ZERO3, "GSPMD FSDP (biased)", *BIASED)


@functools.cache
def compiled(target: str, *setups: str) -> dict:
  """What the worker reports for ``setups`` (all if none) compiled for ``target``."""
  out = Path(os.environ.get("ZEROJAX_TESTS_JAX_CACHE", "/tmp")) / f"accelerators-{target}.json"
  # The compiler's own flags and platform, not the CPU test flags (conftest's).
  env = {**os.environ, **deviceless_environment(target)}
  command = [sys.executable, str(Path(worker.__file__)), target, str(out), *setups]
  done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-5000:]
  return json.loads(out.read_text())


def gpu() -> dict:
  return compiled("h100x8")


def test_gpu_layer_loops_overlap_every_collective_with_compute():
  # Deferred reductions (docs/performance.md's choice on GPUs): every collective of both layer
  # loops is asynchronous, with compute between its start and its done, and none is of a value
  # its own iteration computes.
  loops = gpu()["zero3 scan, deferred reductions"]["loops"]
  assert len(loops) == 2  # forward and backward
  for loop in loops:
    moved = loop["gathers"] + loop["reductions"]
    assert moved and loop["asynchronous"] == moved, loop
    assert loop["overlapped"] == moved, loop  # compute between every start and its done
    assert loop["waiting_gathers"] == loop["waiting_reductions"] == 0, loop


def test_gpu_layer_loops_overlap_every_gather_by_default():
  # Reduced in their own iteration (the default), the gradients wait for that iteration's
  # matmuls; the gathers still wait on nothing and overlap compute.
  forward, backward = gpu()["zero3 scan"]["loops"]
  for loop in (forward, backward):
    moved = loop["gathers"] + loop["reductions"]
    assert loop["asynchronous"] == moved and loop["waiting_gathers"] == 0, loop
  assert forward["overlapped"] == forward["gathers"], forward
  assert backward["overlapped"] >= backward["gathers"], backward


def test_gpu_the_overlap_check_fails_on_a_serialised_loop():
  loops = gpu()["zero3 scan, prefetch=0"]["loops"]
  assert any(loop["waiting_gathers"] for loop in loops)
  assert any(loop["overlapped"] < loop["gathers"] + loop["reductions"] for loop in loops)


def test_gpu_prefetching_step_beats_gspmd_fsdp_in_xlas_estimate():
  assert gpu()["zero3 scan"]["cycles"] < gpu()["GSPMD FSDP"]["cycles"]


def test_gpu_xla_pipelines_only_the_serial_paths_reduce_scatters():
  # Why the serial paths take 1.02-1.03x GSPMD FSDP's step here (docs/performance.md, "Where
  # the remaining gaps come from"): XLA's collective pipeliner carries each explicit
  # reduce-scatter into the next iteration of a jax.lax.scan and the last one out of the loop,
  # where it waits on nothing. GSPMD FSDP's gradient is an all-reduce and a slice until after
  # that pass (XLA makes the reduce-scatter later), and zerojax.scan's loop is its own.
  found = gpu()
  assert found["GSPMD FSDP"]["pipelined_reductions"] == 0
  assert found["zero3 scan"]["pipelined_reductions"] == 0
  for setup in ("zero3 gather", "zero3 scan, prefetch=0"):
    assert found[setup]["pipelined_reductions"] > 0, setup


@pytest.mark.parametrize("setup", ZERO3)
def test_gpu_zero3_temporaries_within_a_layer_of_gspmd_fsdp(setup):
  assert gpu()[setup]["temporaries"] <= gpu()["GSPMD FSDP"]["temporaries"] + LAYER


@pytest.mark.parametrize("setup", ["zero1", "zero2"])
def test_gpu_zero1_and_zero2_temporaries_within_plain_data_parallelism(setup):
  assert gpu()[setup]["temporaries"] <= 1.1 * gpu()["plain DP"]["temporaries"]


@pytest.mark.parametrize("setup", TPU_ZERO3)
def test_tpu_zero3_temporaries_within_a_layer_of_gspmd_fsdp(setup):
  tpu = compiled("v5e-8", *TPU_SETUPS)
  assert tpu[setup]["temporaries"] <= tpu["GSPMD FSDP"]["temporaries"] + LAYER


@pytest.mark.parametrize("setup", BIASED)
def test_tpu_keeps_no_bfloat16_copy_of_the_stacked_shards(setup):
  # XLA:TPU narrows a float32 stack to bfloat16 before a loop that casts each layer's slice:
  # every layer's shard, alive for the whole loop (0.5 GiB a chip for a 70B model on 256). It
  # does so for GSPMD FSDP (which shows the count sees it); zerojax rounds each layer's bits.
  tpu = compiled("v5e-8", *TPU_SETUPS)
  assert tpu["GSPMD FSDP (biased)"]["narrowed_stacks"] > 0
  assert tpu[setup]["narrowed_stacks"] == 0


@pytest.mark.parametrize("target", ["h100x8", "v5e-8"])
@pytest.mark.parametrize("setup", BIASED)
def test_zero3_temporaries_of_a_biased_odd_bfloat16_model_within_a_layer(target, setup):
  # Biases and a hidden width 8 devices do not divide (padded shards), gathered in bfloat16.
  found = gpu() if target == "h100x8" else compiled("v5e-8", *TPU_SETUPS)
  assert found[setup]["temporaries"] <= found["GSPMD FSDP (biased)"]["temporaries"] + BIASED_LAYER
