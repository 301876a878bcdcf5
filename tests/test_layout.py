"""The layout plan through the public API.

The planner alone, over random shapes: zerojax/_src/sharding/layout_test.py.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax


def test_nothing_divides_beside_other_mesh_axes_so_the_largest_free_dimension_is_padded():
  # Dimensions that other mesh axes split (taken) are passed over...
  assert zerojax.default_shard_dim((4, 13, 7, 3), 8, taken={1: 2}) == -2
  assert zerojax.default_shard_dim((4, 7, 13, 3), 8, taken={2: 2}) == -3
  # ...and one of them is padded only when none is free: the largest again.
  assert zerojax.default_shard_dim((4, 13, 7), 8, taken={1: 2, 2: 2}) == -2
  assert zerojax.default_shard_dim((4, 7, 13), 8, taken={1: 2, 2: 2}) == -1


def test_scanned_gather_of_stacked_leaves_is_each_layer():
  # The end-to-end form of test_sharded_dim_is_scan_stable (zerojax/_src/sharding/layout_test.py):
  # inside value_and_grad a scan slices each device's Shard, and gather must
  # rebuild exactly that layer (and its gradient come back to the right place),
  # padded or not, whichever dimension of the layer is sharded.
  mesh = jax.make_mesh((8,), ("data",), (jax.sharding.AxisType.Auto,))
  rng = np.random.default_rng(0)
  params = {
    "leading_of_layer": jnp.asarray(rng.normal(size=(3, 16, 7)), jnp.float32),  # dim -2
    "padded_last": jnp.asarray(rng.normal(size=(2, 5, 13)), jnp.float32),  # 13 -> 16, dim -1
    "padded_middle": jnp.asarray(rng.normal(size=(2, 11, 3, 5)), jnp.float32),  # 11 -> 16, dim -3
  }
  weights = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
  tx = zerojax.zero3(optax.sgd(0.1), mesh=mesh, min_shard_size=1)
  dims = tx.layout(params).map(lambda leaf: leaf.dim)
  assert dims == {"leading_of_layer": -2, "padded_last": -1, "padded_middle": -3}

  def loss_fn(params, x):
    def layer(_, pair):
      shard, weight = pair
      return None, jnp.sum(zerojax.gather(shard) * weight)

    sums = [jnp.sum(jax.lax.scan(layer, None, (params[k], weights[k]))[1]) for k in params]
    return sum(sums) * jnp.mean(x)

  x = jnp.ones((8,))
  loss, grads = jax.jit(zerojax.value_and_grad(loss_fn, tx))(tx.shard(params), x)
  expected = sum(float(jnp.sum(params[k] * weights[k])) for k in params)
  assert float(loss) == pytest.approx(expected, rel=1e-5)
  chex.assert_trees_all_close(tx.gather(grads), weights, rtol=1e-6)


def test_default_shard_dim_is_public():
  assert zerojax.default_shard_dim((4, 1024, 7), 8) == -2
