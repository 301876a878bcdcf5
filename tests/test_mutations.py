"""Deliberate bugs that the suite once missed, and the tests that now catch them.

A mutation review (issue 26) found four bugs that every test passed. Each is
kept here as a ``Mutation``: a one-line change to the source of one function,
compiled and swapped in with ``monkeypatch`` (the module, and every zerojax
module that re-exports the function). Each test below applies one, runs the
tests that guard against it in this process, and expects every one of them to
fail with an ``AssertionError``. A mutation whose original line is gone fails
loudly: update it together with the code.

To see every test a mutation fails, apply it to a whole run, as a plugin::

    ZEROJAX_MUTATION=all_finite_first_leaf_only \\
      python -m pytest -p tests.test_mutations tests/test_nonfinite.py
"""

import __future__

import dataclasses
import functools
import importlib
import inspect
import os
import sys
import textwrap

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AxisType

import zerojax
from tests import test_layout, test_nonfinite, test_precision, test_quantize
from zerojax._src.comm import quantized as quantize
from zerojax._src.core import precision
from zerojax._src.sharding import layout


@dataclasses.dataclass(frozen=True)
class Mutation:
  """Replace ``old`` (found exactly once) by ``new`` in ``module.function``'s source."""

  module: str
  function: str
  old: str
  new: str

  def apply(self, monkeypatch) -> None:
    module = importlib.import_module(self.module)
    owner_name, _, name = self.function.rpartition(".")  # "function" or "Class.method"
    owner = getattr(module, owner_name) if owner_name else None
    original = getattr(owner or module, name)
    lines, first_line = inspect.getsourcelines(original)
    source = textwrap.dedent("".join(lines))
    assert source.count(self.old) == 1, f"{self.module}.{self.function} changed: update {self}"
    # Blank lines first, so tracebacks point at the real line numbers.
    mutated = "\n" * (first_line - 1) + source.replace(self.old, self.new)
    flags = __future__.annotations.compiler_flag
    code = compile(mutated, inspect.getsourcefile(original), "exec", flags=flags, dont_inherit=True)
    namespace = dict(vars(module))
    exec(code, namespace)
    mutant = namespace[name]
    if owner is not None:
      monkeypatch.setattr(owner, name, mutant)
      return
    for module_name, loaded in list(sys.modules.items()):
      if module_name == "zerojax" or module_name.startswith("zerojax."):
        for attribute, value in list(vars(loaded).items()):
          if value is original:
            monkeypatch.setattr(loaded, attribute, mutant)


MUTATIONS = {
  # Issue 26 section 1: the non-finite check looks at the first gradient leaf only.
  "all_finite_first_leaf_only": Mutation(
    "zerojax._src.core.precision",
    "all_finite",
    "for x in jax.tree.leaves(tree) if",
    "for x in jax.tree.leaves(tree)[:1] if",
  ),
  # Section 2: every block's scale 4x its largest magnitude, so levels 4x too coarse.
  "scales_4x_too_coarse": Mutation(
    "zerojax._src.comm.quantized",
    "quantize",
    "scales = jnp.max(jnp.abs(blocks), axis=-1)",
    "scales = 4 * jnp.max(jnp.abs(blocks), axis=-1)",
  ),
  # Section 5: when nothing divides, the smallest free dimension is padded.
  "pad_the_smallest_dimension": Mutation(
    "zerojax._src.sharding.layout",
    "default_shard_dim",
    "return max(group, key=lambda d: (shape[d], d)) - ndim",
    "return min(group, key=lambda d: (shape[d], d)) - ndim",
  ),
  # Section 5: one leaf's update is dropped under bf16. The master copy of
  # stages 1 and 2 keeps its old value for leaf 4 ("odd" in tests/models.py,
  # the leaf that moves least, 1.6e-4 in 3 steps: inside the old tolerance).
  "bf16_leaf_update_dropped": Mutation(
    "zerojax._src.core.optimizer",
    "ShardedOptimizer._update_impl",
    "new_master = optax.apply_updates(state.master, plans.master.pad(new_updates))",
    "new_master = jax.tree.unflatten(jax.tree.structure(state.master), "
    "[o if i == 4 else n for i, (n, o) in enumerate(zip(jax.tree.leaves(optax.apply_updates("
    "state.master, plans.master.pad(new_updates))), jax.tree.leaves(state.master)))])",
  ),
}


def pytest_configure(config):
  """As a plugin (``-p tests.test_mutations``): applies ``$ZEROJAX_MUTATION`` to the whole run."""
  name = os.environ.get("ZEROJAX_MUTATION")
  if name:
    patch = pytest.MonkeyPatch()
    MUTATIONS[name].apply(patch)
    config.add_cleanup(patch.undo)


