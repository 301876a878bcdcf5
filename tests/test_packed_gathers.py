"""Packed gathers: stage 3 gathers a layer's shards in one all-gather per dtype.

With ``packed_gathers=True`` each layer that ``zerojax.gather`` (or
``zerojax.scan``) opens moves its float32 shards in one all-gather and its
bfloat16 one in another, instead of one per leaf; ``packed_gathers=False``
keeps one per leaf. By default they are packed on GPUs across nodes
(tests/test_nodes.py compiles that for 2 nodes of 8 H100), and here, on CPU,
not. The numbers are plain single-device optax's, the leaves padded, split
along other dimensions than the first and of two dtypes, and the same bit for
bit packed or not.
"""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax
from tests.helpers import LOW_PRECISION_ROUNDING

AXES = ("node", "data")
STEPS = 2
TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}


def make_params():
  """A stack of 2 layers: two float32 matrices (one split along its last dimension, padded)
  and a bfloat16 bias (padded)."""
  up, down, bias = jax.random.split(jax.random.key(0), 3)
  return {
    "up": jax.random.normal(up, (2, 12, 20)) / 4,  # 20 columns, padded to 24
    "down": jax.random.normal(down, (2, 20, 12)) / 4,
    "bias": (jax.random.normal(bias, (2, 20)) / 4).astype(jnp.bfloat16),
  }


def loss_fn(params, x, y, scan):
  def layer(h, w):
    return h + jnp.tanh(h @ w["up"] + w["bias"].astype(jnp.float32)) @ w["down"], None

  if scan:
    h = zerojax.scan(layer, x, params)[0]
  else:
    h = jax.lax.scan(lambda h, w: layer(h, zerojax.gather(w)), x, params)[0]
  return jnp.mean((h[:, :8] - y) ** 2)


def make_batch():
  x = jax.random.normal(jax.random.key(1), (16, 12))
  return x, jnp.sin(x[:, :8])


@functools.cache
def plain(scan):
  """STEPS steps of plain optax on one device."""
  params, batch = make_params(), make_batch()
  opt = optax.sgd(0.1)  # linear in the gradients: Adam would magnify their last bits
  state = opt.init(params)
  for _ in range(STEPS):
    grads = jax.grad(lambda p: loss_fn(zerojax.gather(p), *batch, scan=False))(params)
    updates, state = opt.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params


def trained(mesh, scan, **options):
  """``(params after STEPS steps, the compiled step's text)`` under zero3 over ``AXES``."""
  tx = zerojax.zero3(
    optax.sgd(0.1), mesh=mesh, axis_name=AXES, min_shard_size=16, layout=LAYOUT, **options
  )
  params = tx.shard(make_params())
  state = tx.init(params)
  batch = jax.device_put(make_batch(), NamedSharding(mesh, P(AXES)))

  def step(params, state, x, y):
    _, grads = zerojax.value_and_grad(functools.partial(loss_fn, scan=scan), tx)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(step)
  text = step.lower(params, state, *batch).compile().as_text()
  for _ in range(STEPS):
    params, state = step(params, state, *batch)
  return tx.gather(params), text


#: "up" split along its last dimension (columns), the others along their default one.
LAYOUT = {"up": P(None, None, AXES), "down": None, "bias": None}


#: Elements of one layer's matrix, gathered (padded to 24 along its split dimension), and of
#: both matrices of a layer gathered in one buffer.
MATRIX, BOTH = 12 * 24, 2 * 12 * 24


def gathered(text, dtype=r"\w+") -> list[int]:
  """The elements each all-gather of the compiled step (on CPU) of ``dtype`` returns."""
  shapes = re.findall(rf"= {dtype}\[([\d,]+)\]\S* all-gather\(", text)
  return [math.prod(int(n) for n in shape.split(",")) for shape in shapes]


@pytest.mark.parametrize("scan", [False, True], ids=["gather", "scan"])
@pytest.mark.parametrize("types", TYPES.values(), ids=TYPES)
def test_a_layer_moves_in_one_all_gather_per_dtype_across_nodes(types, scan):
  mesh = jax.make_mesh((2, 4), AXES, axis_types=(types,) * 2)
  packed, packed_text = trained(mesh, scan, packed_gathers=True)
  unpacked, unpacked_text = trained(mesh, scan, packed_gathers=False)
  # A layer's two float32 matrices move in one all-gather, never alone (its bfloat16 bias
  # in another); without packing, each matrix in its own.
  assert BOTH in gathered(packed_text) and MATRIX not in gathered(packed_text)
  assert MATRIX in gathered(unpacked_text) and BOTH not in gathered(unpacked_text)
  reference = plain(scan)
  for got in (packed, unpacked):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(reference), strict=True):
      assert a.dtype == b.dtype
      # The bias is stored and its gradient reduced in bfloat16: the rounding of a
      # low-precision step, to a last bit of the bias.
      tolerance = dict(rtol=2**-7, atol=0) if a.dtype == jnp.bfloat16 else LOW_PRECISION_ROUNDING
      np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tolerance)
  # The all-gathers move the same values: packing changes nothing else.
  for a, b in zip(jax.tree.leaves(packed), jax.tree.leaves(unpacked), strict=True):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("types", TYPES.values(), ids=TYPES)
@pytest.mark.parametrize("nodes", [1, 2])
def test_off_gpus_each_weight_keeps_its_all_gather_by_default(types, nodes):
  # Packing is a GPU default, across nodes; on CPU, one node or two, each weight keeps its own
  # all-gather unless packed_gathers=True.
  mesh = jax.make_mesh((nodes, 8 // nodes), AXES, axis_types=(types,) * 2)
  default, default_text = trained(mesh, False)
  packed, packed_text = trained(mesh, False, packed_gathers=True)
  assert MATRIX in gathered(default_text) and BOTH not in gathered(default_text)
  assert BOTH in gathered(packed_text) and MATRIX not in gathered(packed_text)
  for a, b in zip(jax.tree.leaves(default), jax.tree.leaves(packed), strict=True):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("types", TYPES.values(), ids=TYPES)
def test_quantized_weights_move_their_codes_and_scales_in_one_buffer(types):
  # qwZ: each weight's codes and scales (two collectives a weight) move packed as bytes;
  # float32 scales then never travel on their own. What arrives is the same.
  mesh = jax.make_mesh((2, 4), AXES, axis_types=(types,) * 2)
  packed, packed_text = trained(mesh, True, quantized_weights="int8", packed_gathers=True)
  unpacked, unpacked_text = trained(mesh, True, quantized_weights="int8", packed_gathers=False)
  assert gathered(unpacked_text, "f32") and not gathered(packed_text, "f32")
  assert gathered(packed_text, "s8")
  for a, b in zip(jax.tree.leaves(packed), jax.tree.leaves(unpacked), strict=True):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
