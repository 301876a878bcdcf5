"""Flax models trained with zerojax match the same models trained with plain optax."""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import zerojax
import zerojax.flax.linen
import zerojax.flax.nnx
from tests.helpers import ROUNDING, STAGES

STEPS = 3
BATCH, SEQ, VOCAB = 16, 8, 13  # 13 is prime: leaves with it are padded once split
MIN_SHARD_SIZE = 64  # small, so that almost every leaf is split


def optimizer():
  # Linear in the gradients, so that the rounding differences between one device and eight
  # stay rounding-sized. (Adam divides each gradient by its magnitude: on a gradient that is
  # mostly rounding noise, its step's sign depends on the order of summation.)
  return optax.sgd(0.03, momentum=0.9)


def tokens(seed):
  return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, (BATCH, SEQ)), jnp.int32)


# ------------------------------------------------------------------------------------ Linen

# Eight layers, wide enough that the weights outweigh the activations: one layer is 1/8.
LINEN_WIDTH, LINEN_LAYERS = 256, 8


class Block(nn.Module):
  """Pre-norm single-head attention and MLP."""

  @nn.compact
  def __call__(self, h, _):
    q, k, v = jnp.split(nn.Dense(3 * LINEN_WIDTH, use_bias=False)(nn.RMSNorm()(h)), 3, axis=-1)
    attention = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k) / np.sqrt(LINEN_WIDTH))
    h = h + nn.Dense(LINEN_WIDTH, use_bias=False)(attention @ v)
    return h + nn.Dense(LINEN_WIDTH)(nn.relu(nn.Dense(2 * LINEN_WIDTH)(nn.RMSNorm()(h)))), None


class Head(nn.Module):
  @nn.compact
  def __call__(self, h):
    return nn.Dense(VOCAB)(nn.RMSNorm()(h))


class Transformer(nn.Module):
  """Gathers the embedding, each scanned layer and the head as it reaches them.

  The layers run under ``nn.scan`` (each gathering itself), or under
  ``zerojax.flax.linen.scan`` (gathered one layer ahead): the parameters are the same.
  """

  prefetching: bool = False

  @nn.compact
  def __call__(self, x):
    h = zerojax.flax.linen.gathered(nn.Embed)(VOCAB, LINEN_WIDTH)(x)
    if self.prefetching:
      layers = zerojax.flax.linen.scan(Block, length=LINEN_LAYERS, defer_reductions=True)
    else:
      layers = nn.scan(
        zerojax.flax.linen.remat_gathered(Block, prevent_cse=False),
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=LINEN_LAYERS,
      )
    h, _ = layers(name="layers")(h, None)
    return zerojax.flax.linen.gathered(Head)()(h)


@functools.cache
def linen_params():
  # On the host: placing host arrays with ``tx.shard`` needs no compiled resharding.
  return jax.device_get(jax.jit(Transformer().init)(jax.random.key(0), tokens(0))["params"])


