"""The master copy's moves alone, between the places stages keep it (through the manager:
tests/test_checkpoint.py)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.helpers import (
  AXIS_TYPES,
  assert_placed,
  checkpoint_spec,
  checkpoint_tx,
  random_state,
  unpadded,
)
from zerojax import StateSpec
from zerojax._src.checkpoint import master as master_lib


@pytest.mark.parametrize("saved", [1, 2, 3])
@pytest.mark.parametrize("target", [1, 2, 3])
def test_the_master_copy_is_read_where_saved_and_moved_where_the_spec_keeps_it(target, saved):
  spec, saved_spec = (checkpoint_spec(checkpoint_tx(8, stage, "bf16")) for stage in (target, saved))
  plan = master_lib.reading_plan(spec, saved_spec.master_path)
  # What is read: the checkpoint's master copy, into the spec's master shardings, and no
  # rounded params (a restore remakes them).
  assert master_lib.at(plan, saved_spec.master_path) is master_lib.at(spec.stored, spec.master_path)
  assert ("params" in plan) == (saved == 3)
  if saved == 3 and target != 3:  # the spec's master slot is read from the saved params
    assert plan["opt_state"].master is None
  # Moved back, every leaf is where the spec has it; params are left to be rounded.
  state = master_lib.master_in_place(spec, saved_spec.master_path, plan)
  expected = spec.stored if target == 3 else {**spec.stored, "params": None}
  assert jax.tree.structure(state) == jax.tree.structure(expected)
  assert all(a is b for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(expected), strict=True))


def test_at_and_replaced_walk_dicts_named_tuples_lists_and_tuples():
  adam = lambda: optax.ScaleByAdamState(count=0, mu=[1, (2, 3)], nu=None)  # pyright: ignore
  tree = {"opt_state": adam()}
  new = master_lib.replaced(tree, ("opt_state", "mu", 1, 0), "x")
  assert master_lib.at(new, ("opt_state", "mu", 1)) == ("x", 3)
  assert tree == {"opt_state": adam()}
  assert master_lib.replaced(tree, (), "all") == "all"
  assert master_lib.at(master_lib.replaced({}, ("params",), 1), ("params",)) == 1


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_rounded_params_are_the_master_copy_cut_and_cast(axis_type):
  spec = checkpoint_spec(checkpoint_tx(8, 2, "bf16", axis_type))
  master = random_state(spec)["opt_state"].master
  chex.assert_shape(master["w"], (5, 1008))  # padded, split over the data axis
  params = master_lib.rounded(master, spec.logical["params"], spec.stored["params"])
  assert_placed(params, StateSpec(spec.stored["params"], spec.logical["params"]))
  expected = jax.tree.map(
    lambda x: x.astype(jnp.bfloat16), unpadded(master, spec.logical["params"])
  )
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, params), expected, strict=True)
