"""The layout plan, over random shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import zerojax
from zerojax._src import layout as layout_lib

shapes = st.lists(st.integers(1, 40), min_size=0, max_size=4).map(tuple)
num_shards = st.sampled_from([1, 2, 4, 8])


def plan_one(shape, n, **kwargs):
  leaf = jax.ShapeDtypeStruct(shape, jnp.float32)
  kwargs.setdefault("min_shard_size", 1)
  return layout_lib.plan(leaf, axis_name="data", num_shards=n, **kwargs).leaves[0]


@settings(max_examples=300, deadline=None)
@given(shapes, num_shards)
def test_default_plan_invariants(shape, n):
  leaf = plan_one(shape, n)
  # Never the leading (stacked-layer) dimension, nor one of size 1 (padded, a
  # device would store as much as the whole leaf).
  candidates = [d for d in range(1 if len(shape) >= 2 else 0, len(shape)) if shape[d] > 1]
  if not candidates:
    assert leaf.dim is None
    return
  assert leaf.dim is not None and leaf.dim + len(shape) in candidates
  assert leaf.padded_size % n == 0
  assert shape[leaf.dim] <= leaf.padded_size < shape[leaf.dim] + n
  divisible = [d for d in candidates if shape[d] % n == 0]
  if divisible:
    assert leaf.padding == 0, "a divisible dimension is preferred to padding"
    assert leaf.dim == divisible[0] - len(shape), "the most major divisible dimension"
  assert leaf.spec[leaf.dim] == "data"


@settings(max_examples=50, deadline=None)  # eager jnp.pad compiles once per shape
@given(shapes, num_shards)
def test_pad_unpad_round_trip(shape, n):
  leaf = plan_one(shape, n)
  x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
  padded = leaf.pad(jnp.asarray(x))
  assert padded.shape == leaf.stored_shape
  np.testing.assert_array_equal(leaf.unpad(padded), x)
  assert float(jnp.sum(padded)) == pytest.approx(float(x.sum()))


@settings(max_examples=100, deadline=None)
@given(shapes, num_shards)
def test_sharded_dim_is_scan_stable(shape, n):
  """Slicing off a leading stacked dim keeps the dim's meaning (it counts from the end)."""
  stacked = plan_one((3, *shape), n)
  if stacked.dim is not None and shape:
    assert stacked.shape[stacked.dim] == shape[stacked.dim]


def test_small_and_integer_leaves_stay_replicated():
  tree = {"bias": jnp.zeros(8), "step": jnp.zeros((64, 64), jnp.int32), "w": jnp.zeros((64, 64))}
  layout = layout_lib.plan(tree, axis_name="data", num_shards=8)
  dims = layout.map(lambda leaf: leaf.dim)
  assert dims == {"bias": None, "step": None, "w": -1}


def test_override_with_partition_specs_and_rule():
  tree = {"a": jnp.zeros((16, 64)), "b": jnp.zeros((16, 64))}
  by_tree = layout_lib.plan(
    tree, axis_name="data", num_shards=8, rule={"a": P("data"), "b": P()}
  ).map(lambda leaf: leaf.dim)
  assert by_tree == {"a": -2, "b": None}
  by_rule = layout_lib.plan(
    tree,
    axis_name="data",
    num_shards=8,
    rule=lambda path, leaf: P("data", None) if path[0].key == "a" else None,
  ).map(lambda leaf: leaf.dim)
  assert by_rule == {"a": -2, "b": -1}


def test_state_mirrors_parameter_dims():
  params = {"w": jnp.zeros((16, 64))}
  sharded = layout_lib.plan(params, axis_name="data", num_shards=8, rule={"w": P("data")})
  state = {"mu": {"w": jnp.zeros((16, 64))}, "count": jnp.zeros((), jnp.int32)}
  planned = layout_lib.plan(state, axis_name="data", num_shards=8, like=sharded)
  assert planned.map(lambda leaf: leaf.dim) == {"mu": {"w": -2}, "count": None}


@pytest.mark.parametrize(
  "rule, message",
  [
    ({"w": "data"}, "give a PartitionSpec"),
    ({"w": P(None, None, "data")}, "has 3 entries"),
    ({"w": P("data", "data")}, "more than once"),
  ],
)
def test_bad_overrides_raise(rule, message):
  with pytest.raises(ValueError, match=message):
    layout_lib.plan({"w": jnp.zeros((16, 64))}, axis_name="data", num_shards=8, rule=rule)


def test_non_array_leaf_raises():
  with pytest.raises(ValueError, match="not an array"):
    layout_lib.plan({"w": "hello"}, axis_name="data", num_shards=8)


def test_default_shard_dim_is_public():
  assert zerojax.default_shard_dim((4, 1024, 7), 8) == -2
