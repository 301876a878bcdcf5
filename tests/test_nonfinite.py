"""Skipped non-finite steps, with the inf or NaN in one element of one gradient leaf.

An inf in the input batch makes every gradient leaf non-finite, so a check that
looked at one leaf only would still skip that step. Real fp16 overflows hit one
layer. Here a batch-controlled factor multiplies one element of one parameter
into the loss, so only that element's gradient, on the one device whose rows
hold the factor, goes non-finite (and only its shard, once reduce-scattered).

Every position the check could miss is tried: the first leaf, the last (a
replicated scalar), a middle layer of a stacked leaf, the last real column of a
padded leaf (on the shard that also holds the padding) and a replicated leaf;
in every stage on the explicit path (``zerojax.value_and_grad``) and in stages 1
and 3 on the drop-in path (``jax.value_and_grad`` + ``tx.update``; stage 2
compiles to stage 1's program there), with inf and NaN in fp32
and bf16 and a true fp16 overflow (a finite factor whose scaled gradient
exceeds fp16's range), with quantized gradients, and in one micro-batch of
four. Each step is compiled once per (stage, path, precision); only the data
changes between cases.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax
from tests.helpers import as_bits

BATCH = 32  # 8 devices x 4 rows: 4 micro-batches of one row each when accumulating
MIN_SHARD_SIZE = 64  # "norm" (32 elements) and the scalar stay replicated

#: Where the non-finite gradient element goes: (leaf path, index into the leaf).
#: Flattened, the tree is embed, head, layers/b, layers/w, norm, scale.
POSITIONS = {
  "first leaf": (("embed",), (0, 5)),
  "stacked layer 1 of 3": (("layers", "w"), (1, 7, 3)),
  "padded leaf, last real column": (("head",), (4, 12)),
  "replicated leaf": (("norm",), (3,)),
  "last leaf": (("scale",), ()),
}
TARGETS = tuple(POSITIONS.values())

PRECISIONS = {
  "fp32": zerojax.Precision(skip_nonfinite=True),
  "bf16": zerojax.Precision(params="fp32", compute="bf16", reduce="fp32", skip_nonfinite=True),
  "fp16": zerojax.Precision(
    params="fp32",
    compute="fp16",
    reduce="fp32",
    # Small enough that the clean steps of this model do not overflow in fp16.
    loss_scale=zerojax.DynamicLossScale(initial=2.0**10, growth_interval=1000),
  ),
}
#: The values a bad factor takes. 3e4 times any target element (at most 1.3)
#: is finite in fp16, whose largest value is 65504, so the loss stays finite;
#: the element's gradient times the loss scale, 3e4 * 2**10, is not.
VALUES = {"fp32": ("inf", "nan"), "bf16": ("inf", "nan"), "fp16": ("overflow",)}
BAD = {"inf": np.inf, "nan": np.nan, "overflow": 3e4}


def make_params():
  rng = np.random.default_rng(0)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[-2]), jnp.float32)
  return {
    "embed": normal(12, 32),  # sharded on its last dimension
    "head": normal(32, 13),  # 13 is prime: padded to 16 (to 16 on 4 shards too)
    "layers": {
      "b": jnp.asarray(rng.normal(size=(3, 32)) * 0.1, jnp.float32),
      "w": normal(3, 32, 32),  # stacked layers, scanned
    },
    "norm": jnp.asarray(1 + 0.1 * rng.normal(size=32), jnp.float32),  # replicated: too small
    "scale": jnp.asarray(1.3, jnp.float32),  # replicated: a scalar
  }


def make_batch(position=None, value=None, row=13):
  """x, y and the factors (one column per target), all zero unless one is bad.

  ``row`` 13 is device 3's second row: the second micro-batch when accumulating.
  """
  rng = np.random.default_rng(1)
  x = rng.normal(size=(BATCH, 12)).astype(np.float32)
  y = rng.normal(size=(BATCH, 13)).astype(np.float32)
  factors = np.zeros((BATCH, len(TARGETS)), np.float32)
  if position is not None:
    factors[row, list(POSITIONS).index(position)] = BAD[value]
  return jnp.asarray(x), jnp.asarray(y), jnp.asarray(factors)


def element(params, target):
  path, index = target
  leaf = params
  for key in path:
    leaf = leaf[key]
  return leaf[index]


def make_loss(compute_dtype):
  """The test model's loss, plus each factor times its target element (0 x finite = 0).

  The model casts its parameters to ``compute_dtype`` itself, as a drop-in
  stage-3 model must; on the explicit path they already are.
  """

  def loss_fn(params, x, y, factors):
    params = jax.tree.map(lambda p: p.astype(compute_dtype), zerojax.gather(params))
    h = x.astype(compute_dtype) @ params["embed"]

    def layer(h, weights):
      return jnp.tanh(h @ weights["w"] + weights["b"]), None

    h, _ = jax.lax.scan(layer, h, params["layers"])
    out = (h * params["norm"]) @ params["head"] * params["scale"]
    loss = jnp.mean((out.astype(jnp.float32) - y) ** 2)
    # In the compute dtype, so the gradient of a bad factor's element is too.
    total = jnp.sum(factors, axis=0).astype(compute_dtype)
    poison = sum(total[k] * element(params, t) for k, t in enumerate(TARGETS))
    return loss + poison.astype(jnp.float32)

  return loss_fn


def mesh_for(stage, path):
  """Explicit axes for some (stage, path) pairs and Auto for the others: both get tested."""
  explicit = stage == 1 or (stage == 3 and path == "explicit")
  return jax.make_mesh((8,), ("data",), (AxisType.Explicit if explicit else AxisType.Auto,))


def hybrid_mesh():
  return jax.make_mesh((2, 4), ("replica", "data"), (AxisType.Auto, AxisType.Auto))


class Run:
  """One compiled step and a state after one clean step, shared by the cases of a setup."""

  def __init__(self, stage, path, precision, mesh, microbatches=1, **options):
    policy = PRECISIONS[precision]
    self.tx = getattr(zerojax, f"zero{stage}")(
      optax.adam(1e-2),
      mesh=mesh,
      min_shard_size=MIN_SHARD_SIZE,
      precision=policy,
      replica_axis="replica" if "replica" in mesh.axis_names else None,
      **options,
    )
    self.batch_sharding = NamedSharding(mesh, P(self.tx.batch_axes))
    loss_fn = make_loss(policy.compute or jnp.float32)
    step = self._explicit(loss_fn, microbatches) if path == "explicit" else self._drop_in(loss_fn)
    state = self.tx.init(make_params())
    params = self.tx.shard(make_params())
    batch = jax.device_put(make_batch(), self.batch_sharding)
    self.step = jax.jit(step).lower(params, state, *batch).compile()
    params, state, loss = self(params, state, make_batch())
    self.clean_loss = float(loss)
    self.start = (params, state)

  def __call__(self, params, state, batch):
    return self.step(params, state, *jax.device_put(batch, self.batch_sharding))

  def _explicit(self, loss_fn, microbatches):
    tx = self.tx

    def step(params, state, *batch):
      grad_fn = zerojax.value_and_grad(loss_fn, tx, microbatches=microbatches)
      loss, grads = grad_fn(params, *batch, opt_state=state)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state, loss

    return step

  def _drop_in(self, loss_fn):
    tx = self.tx

    def step(params, state, *batch):
      # As docs/precision.md shows: with a loss scale, the step scales and unscales.
      scale = 1.0 if state.loss_scale is None else state.loss_scale.scale
      scaled = lambda p: loss_fn(tx.unpad(p), *batch) * scale
      loss, grads = jax.value_and_grad(scaled)(params)
      grads = jax.tree.map(lambda g: g.astype(jnp.float32) / scale, grads)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state, loss / scale

    return step


@functools.cache
def run(stage, path, precision):
  return Run(stage, path, precision, mesh_for(stage, path))


@functools.cache
def quantized_run(stage):
  options = dict(
    quantized_gradients="int8", **({"quantized_weights": "int8"} if stage == 3 else {})
  )
  return Run(stage, "explicit", "fp32", hybrid_mesh(), **options)


@functools.cache
def accumulating_run(stage):
  return Run(stage, "explicit", "fp16", mesh_for(stage, "explicit"), microbatches=4)


def kept(params, state):
  """What a skipped step must leave bit-identical."""
  return params, state.inner_state, state.master


def assert_skipped(run, position, value, row=13):
  params, state = run.start
  new_params, new_state, loss = run(params, state, make_batch(position, value, row))
  if value == "overflow":
    assert np.isfinite(float(loss)), "only the scaled gradient overflows, not the loss"
  assert int(new_state.skipped_steps) == 1, f"a non-finite gradient in the {position} was applied"
  chex.assert_trees_all_equal(as_bits(kept(new_params, new_state)), as_bits(kept(params, state)))
  if state.loss_scale is not None:
    # An overflow spends one step of hysteresis (2 -> 1) and keeps the scale.
    assert int(new_state.loss_scale.hysteresis) == int(state.loss_scale.hysteresis) - 1
    assert float(new_state.loss_scale.scale) == float(state.loss_scale.scale)


def assert_applied(run):
  """A clean step is applied, every leaf moving: padding never makes it look non-finite."""
  params, state = run.start
  assert int(state.skipped_steps) == 0 and np.isfinite(run.clean_loss)
  new_params, new_state, _ = run(params, state, make_batch())
  assert int(new_state.skipped_steps) == 0
  if state.loss_scale is not None:
    assert int(new_state.loss_scale.good_steps) == int(state.loss_scale.good_steps) + 1
  # Stored and master leaves, sharded and padded: every one must have moved.
  new, old = (run.tx.master_params(*s) for s in ((new_params, new_state), run.start))
  flat = jax.tree_util.tree_flatten_with_path(new)[0]
  for (path, a), b in zip(flat, jax.tree.leaves(old), strict=True):
    a, b = np.asarray(a), np.asarray(b)
    assert np.isfinite(a).all() and not np.array_equal(a, b), jax.tree_util.keystr(path)


# Not stage 2 on the drop-in path: given full gradients, stage 2 stores what stage 1 stores,
# and its step compiles to stage 1's program.
CASES = [
  (stage, path, precision)
  for stage in (1, 2, 3)
  for path in ("explicit", "drop-in")
  for precision in PRECISIONS
  if (stage, path) != (2, "drop-in")
]
BAD_CASES = [
  (*case, position, value) for case in CASES for position in POSITIONS for value in VALUES[case[2]]
]


@pytest.mark.parametrize("stage, path, precision, position, value", BAD_CASES)
def test_a_non_finite_element_of_one_leaf_skips_the_step(stage, path, precision, position, value):
  assert_skipped(run(stage, path, precision), position, value)


@pytest.mark.parametrize("stage, path, precision", CASES)
def test_a_finite_step_is_applied(stage, path, precision):
  assert_applied(run(stage, path, precision))


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("position", POSITIONS)
def test_quantized_gradients_keep_one_bad_element_visible(stage, position):
  # A block holding an inf dequantizes to NaN, through the data group's
  # all-to-all and the replicas' quantized all-reduce.
  assert_skipped(quantized_run(stage), position, "inf")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_quantized_gradients_finite_step_is_applied(stage):
  assert_applied(quantized_run(stage))


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("position", POSITIONS)
def test_one_overflowing_micro_batch_of_four_skips_the_step(stage, position):
  # Row 13 is device 3's second micro-batch; rows 12, 14 and 15 are clean.
  assert_skipped(accumulating_run(stage), position, "overflow", row=13)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_accumulated_finite_step_is_applied(stage):
  assert_applied(accumulating_run(stage))


@pytest.mark.parametrize("garbage", ["nan", "inf"])
def test_the_padding_of_injected_gradients_decides_nothing(garbage):
  # A drop-in step may hand tx.update gradients in the stored, padded shape.
  # What sits in the padding is no parameter's gradient: the step is applied
  # (not skipped), and the stored padding stays zero.
  run_ = run(3, "drop-in", "fp32")
  params, state = run_.start
  chex.assert_shape(params["head"], (32, 16))
  grads = jax.tree.map(jnp.ones_like, params)
  head = grads["head"]  # a zerojax.Stored: its array holds the padding
  grads["head"] = zerojax.Stored(head.value.at[:, 13:].set(BAD[garbage]), head.layout)
  updates, new_state = jax.jit(run_.tx.update)(grads, state, params)
  assert int(new_state.skipped_steps) == 0
  head = np.asarray(optax.apply_updates(params, updates)["head"].value)
  assert np.all(head[:, 13:] == 0) and np.isfinite(head).all()
  assert not np.array_equal(head[:, :13], np.asarray(params["head"].value)[:, :13])
