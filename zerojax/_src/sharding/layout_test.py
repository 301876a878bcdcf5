"""The layout plan alone, over random shapes: which dimension each leaf splits, its padding,
overrides (the public side, through the transformations: tests/test_layout.py)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from zerojax._src.sharding import layout as layout_lib

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
  else:
    # default_shard_dim: "if nothing divides, the largest free dimension is padded".
    assert shape[leaf.dim] == max(shape[d] for d in candidates), "the largest is padded"
  assert leaf.spec[leaf.dim] == "data"


@pytest.mark.parametrize(
  "shape, dim",
  [
    ((4, 13, 7), -2),  # neither divides: the larger (13) is padded, not the smaller
    ((4, 7, 13), -1),
    ((5, 3, 11), -1),  # whatever the order
    ((9, 13), -1),  # the leading (stacked-layer) dimension is never a candidate
    ((13,), -1),
  ],
)
def test_nothing_divides_so_the_largest_free_dimension_is_padded(shape, dim):
  assert layout_lib.default_shard_dim(shape, 8) == dim
  leaf = plan_one(shape, 8)
  assert (leaf.dim, leaf.padded_size) == (dim, 16)


@settings(max_examples=50, deadline=None)  # eager jnp.pad compiles once per shape
@given(shapes, num_shards)
def test_pad_unpad_round_trip(shape, n):
  leaf = plan_one(shape, n)
  x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
  padded = leaf.pad(jnp.asarray(x))
  chex.assert_shape(padded, leaf.stored_shape)
  np.testing.assert_array_equal(leaf.unpad(padded), x)
  assert float(jnp.sum(padded)) == pytest.approx(float(x.sum()))


@settings(max_examples=100, deadline=None)
@given(shapes.filter(bool), num_shards, st.integers(1, 3))
def test_sharded_dim_is_scan_stable(shape, n, layers):
  """A scan slices one layer off each device's shard: that slice is the device's shard of the layer.

  The plan counts the sharded dimension from the end, so it names the same
  dimension of the stacked leaf and of each layer, and never the layer
  dimension itself: slicing layer ``i`` off device ``j``'s shard of the stored
  stacked array gives device ``j``'s shard of layer ``i``, padded alike.
  """
  stacked = plan_one((layers, *shape), n)
  if stacked.dim is None:
    return
  assert -len(shape) <= stacked.dim < 0, "the layer dimension is never sharded"

  def padded(x):  # zeros appended along the plan's dimension, counted from the end
    widths = [(0, 0)] * x.ndim
    widths[stacked.dim] = (0, stacked.padded_size - x.shape[stacked.dim])
    return np.pad(x, widths)

  x = np.arange(layers * int(np.prod(shape)), dtype=np.float32).reshape(layers, *shape) + 1
  stored = padded(x)
  chex.assert_shape(stored, stacked.stored_shape)
  shards = np.split(stored, n, axis=stacked.dim)  # what device j stores
  for i in range(layers):
    for j, layer_shard in enumerate(np.split(padded(x[i]), n, axis=stacked.dim)):
      np.testing.assert_array_equal(shards[j][i], layer_shard, err_msg=f"layer {i}, device {j}")


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
