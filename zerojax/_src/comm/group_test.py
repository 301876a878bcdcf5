"""``Group.reduce_scatter``: gradients reduced in buckets that go one after another, exactly."""

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._src.comm.group import BUCKET_BYTES, Group, Transfer

#: Full shapes (sharded along their first axis over 8 devices) and cotangent dtypes: a
#: bfloat16 matrix reduced in float32 (the cast widens), an odd float32 one, a vector.
SHAPES = ((64, 6), (40, 5), (24,))
DTYPES = (jnp.bfloat16, jnp.float32, jnp.bfloat16)


def group(bucket_bytes: int) -> Group:
  transfers = tuple(
    Transfer(0, shape[0], (shape[0] // 8, *shape[1:]), dtype, jnp.float32, jnp.float32)
    for shape, dtype in zip(SHAPES, DTYPES, strict=True)
  )
  return Group(transfers, "data", (), None, None, bucket_bytes=bucket_bytes)


def reduced(mesh, bucket_bytes: int):
  """Each device's cotangents (its own numbers), reduced by the group; and the jaxpr."""
  g = group(bucket_bytes)
  rng = np.random.default_rng(0)
  split = NamedSharding(mesh, P("data"))
  cotangents = [
    jax.device_put(jnp.asarray(rng.normal(size=(8, *shape)), dtype), split)
    for shape, dtype in zip(SHAPES, DTYPES, strict=True)
  ]
  each = lambda *cts: g.reduce_scatter([ct[0] for ct in cts])
  f = jax.jit(jax.shard_map(each, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
  return cotangents, f(*cotangents), jax.make_jaxpr(f)(*cotangents)


def barriers(jaxpr) -> list:
  found = []
  for eqn in jaxpr.eqns:
    found += [eqn] if eqn.primitive.name == "optimization_barrier" else []
    for value in eqn.params.values():
      if isinstance(value, jex.ClosedJaxpr | jex.Jaxpr):
        found += barriers(getattr(value, "jaxpr", value))
  return found


def test_buckets_hold_at_most_their_bytes_largest_first():
  # In float32: 1536, 800 and 96 bytes.
  assert group(BUCKET_BYTES).buckets([384, 200, 24]) == [[0, 1, 2]]
  assert group(1000).buckets([384, 200, 24]) == [[0], [1, 2]]
  assert group(100).buckets([384, 200, 24]) == [[0], [1], [2]]
  assert group(1000).buckets([24, 200, 384]) == [[2], [1, 0]]


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize("bucket_bytes", [BUCKET_BYTES, 1000, 100])
def test_each_bucket_waits_for_the_last_and_the_sums_are_exact(axis_type, bucket_bytes):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
  cotangents, shards, jaxpr = reduced(mesh, bucket_bytes)
  for ct, shard in zip(cotangents, shards, strict=True):
    want = np.asarray(ct, np.float32).sum(axis=0)  # float32 sums of the cotangents' values
    assert shard.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(shard), want, rtol=1e-6, atol=1e-6)
  found = barriers(jaxpr.jaxpr)
  buckets = group(bucket_bytes).buckets([int(np.prod(shape)) for shape in SHAPES])
  if len(buckets) == 1:
    assert not found  # one bucket: the collectives are issued together, as before buckets
    return
  # The first barrier holds every cotangent: no reduction starts before the last is ready.
  # Each later one holds the next bucket's cotangents as they came, before their cast to
  # float32, so XLA can neither cast them ahead of the previous bucket's reduction nor merge
  # the two.
  assert len(found) == len(buckets)
  assert [v.aval.dtype for v in found[0].invars] == list(DTYPES)
  for eqn, bucket in zip(found[1:], buckets[1:], strict=True):
    held = [v.aval.dtype for v in eqn.invars[: len(bucket)]]
    assert held == [DTYPES[i] for i in bucket]
