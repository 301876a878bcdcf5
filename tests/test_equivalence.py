"""Wrapping an optimizer in zerojax changes memory, never numbers."""

import functools

import chex
import jax
import optax
import optax.contrib
import pytest

from tests import models
from tests.helpers import ROUNDING, STAGES

STEPS = 3


def _all(params, value):
  return {key: value for key in params}


OPTIMIZERS = {
  "sgd_momentum": lambda: optax.sgd(0.05, momentum=0.9),
  "adam": lambda: optax.adam(1e-2),
  "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
  "lion": lambda: optax.lion(1e-3),
  "lamb": lambda: optax.lamb(1e-2),
  "lars": lambda: optax.lars(1e-2),
  "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),
  "adagrad": lambda: optax.adagrad(1e-2),
  "rmsprop": lambda: optax.rmsprop(1e-3),
  "adabelief": lambda: optax.adabelief(1e-2),
  "novograd": lambda: optax.novograd(1e-2),
  "fromage": lambda: optax.fromage(1e-2),
  "yogi": lambda: optax.yogi(1e-2),
  # optax.sm3 itself fails on scalar leaves (IndexError in its update), so the
  # scalar is masked out; every other awkward leaf still goes through sm3.
  "sm3": lambda: optax.masked(
    optax.sm3(1e-2), lambda p: {**jax.tree.map(lambda _: True, p), "scale": False}
  ),
  "radam": lambda: optax.radam(1e-2),
  "nadamw": lambda: optax.nadamw(1e-2),
  "amsgrad": lambda: optax.amsgrad(1e-2),
  "adamax": lambda: optax.adamax(1e-2),
  "adadelta": lambda: optax.adadelta(1.0),
  "adan": lambda: optax.adan(1e-2),
  "muon": lambda: optax.contrib.muon(1e-2),
  "schedule_free_adamw": lambda: optax.contrib.schedule_free_adamw(1e-2),
  "prodigy": lambda: optax.contrib.prodigy(1.0),
  "clip_by_global_norm": lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2)),
  "clip_by_block_rms": lambda: optax.chain(optax.clip_by_block_rms(0.01), optax.sgd(0.1)),
  "masked": lambda: optax.masked(
    optax.adam(1e-2), {"embed": True, "layers": False, "head": True, "odd": False, "scale": True}
  ),
  "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2),
  "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
  "apply_if_finite": lambda: optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=3),
}


@functools.cache
def reference(name):
  """Plain optax on one device, computed once per optimizer for every stage and path."""
  return models.reference(OPTIMIZERS[name](), models.make_params(), models.make_batch(), STEPS)


@pytest.fixture(scope="module")
def problem():
  return models.make_params(), models.make_batch()


# The optimizers that work element by element (their state and updates split leaf by leaf
# like the gradients, with nothing summed across a leaf).
ELEMENT_BY_ELEMENT = {
  *("sgd_momentum", "adamw", "lion", "adagrad", "rmsprop", "adabelief", "yogi", "radam"),
  *("nadamw", "amsgrad", "adamax", "adadelta", "adan", "inject_hyperparams"),
}
# The optimizers that do more (norms, whole-matrix math, factored or per-dimension statistics,
# wrappers) and read the parameters in their update (LAMB's and LARS's trust ratios, Fromage's
# norms, Adafactor's parameter scale, schedule-free's interpolation, Prodigy's distance).
READS_PARAMS = {"lamb", "lars", "fromage", "adafactor", "schedule_free_adamw", "prodigy"}


def explicit_stages(name: str) -> tuple[int, ...]:
  """The stages the explicit path runs ``name`` at.

  Stages differ in how gradients arrive (whole at stage 1, reduce-scattered at 2 and 3) and
  where parameters live (whole at 1 and 2, split at 3), not in how an optimizer's state is
  split. Adam runs at every stage, and so does every optimizer that reads the parameters (stage
  2 meets split gradients with whole parameters). Stage 2 hands the others what stage 3 does:
  they run at stages 1 and 3. The element-by-element optimizers run at stage 3, where
  everything is split.
  """
  if name in ELEMENT_BY_ELEMENT:
    return (3,)
  return (1, 2, 3) if name == "adam" or name in READS_PARAMS else (1, 3)


EXPLICIT_CASES = [(stage, name) for name in sorted(OPTIMIZERS) for stage in explicit_stages(name)]


@pytest.mark.parametrize("stage, name", EXPLICIT_CASES)
def test_explicit_path_matches_plain_optax(stage, name, problem, mesh):
  params, batch = problem
  expected = reference(name)
  # min_shard_size=1 shards (and pads) even the tiny awkward leaves.
  tx = STAGES[stage](OPTIMIZERS[name](), mesh=mesh, min_shard_size=1)
  chex.assert_trees_all_close(models.train(tx, params, batch, STEPS), expected, **ROUNDING)


# The drop-in path differs from the explicit one only in the gradients handed to tx.update
# (whole, from jax.grad, instead of reduce-scattered), whatever the optimizer. So it runs at
# stages 1 and 3 with adam, and with one optimizer of each kind that does more: a global norm,
# a trust ratio read from the parameters, factored statistics, whole-matrix math and a wrapper
# that keeps its own state. Not at stage 2: given whole gradients, stage 2 stores what stage 1
# stores, and its step compiles to stage 1's program.
DROP_IN_OPTIMIZERS = ("adam", "clip_by_global_norm", "lamb", "adafactor", "muon", "multi_steps")
DROP_IN_CASES = [(stage, name) for stage in (1, 3) for name in DROP_IN_OPTIMIZERS]


@pytest.mark.parametrize("stage, name", DROP_IN_CASES)
def test_drop_in_path_matches_plain_optax(stage, name, problem, mesh):
  params, batch = problem
  tx = STAGES[stage](OPTIMIZERS[name](), mesh=mesh, min_shard_size=1)
  actual = models.train(tx, params, batch, STEPS, path="drop_in")
  chex.assert_trees_all_close(actual, reference(name), **ROUNDING)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_default_layout_matches_plain_optax(stage, problem, mesh):
  params, batch = problem
  expected = models.reference(optax.adamw(1e-2), params, batch, STEPS)
  tx = STAGES[stage](optax.adamw(1e-2), mesh=mesh)
  chex.assert_trees_all_close(models.train(tx, params, batch, STEPS), expected, **ROUNDING)