def auto_mesh():
  return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))


def assert_all_fail(guards):
  for guard in guards:
    with pytest.raises(AssertionError):
      guard()


@pytest.fixture
def fresh_runs(monkeypatch):
  """test_nonfinite's shared compiled steps, built afresh (the mutation is traced into them)."""
  for name in ("run", "quantized_run", "accumulating_run"):
    cached = getattr(test_nonfinite, name)
    monkeypatch.setattr(test_nonfinite, name, functools.cache(cached.__wrapped__))


def test_mutations_change_what_they_should(monkeypatch):
  # Each mutation, applied, does what its name says; so the tests below fail for its reason.
  tree = {"a": jnp.ones(3), "b": jnp.asarray([1.0, jnp.inf])}
  assert not bool(precision.all_finite(tree))
  spec = quantize.Quantization(8, 4)
  assert quantize.quantize(jnp.asarray([1.0, 2.0]), spec).scales.tolist() == [2.0]
  assert layout.default_shard_dim((4, 13, 7), 8) == -2
  master_moves = master_leaves_moved_by_one_bf16_step
  assert master_moves() == [True] * 6
  for mutation in MUTATIONS.values():
    mutation.apply(monkeypatch)
  assert bool(precision.all_finite(tree))
  assert quantize.quantize(jnp.asarray([1.0, 2.0]), spec).scales.tolist() == [8.0]
  assert layout.default_shard_dim((4, 13, 7), 8) == zerojax.default_shard_dim((4, 13, 7), 8) == -1
  assert master_moves() == [True] * 4 + [False, True]


def master_leaves_moved_by_one_bf16_step() -> list[bool]:
  """Which leaves of a stage-1 bf16 master copy one SGD step changes."""
  tx = zerojax.zero1(optax.sgd(1.0), mesh=auto_mesh(), precision="bf16")
  full = {str(i): jnp.full((8,), 1.0 + i) for i in range(6)}
  state, params = tx.init(full), tx.shard(full)
  grads = jax.tree.map(jnp.ones_like, tx.unpad(params))
  _, new_state = jax.jit(tx.update)(grads, state, params)
  new, old = jax.tree.leaves(new_state.master), jax.tree.leaves(state.master)
  return [bool(jnp.any(n != o)) for n, o in zip(new, old, strict=True)]


def test_all_finite_first_leaf_only_is_caught(monkeypatch, fresh_runs):
  MUTATIONS["all_finite_first_leaf_only"].apply(monkeypatch)
  bad_element = test_nonfinite.test_a_non_finite_element_of_one_leaf_skips_the_step
  assert_all_fail(
    [
      lambda: bad_element(3, "explicit", "fp32", "padded leaf, last real column", "nan"),
      lambda: bad_element(1, "drop-in", "fp16", "last leaf", "overflow"),
      lambda: test_nonfinite.test_one_overflowing_micro_batch_of_four_skips_the_step(
        2, "stacked layer 1 of 3"
      ),
    ]
  )


def test_scales_4x_too_coarse_are_caught(monkeypatch):
  MUTATIONS["scales_4x_too_coarse"].apply(monkeypatch)
  round_trip = test_quantize.test_round_trip_is_within_half_a_level_of_every_element
  assert_all_fail(
    [
      lambda: round_trip(test_quantize.INT8, jnp.float32, (3, 337)),
      lambda: round_trip(test_quantize.INT4, jnp.bfloat16, (255,)),
      test_quantize.test_an_outlier_coarsens_only_its_own_block,
      test_quantize.test_quantized_all_gather_moves_each_devices_own_round_trip,
      lambda: test_quantize.test_quantized_reduce_scatter_is_a_sum_within_one_half_level_per_device(
        test_quantize.INT8
      ),
    ]
  )


def test_padding_the_smallest_dimension_is_caught(monkeypatch):
  MUTATIONS["pad_the_smallest_dimension"].apply(monkeypatch)
  largest = test_layout.test_nothing_divides_so_the_largest_free_dimension_is_padded
  assert_all_fail(
    [
      lambda: largest((4, 13, 7), -2),
      lambda: largest((5, 3, 11), -1),
      test_layout.test_nothing_divides_beside_other_mesh_axes_so_the_largest_free_dimension_is_padded,
    ]
  )


def test_a_dropped_bf16_leaf_update_is_caught(monkeypatch):
  MUTATIONS["bf16_leaf_update_dropped"].apply(monkeypatch)
  assert_all_fail(
    [
      lambda: test_precision.test_bf16_policy_trains_like_mixed_precision_by_hand(1, auto_mesh()),
      lambda: test_precision.test_bf16_drop_in_path_keeps_the_master_copy(2, auto_mesh()),
    ]
  )