def linen_loss(state, params, x, y):
  logits = state.apply_fn({"params": params}, x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def linen_train(state, value_and_grad, gather=lambda params: params):
  """The compiled step, and the (loss, full params) trajectory it trains from ``state``."""

  def step(state, x, y):
    loss, grads = value_and_grad(functools.partial(linen_loss, state))(state.params, x, y)
    return state.apply_gradients(grads=grads), loss

  step = jax.jit(step).lower(state, tokens(1), tokens(2)).compile()
  trajectory = []
  for _ in range(STEPS):
    state, loss = step(state, tokens(1), tokens(2))
    trajectory.append((loss, gather(state.params)))
  return step, trajectory


@functools.cache
def linen_reference():
  """Plain optax on one device with the whole batch."""
  state = train_state.TrainState.create(
    apply_fn=Transformer().apply, params=linen_params(), tx=optimizer()
  )
  return linen_train(jax.device_put(state, jax.devices()[0]), jax.value_and_grad)[1]


@functools.cache
def linen_zero(stage, mesh, prefetching=False):
  """Like ``linen_reference``, with ``zerojax`` on 8 devices; also returns the compiled step."""
  tx = STAGES[stage](optimizer(), mesh=mesh, min_shard_size=MIN_SHARD_SIZE)
  with jax.set_mesh(mesh):
    state = train_state.TrainState.create(
      apply_fn=Transformer(prefetching).apply, params=tx.shard(linen_params()), tx=tx
    )
    # An array on the mesh, as the step returns it, rather than the int 0: one compilation.
    state = state.replace(step=jnp.asarray(0))
    return linen_train(state, lambda loss_fn: zerojax.value_and_grad(loss_fn, tx), tx.gather)


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_linen_train_state_matches_plain_optax(stage, mesh):
  chex.assert_trees_all_close(linen_zero(stage, mesh)[1], linen_reference(), **ROUNDING)


def test_linen_zerojax_scan_matches_plain_optax(mesh):
  # Stage 3, where the scan gathers and reduce-scatters; zerojax.flax.linen.scan hands every stage
  # to zerojax.scan alike (stage 2's deferred reductions: tests/test_overlap.py).
  trajectory = linen_zero(3, mesh, prefetching=True)[1]
  chex.assert_trees_all_close(trajectory, linen_reference(), **ROUNDING)


def test_linen_zerojax_scan_gathers_one_layer_ahead(mesh):
  forward, backward = zerojax.diagnostics.loop_collectives(linen_zero(3, mesh, prefetching=True)[0])
  # One all-gather per sharded leaf of a layer; the backward pass gathers those its VJP reads.
  # With defer_reductions=True (passed on to zerojax.scan) each reduction is of the gradient
  # the previous iteration made, so nothing waits on its own iteration.
  assert forward.gathers > 0 and forward.reductions == 0
  assert backward.reductions == forward.gathers and 0 < backward.gathers <= forward.gathers
  assert all(loop.waiting_gathers == loop.waiting_reductions == 0 for loop in (forward, backward))


@pytest.mark.parametrize("prefetching", [False, True], ids=["nn.scan", "zerojax.flax.linen.scan"])
def test_linen_stage3_scan_gathers_one_layer_at_a_time(mesh, prefetching):
  memory = linen_zero(3, mesh, prefetching)[0].memory_analysis()
  model_bytes = sum(x.nbytes for x in jax.tree.leaves(linen_params()))
  # The parameters and the momentum, 1/8 each (and the batch).
  assert memory.argument_size_in_bytes < 0.3 * model_bytes
  # A layer is 1/8 of the model: 1.3 layers measured. Prefetching holds the
  # next layer and, in the backward pass, the previous layer's gradient too:
  # 2.9 layers. Without the checkpoint every layer would stay gathered.
  assert memory.temp_size_in_bytes < (0.45 if prefetching else 0.2) * model_bytes


def test_linen_gathered_module_runs_with_mutable_batch_statistics(mesh):
  class Normalized(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.BatchNorm(use_running_average=False)(nn.Dense(16)(x))

  model = zerojax.flax.linen.gathered(Normalized)()
  x = jnp.arange(8 * 8, dtype=jnp.float32).reshape(8, 8)
  variables = model.init(jax.random.key(0), x)
  tx = zerojax.zero3(optax.sgd(0.1), mesh=mesh, min_shard_size=16)

  def loss_fn(params, x):
    y, updates = model.apply(
      {"params": params, "batch_stats": variables["batch_stats"]}, x, mutable=["batch_stats"]
    )
    return jnp.mean(y**2), updates["batch_stats"]

  value_and_grad = jax.jit(zerojax.value_and_grad(loss_fn, tx, has_aux=True))
  (_, batch_stats), grads = value_and_grad(tx.shard(variables["params"]), x)
  chex.assert_shape(batch_stats["BatchNorm_0"]["mean"], (8, 16))  # one per device
  assert grads["Dense_0"]["kernel"].sharding.spec == P(None, "data")


# -------------------------------------------------------------------------------------- NNX

NNX_WIDTH, NNX_LAYERS = 32, 3


class NnxBlock(nnx.Module):
  def __init__(self, rngs):
    self.norm = nnx.RMSNorm(NNX_WIDTH, rngs=rngs)
    self.linear = nnx.Linear(NNX_WIDTH, NNX_WIDTH, rngs=rngs)

  def __call__(self, h):
    return h + jnp.tanh(self.linear(self.norm(h)))


class NnxModel(nnx.Module):
  """An embedding, stacked layers, a head; each gathered where used.

  The layers run under ``nnx.scan`` (each gathering itself), or under
  ``zerojax.flax.nnx.scan`` (gathered one layer ahead).
  """

  def __init__(self, rngs, prefetching=False):
    self.prefetching = prefetching
    self.embed = nnx.Embed(VOCAB, NNX_WIDTH, rngs=rngs)
    self.layers = nnx.vmap(NnxBlock, in_axes=0, out_axes=0)(rngs.split(NNX_LAYERS))
    self.head = nnx.Linear(NNX_WIDTH, VOCAB, rngs=rngs)

  def __call__(self, x):
    h = zerojax.flax.nnx.gathered(self.embed)(x)
    if self.prefetching:
      h, _ = zerojax.flax.nnx.scan(lambda block, h, _: (block(h), None), self.layers, h)
    else:

      @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
      @nnx.remat(policy=zerojax.remat_policy)
      def layer(block, h):
        return zerojax.flax.nnx.gathered(block)(h)

      h = layer(self.layers, h)
    return zerojax.flax.nnx.gathered(self.head)(h)


def nnx_loss(model, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def nnx_train(tx, value_and_grad, gather=lambda params: params, prefetching=False):
  """The (loss, full params) trajectory of a new model trained with ``nnx.Optimizer``."""
  model = NnxModel(nnx.Rngs(0), prefetching)
  if isinstance(tx, zerojax.ZeroTransformation):
    nnx.update(model, tx.shard(nnx.state(model, nnx.Param)))
  optimizer_ = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer_, x, y):
    loss, grads = value_and_grad(model, x, y)
    optimizer_.update(model, grads)
    return loss

  trajectory = []
  for _ in range(STEPS):
    loss = step(model, optimizer_, tokens(1), tokens(2))
    trajectory.append((loss, nnx.to_pure_dict(gather(nnx.state(model, nnx.Param)))))
  return trajectory


@functools.cache
def nnx_reference():
  """Plain optax on one device with the whole batch."""
  return nnx_train(optimizer(), nnx.value_and_grad(nnx_loss))


@pytest.mark.parametrize(
  "stage, gather, prefetching",
  [(1, True, False), (2, False, False), (3, False, False), (3, True, False), (3, False, True)],
)
def test_nnx_optimizer_matches_plain_optax(stage, gather, prefetching, mesh):
  tx = STAGES[stage](optimizer(), mesh=mesh, min_shard_size=MIN_SHARD_SIZE)
  value_and_grad = zerojax.flax.nnx.value_and_grad(nnx_loss, tx, gather=gather)
  with jax.set_mesh(mesh):  # the optimizer's step counter is created on the mesh
    trajectory = nnx_train(tx, value_and_grad, tx.gather, prefetching)
  chex.assert_trees_all_close(trajectory, nnx_reference(), **ROUNDING)


def test_nnx_optimizer_s_pure_values_are_planned_from_their_logical_shapes(mesh):
  # nnx.Optimizer initialises the transformation with the nnx.Param variables and updates it
  # with their nnx.as_pure values: the stored (padded) shapes in another container. Muon scales
  # each matrix by its shape, so planning the padded head kernel (32, 16) as logical is seen.
  model = NnxModel(nnx.Rngs(0))
  tx = zerojax.zero3(optax.contrib.muon(0.01), mesh=mesh, min_shard_size=MIN_SHARD_SIZE)
  params = tx.shard(nnx.state(model, nnx.Param))
  grads = jax.tree.map(lambda x: jnp.full(x.shape, 0.5, x.dtype), params)
  assert params["head"]["kernel"].shape == (NNX_WIDTH, 16)
  state = tx.init(params)
  pure = lambda tree: nnx.to_pure_dict(nnx.as_pure(tree))
  with jax.set_mesh(mesh):
    variables, _ = tx.update(grads, state, params)
    values, _ = tx.update(nnx.as_pure(grads), nnx.as_pure(state), nnx.as_pure(params))
  chex.assert_trees_all_equal(pure(values), pure(variables))


def test_nnx_scan_passes_defer_reductions_on():
  # zerojax.scan refuses deferred reductions without prefetching: the refusal shows the option
  # reached it.
  layers = nnx.vmap(lambda rngs: nnx.Linear(4, 4, rngs=rngs))(nnx.Rngs(0).split(2))
  step = lambda layer, h, _: (layer(h), None)
  with pytest.raises(ValueError, match="defer_reductions=True reduce-scatters"):
    zerojax.flax.nnx.scan(step, layers, jnp.ones((2, 4)), prefetch=0, defer_reductions=True)


# ------------------------------------------------------------------------------- Randomness

# Dropout with one key per example, passed as a batch argument: the same loss and gradients on
# 8 devices as on one, for zerojax.flax.linen.scan and zerojax.flax.nnx.scan (docs/flax.md).
DROPOUT_BATCH, DROPOUT_WIDTH, DROPOUT_LAYERS = 16, 16, 3


class DropoutBlock(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    return jnp.tanh(nn.Dense(DROPOUT_WIDTH)(nn.Dropout(0.5, deterministic=False)(h))), None


class NnxDropoutNet(nnx.Module):
  def __init__(self, rngs):
    self.layers = nnx.vmap(lambda r: nnx.Linear(DROPOUT_WIDTH, DROPOUT_WIDTH, rngs=r))(
      rngs.split(DROPOUT_LAYERS)
    )
    self.dropout = nnx.Dropout(0.5)  # no Rngs held: each call is given its key

  def __call__(self, x, key):
    step = lambda layer, h, key: (jnp.tanh(layer(self.dropout(h, rngs=key))), None)
    keys = jax.random.split(key, DROPOUT_LAYERS)
    return zerojax.flax.nnx.scan(step, self.layers, x, keys)[0]


def _dropout_batch():
  x = jax.random.normal(jax.random.key(1), (DROPOUT_BATCH, DROPOUT_WIDTH))
  return x, jax.random.split(jax.random.key(2), DROPOUT_BATCH)


@pytest.mark.parametrize("types", [jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto])
def test_linen_scan_dropout_with_per_example_keys_matches_one_device(types):
  layers = zerojax.flax.linen.scan(DropoutBlock, length=DROPOUT_LAYERS)()
  x, keys = _dropout_batch()
  params = layers.init(jax.random.key(0), x, None)["params"]

  def loss_fn(params, x, keys):
    one = lambda x, key: layers.apply({"params": params}, x[None], None, rngs={"dropout": key})
    return jnp.mean(jax.vmap(one)(x, keys)[0] ** 2)

  tx = zerojax.zero3(optax.sgd(0.1), mesh=jax.make_mesh((8,), ("data",), (types,)))
  loss, grads = jax.jit(zerojax.value_and_grad(loss_fn, tx))(tx.shard(params), x, keys)
  chex.assert_trees_all_close(
    (loss, tx.gather(grads)), jax.value_and_grad(loss_fn)(params, x, keys), **ROUNDING
  )


@pytest.mark.parametrize("types", [jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto])
def test_nnx_scan_dropout_with_per_example_keys_matches_one_device(types):
  model = NnxDropoutNet(nnx.Rngs(0))
  x, keys = _dropout_batch()

  def loss_fn(model, x, keys):
    return jnp.mean(jax.vmap(lambda x, key: model(x[None], key))(x, keys) ** 2)

  expected = nnx.value_and_grad(loss_fn)(model, x, keys)
  tx = zerojax.zero3(optax.sgd(0.1), mesh=jax.make_mesh((8,), ("data",), (types,)))
  nnx.update(model, tx.shard(nnx.state(model, nnx.Param)))
  value_and_grad = zerojax.flax.nnx.value_and_grad(loss_fn, tx, gather=False)
  loss, grads = nnx.jit(value_and_grad)(model, x, keys)
  chex.assert_trees_all_close(
    (loss, nnx.to_pure_dict(tx.gather(grads))),
    (expected[0], nnx.to_pure_dict(expected[1])),
    **ROUNDING,
  )
