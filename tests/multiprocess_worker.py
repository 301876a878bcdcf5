"""One process of a multi-process test job, started by ``python -m zerojax_launch``.

``train OUT [RESTORE]``: for stages 1, 2 and 3 (explicit path), train
``tests.models`` for a few steps on the global batch assembled with
``global_batch``, then gather the parameters three ways and profile the step;
train each stage on the drop-in path (plain ``jax.value_and_grad``) too;
save the stage-3 state to ``OUT/checkpoint`` and restore the one in
``RESTORE/checkpoint``, if given; train each stage again under hybrid sharding,
on a (replica, data) mesh whose replicas are the processes (one "node" each),
and stage 3 there with int8-quantized communication, and with its optimizer
state in host memory; train stage 3 on a (node, data) mesh whose nodes are the
processes, split over both axes, with hpZ and without;
provoke ``global_batch``'s errors, and ``tx.shard``'s for models that differ. Every process writes
what it saw to ``OUT/p<process id>.npz`` and ``.json``. The test runs the same
function in its own single process for the comparison. ``raise OUT``: every process starts a
checkpoint save into ``OUT`` at step 2, and process 1 raises while it is in flight.
``preempt``: with JAX's preemption service off (so ``preemption_requested``
all-gathers its own SIGTERM flag), process 1 sends itself SIGTERM at step 3;
every process prints the step it stopped at and exits preempted (on the first
attempt; a second one exits at once).
"""

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import jax
import numpy as np
import optax
from jax.experimental import multihost_utils

import zerojax
from tests import models
from tests.helpers import STAGES

STEPS = 3


def local_rows(batch):
  """This process's equal, contiguous share of the global batch rows."""
  rows = models.BATCH // jax.process_count()
  start = jax.process_index() * rows
  return tuple(np.asarray(x)[start : start + rows] for x in batch)


def start(stage, mesh, path="explicit"):
  tx = STAGES[stage](optax.adam(1e-2), mesh=mesh)
  params = tx.shard(models.make_params())
  step = models.explicit_step(tx) if path == "explicit" else models.drop_in_step(tx)
  return tx, params, tx.init(params), step


