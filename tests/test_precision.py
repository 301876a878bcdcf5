"""Mixed precision, loss scaling, skipped non-finite steps and the pre-clip gradient norm."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from tests import models
from tests.helpers import FP16, ROUNDING, STAGES, as_bits


def explicit_step(tx):
  @jax.jit
  def step(params, state, *batch):
    loss, grads = zerojax.value_and_grad(models.loss_fn, tx)(params, *batch, opt_state=state)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  return step


def start(stage, mesh, inner, precision):
  tx = STAGES[stage](inner, mesh=mesh, precision=precision)
  full = models.make_params()
  state = tx.init(full)
  return tx, tx.shard(full), state


def mixed_reference(inner, compute_dtype, params, batch, steps):
  """Plain optax on one device, mixed precision by hand: fp32 master, low-precision loss."""
  state = inner.init(params)

  @jax.jit
  def step(master, state):
    low = jax.tree.map(lambda p: p.astype(compute_dtype), master)
    grads = jax.grad(lambda low: models.loss_fn(low, *batch).astype(jnp.float32))(low)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    updates, state = inner.update(grads, state, master)
    return optax.apply_updates(master, updates), state

  for _ in range(steps):
    params, state = step(params, state)
  return params


@functools.cache
def bf16_reference():
  return mixed_reference(optax.sgd(0.1), jnp.bfloat16, models.make_params(), models.make_batch(), 3)


def assert_trained_like(actual, expected, initial=None):
  """Every leaf within 5% of how far ``expected`` moved it from ``initial``.

  Low-precision runs sum in a different order on 8 devices than on one, so
  they match only to a tolerance; scaled to each leaf's own movement, that
  tolerance still fails a leaf left untrained (100% of its movement off).
  Measured: at most 0.6% (the "odd" leaf, which moves 1.6e-4 in 3 steps).
  """
  initial = models.make_params() if initial is None else initial
  flat = jax.tree_util.tree_flatten_with_path(actual)[0]
  references = zip(jax.tree.leaves(expected), jax.tree.leaves(initial), strict=True)
  for (path, a), (e, i) in zip(flat, references, strict=True):
    e, i = np.asarray(e, np.float64), np.asarray(i, np.float64)
    moved = np.max(np.abs(e - i))
    assert moved > 0, f"{jax.tree_util.keystr(path)} did not train in the reference"
    np.testing.assert_allclose(a, e, rtol=0, atol=0.05 * moved, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_policy_trains_like_mixed_precision_by_hand(stage, mesh):
  tx, params, state = start(stage, mesh, optax.sgd(0.1), "bf16")
  step = explicit_step(tx)
  for _ in range(3):
    params, state, _ = step(params, state, *models.make_batch())
  stored = jax.tree.leaves(params)
  assert {x.dtype for x in stored} == {np.dtype(jnp.bfloat16 if stage < 3 else jnp.float32)}
  master = tx.gather(tx.master_params(params, state))
  assert_trained_like(master, bf16_reference())
  if stage < 3:
    # The working copy is exactly the master rounded, never drifting from it.
    rounded = jax.tree.map(lambda m: m.astype(jnp.bfloat16), master)
    chex.assert_trees_all_equal(tx.gather(params), rounded)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_static_loss_scale_changes_no_number(stage, mesh):
  # Scaling by a power of two is exact in fp32, so the result must match plain optax.
  policy = zerojax.Precision(loss_scale=2.0**12)
  tx, params, state = start(stage, mesh, optax.adam(1e-2), policy)
  step = explicit_step(tx)
  batch = models.make_batch()
  for _ in range(3):
    params, state, _ = step(params, state, *batch)
  expected = models.reference(optax.adam(1e-2), models.make_params(), batch, 3)
  chex.assert_trees_all_close(tx.gather(params), expected, **ROUNDING)
  assert int(state.skipped_steps) == 0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_overflow_on_one_device_skips_the_step_everywhere(stage, mesh):
  tx, params, state = start(stage, mesh, optax.adam(1e-2), FP16)
  step = explicit_step(tx)
  clean = models.make_batch()
  params, state, _ = step(params, state, *clean)  # one real step first
  before = (params, state.inner_state, state.master)

  params, state, loss = step(params, state, *models.poisoned_batch())
  assert not np.isfinite(loss)
  chex.assert_trees_all_equal(as_bits((params, state.inner_state, state.master)), as_bits(before))
  assert int(state.skipped_steps) == 1
  # Hysteresis 2: the first overflow keeps the scale, the second halves it.
  assert float(state.loss_scale.scale) == 2.0**10
  params, state, _ = step(params, state, *models.poisoned_batch(device=6))
  chex.assert_trees_all_equal(as_bits((params, state.inner_state, state.master)), as_bits(before))
  assert (int(state.skipped_steps), float(state.loss_scale.scale)) == (2, 2.0**9)

  params, state, _ = step(params, state, *clean)
  assert int(state.skipped_steps) == 2
  assert not np.array_equal(as_bits(params)[0], as_bits(before[0])[0])


def test_skip_keeps_negative_zero(mesh):
  policy = zerojax.Precision(skip_nonfinite=True)
  tx = zerojax.zero3(optax.sgd(0.1), mesh=mesh, precision=policy)
  full = models.make_params()
  full["head"] = full["head"].at[0, 0].set(-0.0)
  params = tx.shard(full)
  state = tx.init(params)
  new_params, state, _ = explicit_step(tx)(params, state, *models.poisoned_batch())
  chex.assert_trees_all_equal(as_bits(new_params), as_bits(params))
  assert np.signbit(np.asarray(tx.gather(new_params)["head"])[0, 0])
  assert int(state.skipped_steps) == 1
  assert state.loss_scale is None


def test_without_skipping_a_non_finite_step_is_applied(mesh):
  tx, params, state = start(3, mesh, optax.sgd(0.1), None)
  params, state, _ = explicit_step(tx)(params, state, *models.poisoned_batch())
  assert not np.isfinite(np.asarray(tx.gather(params)["embed"])).all()
  assert int(state.skipped_steps) == 0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_pre_clip_grad_norm_is_the_true_global_norm(stage, mesh):
  inner = optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(0.1))
  tx, params, state = start(stage, mesh, inner, None)
  batch = models.make_batch()
  params, state, _ = explicit_step(tx)(params, state, *batch)
  grads = jax.grad(models.loss_fn)(models.make_params(), *batch)
  assert float(state.pre_clip_grad_norm) == pytest.approx(float(optax.tree.norm(grads)), rel=1e-5)
  assert float(state.pre_clip_grad_norm) > 0.1  # so the clip was active, and the norm is pre-clip
  expected = models.reference(inner, models.make_params(), batch, 1)
  chex.assert_trees_all_close(tx.gather(params), expected, **ROUNDING)


def test_policies_by_name():
  assert zerojax.Precision.named("fp32") == zerojax.Precision("fp32", "fp32", "fp32")
  fp16 = zerojax.Precision.named("fp16")
  assert fp16.compute == np.dtype(np.float16) and fp16.skip_nonfinite
  assert fp16.loss_scale == zerojax.DynamicLossScale()
  assert zerojax.Precision().compute_dtype(jnp.bfloat16) == np.dtype(jnp.bfloat16)
  assert fp16.compute_dtype(jnp.int32) == np.dtype(np.int32)


@pytest.mark.parametrize(
  "make, match",
  [
    (lambda: zerojax.Precision.named("fp8"), "unknown precision 'fp8'"),
    (lambda: zerojax.Precision(compute="int8"), "must be a float dtype"),
    (lambda: zerojax.Precision(loss_scale=-1.0), "must be positive"),
    (lambda: zerojax.DynamicLossScale(initial=0.5), "minimum <= initial"),
    (lambda: zerojax.DynamicLossScale(hysteresis=0), "at least 1"),
    (lambda: zerojax.zero1(optax.sgd(0.1), precision=3), "must be a zerojax.Precision"),
  ],
)
def test_bad_policies_are_refused(make, match, mesh):
  with jax.set_mesh(mesh), pytest.raises(ValueError, match=match):
    make()


def test_init_refuses_the_rounded_copy(mesh):
  tx = zerojax.zero2(optax.adam(1e-3), mesh=mesh, precision="bf16")
  params = tx.shard(models.make_params())
  with pytest.raises(ValueError, match=r"call tx.init\(params\) on the full-precision"):
    tx.init(params)


def test_loss_scaling_needs_the_state(mesh):
  tx, params, _ = start(3, mesh, optax.sgd(0.1), FP16)
  with pytest.raises(ValueError, match="opt_state=opt_state"):
    zerojax.value_and_grad(models.loss_fn, tx)(params, *models.make_batch())


def test_master_copy_update_needs_params(mesh):
  tx, params, state = start(1, mesh, optax.sgd(0.1), "bf16")
  _, grads = jax.jit(zerojax.value_and_grad(models.loss_fn, tx))(params, *models.make_batch())
  with pytest.raises(ValueError, match=r"tx.update\(grads, state, params\)"):
    tx.update(grads, state)


def test_state_of_another_policy_is_refused(mesh):
  tx, params, _ = start(1, mesh, optax.sgd(0.1), "bf16")
  plain = zerojax.zero1(optax.sgd(0.1), mesh=mesh)
  state = plain.init(models.make_params())
  grads = jax.tree.map(jnp.zeros_like, models.make_params())
  with pytest.raises(ValueError, match=r"another precision policy.*lacks master parameters"):
    tx.update(grads, state, params)


def test_state_of_another_loss_scale_policy_is_refused(mesh):
  # Stage 3 keeps no master copy either way: only the loss scale tells the states apart.
  fp16, params, fp16_state = start(3, mesh, optax.sgd(0.1), FP16)
  bf16 = zerojax.zero3(optax.sgd(0.1), mesh=mesh, precision="bf16")
  bf16_state = bf16.init(models.make_params())
  grads = jax.tree.map(jnp.zeros_like, models.make_params())
  with pytest.raises(ValueError, match=r"another precision policy.*lacks a loss scale"):
    fp16.update(grads, bf16_state, params)
  with pytest.raises(ValueError, match=r"another precision policy.*lacks a loss scale"):
    zerojax.value_and_grad(models.loss_fn, fp16)(params, *models.make_batch(), opt_state=bf16_state)
  with pytest.raises(ValueError, match=r"another precision policy.*has a loss scale"):
    bf16.update(grads, fp16_state, params)


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_drop_in_path_keeps_the_master_copy(stage, mesh):
  # Stages 1-2 store bf16 parameters, so a plain jax.grad step computes in bf16
  # while the fp32 master copy lives, sharded, in the optimizer state.
  tx, params, state = start(stage, mesh, optax.sgd(0.1), "bf16")
  step = jax.jit(models.drop_in_step(tx))
  for _ in range(3):
    params, state, _ = step(params, state, *models.make_batch())
  assert_trained_like(tx.gather(tx.master_params(params, state)), bf16_reference())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_drop_in_path_scales_the_loss_as_documented(stage, mesh):
  # Plain jax.value_and_grad knows nothing of the loss scale: the step scales
  # the loss and unscales the gradients itself (docs/precision.md), and then
  # trains like zerojax.value_and_grad, loss-scale state included.
  tx, params, state = start(stage, mesh, optax.sgd(0.1), FP16)

  @jax.jit
  def drop_in(params, state, *batch):
    scale = state.loss_scale.scale
    scaled_loss = lambda p: models.loss_fn(tx.unpad(p), *batch).astype(jnp.float32) * scale
    loss, grads = jax.value_and_grad(scaled_loss)(params)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32) / scale, grads)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss / scale

  @jax.jit
  def explicit(params, state, *batch):
    loss, grads = zerojax.value_and_grad(models.loss_fn, tx)(params, *batch, opt_state=state)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  ours, theirs = (params, state), (params, state)
  for _ in range(3):
    *ours, _ = explicit(*ours, *models.make_batch())
    *theirs, _ = drop_in(*theirs, *models.make_batch())
  assert int(ours[1].skipped_steps) == int(theirs[1].skipped_steps) == 0
  chex.assert_trees_all_equal(theirs[1].loss_scale, ours[1].loss_scale)
  assert_trained_like(tx.gather(tx.master_params(*theirs)), tx.gather(tx.master_params(*ours)))
