"""Host offload: where the state lives, what the compiled step expects, and that no number changes.

``offload="optimizer"`` keeps the wrapped optimizer's state in ``pinned_host``
memory; ``"optimizer+master"`` the master copy too (stage 3 then stores its
shards in the compute dtype). Each configuration is trained once, with and
without offload, on the explicit and the drop-in path, and every test reads
what it needs from those runs; the stages and paths alternate between explicit
mesh axes (``jax.make_mesh``'s default) and ``Auto`` ones.

On CPU, host and device memory are the same RAM, so these tests check
placement (memory kinds of the live arrays, memory spaces of the compiled
step) and arithmetic, not speed; docs/offload.md says what an accelerator adds.
"""

import copy
import functools
import re
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import zerojax
from tests import models, test_meshes
from tests.test_precision import FP16, assert_bit_identical, poisoned_batch
from zerojax._src import offload as offload_lib

STAGES = {1: zerojax.zero1, 2: zerojax.zero2, 3: zerojax.zero3}
PRECISIONS = {"fp32": "fp32", "bf16": "bf16", "fp16": FP16}
PATHS = ("explicit", "drop-in")
MODES = ("optimizer", "optimizer+master")
STEPS = 20
POISONED_STEP = 7  # fp16 runs see an inf here, which the loss scale skips
HOST = "pinned_host"


def inner():
  # Clipping needs a global norm over offloaded-then-fetched state's gradients.
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))


def mesh_for(stage: int, path: str):
  """Explicit axes or Auto, alternating so that each stage and each path meets both."""
  explicit = (stage + PATHS.index(path)) % 2 == 1
  return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit if explicit else AxisType.Auto,))


def make_step(tx, path: str):
  """One jitted training step on ``path``; the drop-in one does mixed precision by hand.

  The drop-in loss sees the parameters cast to the compute dtype, as a
  mixed-precision step must when stage 3 stores the master copy (without
  offload) and a no-op when it stores the compute copy (``optimizer+master``),
  and scales the loss itself (docs/precision.md).
  """
  compute = tx.precision.compute

  def drop_in(params, state, *batch):
    scale = 1.0 if state.loss_scale is None else state.loss_scale.scale

    def scaled_loss(params):
      params = tx.unpad(params)
      if compute is not None:
        params = jax.tree.map(lambda p: p.astype(compute), params)
      return models.loss_fn(params, *batch).astype(jnp.float32) * scale

    loss, grads = jax.value_and_grad(scaled_loss)(params)
    return loss / scale, jax.tree.map(lambda g: g.astype(jnp.float32) / scale, grads)

  def explicit(params, state, *batch):
    return zerojax.value_and_grad(models.loss_fn, tx)(params, *batch, opt_state=state)

  gradients = explicit if path == "explicit" else drop_in

  @jax.jit
  def step(params, state, *batch):
    loss, grads = gradients(params, state, *batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  return step


def placement(state: zerojax.ZeroState) -> dict[str, set[str]]:
  """The memory kinds of each field's leaves."""
  return {
    name: {x.sharding.memory_kind for x in jax.tree.leaves(getattr(state, name))}
    for name in state._fields
    if jax.tree.leaves(getattr(state, name))
  }


def expected_placement(state: zerojax.ZeroState, offload: str | None) -> dict[str, set[str]]:
  moved = offload_lib.Offload(offload).fields
  return {name: {HOST if name in moved else "device"} for name in placement(state)}


class Run(NamedTuple):
  tx: Any
  params: Any
  state: Any
  losses: np.ndarray
  placements: list  # after init, then after every step
  step: Any


@functools.cache
def run(stage: int, precision: str, path: str, offload: str | None) -> Run:
  """STEPS steps of one configuration, compiled once."""
  tx = STAGES[stage](
    inner(), mesh=mesh_for(stage, path), precision=PRECISIONS[precision], offload=offload
  )
  full = models.make_params()
  state, params = tx.init(full), tx.shard(full)
  placements = [placement(state)]
  step = make_step(tx, path)
  losses, cache_sizes = [], []
  for index in range(STEPS):
    poisoned = precision == "fp16" and index == POISONED_STEP
    batch = poisoned_batch() if poisoned else models.make_batch()
    params, state, loss = step(params, state, *batch)
    placements.append(placement(state))
    losses.append(loss)
    cache_sizes.append(step._cache_size())
  # No step after the second is dispatched anew (init's state and a step's
  # differ in how their scalars are committed, not in what XLA compiles).
  assert cache_sizes[1:] == [cache_sizes[1]] * (STEPS - 1)
  return Run(tx, params, state, np.asarray(losses), placements, step)


CONFIGURATIONS = [
  (stage, precision, path, mode)
  for stage in STAGES
  for precision in PRECISIONS
  for path in PATHS
  for mode in MODES
  if not (precision == "fp32" and mode == "optimizer+master")
]


def _id(configuration) -> str:
  return "-".join(map(str, configuration))


@pytest.mark.parametrize("configuration", CONFIGURATIONS, ids=_id)
def test_state_lives_in_host_memory_after_init_and_every_step(configuration):
  stage, precision, path, mode = configuration
  result = run(*configuration)
  expected = expected_placement(result.state, mode)
  assert expected["inner_state"] == {HOST}
  for when, found in enumerate(result.placements):
    assert found == expected, f"after step {when}" if when else "after init"
  # The parameters and gradients stay where compute needs them.
  assert {x.sharding.memory_kind for x in jax.tree.leaves(result.params)} == {"device"}


@pytest.mark.parametrize("configuration", CONFIGURATIONS, ids=_id)
def test_offload_changes_no_number(configuration):
  stage, precision, path, mode = configuration
  offloaded, plain = run(*configuration), run(stage, precision, path, None)
  assert_bit_identical(offloaded.losses, plain.losses)
  for name in ("inner_state", "loss_scale", "skipped_steps", "pre_clip_grad_norm"):
    assert_bit_identical(getattr(offloaded.state, name), getattr(plain.state, name))
  # The master copy, wherever each keeps it; and the parameters as stored (stage 3
  # under optimizer+master stores the master copy rounded to the compute dtype).
  master = lambda r: r.tx.gather(r.tx.master_params(r.params, r.state))
  assert_bit_identical(master(offloaded), master(plain))
  stored = offloaded.tx.gather(offloaded.params)
  rounded = jax.tree.map(lambda p, s: p.astype(s.dtype), plain.tx.gather(plain.params), stored)
  assert_bit_identical(stored, rounded)
  if precision == "fp16":
    assert int(offloaded.state.skipped_steps) == 1  # the poisoned step, skipped