def flat(prefix, tree):
  """``{prefix + path: leaf}`` for every leaf of ``tree``."""
  return {
    prefix + jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


def checkpoint_spec(mesh):
  """The spec of the stage-3 training state that ``train`` saves."""
  tx = STAGES[3](optax.adam(1e-2), mesh=mesh)
  return zerojax.train_state_spec(tx, models.make_params())


def save(mesh, state, out: Path):
  """Saves ``state`` to ``out/checkpoint``; returns its arrays, whole, padding included."""
  with zerojax.CheckpointManager(out / "checkpoint", checkpoint_spec(mesh)) as manager:
    manager.save(STEPS, state)
  return flat("checkpoint/saved", multihost_utils.process_allgather(state, tiled=True))


def restore_from(mesh, directory: Path):
  """The state in ``directory/checkpoint``, restored onto ``mesh``, as whole arrays."""
  with zerojax.CheckpointManager(directory / "checkpoint", checkpoint_spec(mesh)) as manager:
    return flat(
      "checkpoint/restored", multihost_utils.process_allgather(manager.restore(), tiled=True)
    )


def train(out: Path, restore: Path | None = None) -> None:
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  batch = zerojax.distributed.global_batch(local_rows(models.make_batch()), mesh)
  arrays = flat("batch", multihost_utils.process_allgather(batch, tiled=True))
  report = {"process_count": jax.process_count(), "stages": {}}
  for stage in STAGES:
    tx, params, state, step = start(stage, mesh)
    losses = []
    for _ in range(STEPS):
      params, state, loss = step(params, state, *batch)
      losses.append(float(loss))
    to_zero = zerojax.distributed.gather_to_host(tx, params, process=0)
    # A tiny piece size, so that stacked and big leaves go a block of rows at a time.
    to_all = zerojax.distributed.gather_to_host(tx, params, process=None, max_piece_bytes=256)
    gathered = jax.tree.map(np.asarray, tx.gather(params))
    arrays.update(flat(f"{stage}/tx.gather", gathered) | flat(f"{stage}/to_all", to_all))
    if to_zero is not None:
      arrays.update(flat(f"{stage}/to_zero", to_zero))
    profile = zerojax.diagnostics.profile(step, params, state, *batch)
    report["stages"][stage] = {
      "losses": losses,
      "received_to_zero": to_zero is not None,
      "argument_bytes": profile.argument_bytes,
      "collectives": {kind: [c.count, c.bytes] for kind, c in profile.collectives.items()},
    }
    tx, drop_in, drop_in_state, drop_in_step = start(stage, mesh, path="drop-in")
    for _ in range(STEPS):
      drop_in, drop_in_state, loss = drop_in_step(drop_in, drop_in_state, *batch)
      report["stages"][stage].setdefault("drop_in_losses", []).append(float(loss))
    arrays.update(flat(f"drop-in/{stage}/to_all", zerojax.distributed.gather_to_host(tx, drop_in)))
  arrays.update(save(mesh, {"params": params, "opt_state": state}, out))
  if restore is not None:
    arrays.update(restore_from(mesh, restore))
  arrays.update(train_hybrid(report))
  arrays.update(train_hpz(report))
  report["errors"] = batch_errors(mesh)
  np.savez(out / f"p{jax.process_index()}.npz", **arrays)
  (out / f"p{jax.process_index()}.json").write_text(json.dumps(report))


def train_hybrid(report) -> dict:
  """Each stage on a (2, N / 2) (replica, data) mesh: process p's devices are replica p."""
  mesh = jax.make_mesh((2, jax.device_count() // 2), ("replica", "data"))
  if jax.process_count() == 2:
    owners = [{d.process_index for d in row} for row in mesh.devices]
    assert owners == [{0}, {1}], f"each replica should be one process, got {owners}"
  batch = zerojax.distributed.global_batch(
    local_rows(models.make_batch()), mesh, axis_name=("replica", "data")
  )
  arrays = {}
  quantized = dict(quantized_weights="int8", quantized_gradients="int8")
  # Stage 3 once more with ZeRO++'s quantized gathers and reductions: the
  # cross-replica reduction is then an all-to-all and an all-gather of int8
  # codes between the processes.
  runs = [(stage, "hybrid", {}) for stage in STAGES] + [(3, "quantized", quantized)]
  runs.append((3, "offloaded", {"offload": "optimizer"}))
  for stage, name, options in runs:
    tx = STAGES[stage](optax.adam(1e-2), mesh=mesh, replica_axis="replica", **options)
    params = tx.shard(models.make_params())
    state, step = tx.init(params), models.explicit_step(tx)
    for _ in range(STEPS):
      params, state, loss = step(params, state, *batch)
      report["stages"][stage].setdefault(f"{name}_losses", []).append(float(loss))
    arrays.update(
      flat(f"{name}/{stage}/to_all", zerojax.distributed.gather_to_host(tx, params, process=None))
    )
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state.inner_state)}
    report["stages"][stage][f"{name}_state_in"] = sorted(kinds)
  return arrays


def train_hpz(report) -> dict:
  """Stage 3 over a (2, N / 2) (node, data) mesh, with hpZ and without: process p is node p."""
  mesh = jax.make_mesh((2, jax.device_count() // 2), ("node", "data"))
  batch = zerojax.distributed.global_batch(
    local_rows(models.make_batch()), mesh, axis_name=("node", "data")
  )
  arrays = {}
  for name, options in (("full", {}), ("hpz", {"secondary_axis": "data"})):
    tx = zerojax.zero3(optax.adam(1e-2), mesh=mesh, axis_name=("node", "data"), **options)
    params = tx.shard(models.make_params())
    state, step = tx.init(params), models.explicit_step(tx)
    for _ in range(STEPS):
      params, state, loss = step(params, state, *batch)
      report["stages"][3].setdefault(f"{name}_losses", []).append(float(loss))
    counted = zerojax.diagnostics.count_collectives_by_axes(
      step.lower(params, state, *batch).compile(), mesh
    )
    report["stages"][3][f"{name}_bytes"] = {
      " ".join(axes): {kind: c.bytes for kind, c in kinds.items() if c.count}
      for axes, kinds in counted.items()
    }
    to_all = zerojax.distributed.gather_to_host(tx, params, process=None)
    arrays.update(flat(f"{name}/3/to_all", to_all))
  return arrays


def batch_errors(mesh):
  """The messages of ``global_batch`` for rows that do not divide, and for processes that differ;
  and of ``tx.shard`` for processes whose models differ."""
  errors = {}
  rows = jax.local_device_count()
  cases = {"indivisible": np.zeros((rows + 1, 3), np.float32)}
  if jax.process_count() > 1:
    cases["mismatch"] = np.zeros((rows * (1 + jax.process_index()), 3), np.float32)
  for name, local in cases.items():
    try:
      zerojax.distributed.global_batch(local, mesh)
    except ValueError as error:
      errors[name] = str(error)
  if jax.process_count() > 1:
    try:
      zerojax.zero3(optax.sgd(0.1), mesh=mesh).shard(
        {"w": np.zeros((4, 1024 * (1 + jax.process_index())), np.float32)}
      )
    except ValueError as error:
      errors["models"] = str(error)
  return errors


def steps(mode: str, out: Path | None = None) -> None:
  """Trains step after step until ``mode``'s fault ends the process."""
  if mode == "preempt" and os.environ.get("ZEROJAX_ATTEMPT") != "1":
    return
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  batch = zerojax.distributed.global_batch(local_rows(models.make_batch()), mesh)
  _, params, state, step = start(3, mesh)
  faulty = jax.process_index() == 1
  for count in range(10**6):
    params, state, loss = step(params, state, *batch)
    print(f"step {count}: loss {float(loss):.4f}", flush=True)
    if mode == "raise" and count == 2:
      # A save in flight, whose commit waits for the other process, as the fault strikes.
      checkpoints = zerojax.CheckpointManager(out / "checkpoint", checkpoint_spec(mesh))
      checkpoints.save(count, {"params": params, "opt_state": state})
      if faulty:
        raise RuntimeError("injected fault at step 2")
    if mode == "preempt":
      if count == 3 and faulty:
        os.kill(os.getpid(), signal.SIGTERM)
      if zerojax.distributed.preemption_requested(count):
        print(f"stopped after step {count}", flush=True)
        sys.exit(zerojax.distributed.PREEMPTED_EXIT_CODE)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("mode", choices=["train", "raise", "preempt"])
  parser.add_argument("out", type=Path, nargs="?")
  parser.add_argument("restore", type=Path, nargs="?")
  args = parser.parse_args(argv)
  if args.mode == "preempt":
    jax.config.update("jax_enable_preemption_service", False)
  # A long shutdown timeout: a crash must not wait for it (initialize skips the
  # exit barrier after an uncaught exception).
  zerojax.distributed.initialize(heartbeat_timeout=20, collective_timeout=60, shutdown_timeout=120)
  train(args.out, args.restore) if args.mode == "train" else steps(args.mode, args.out)


if __name__ == "__main__":
  sys.exit(main())
