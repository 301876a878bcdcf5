"""The transformation is a value: copies, tree maps and ``_replace`` behave as optax's do."""

import copy
import inspect

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AxisType

import zerojax
from tests import models

# Every stage with every option that changes what the transformation holds.
OPTIONS = {
  "plain": {},
  "bf16": {"precision": "bf16"},
  "fp16": {"precision": "fp16"},
  "layout": {
    "layout": {"embed": None, "layers": None, "head": jax.P("data"), "odd": jax.P(), "scale": None},
    "min_shard_size": 1,
  },
  "quantized": {"quantized_gradients": "int8", "quantization_block_size": 64},
  "replicas": {"replica_axis": "replica"},
  "offload": {"offload": "optimizer+master", "precision": "bf16"},
}

COPIES = {
  "copy": copy.copy,
  "deepcopy": copy.deepcopy,
  "tree_map": lambda tx: jax.tree.map(lambda f: f, tx),
  "replace": lambda tx: tx._replace(init=tx.init),
  "unflatten": lambda tx: jax.tree.unflatten(*reversed(jax.tree.flatten(tx))),
}

ATTRIBUTES = (
  "stage",
  "mesh",
  "axis_name",
  "data_axes",
  "replica_axes",
  "inner",
  "precision",
  "quantized_weights",
  "quantized_gradients",
  "num_shards",
  "batch_axes",
  "num_replicas",
  "offload",
)


def _transformation(stage, option):
  options = dict(OPTIONS[option])
  if option == "replicas":
    mesh = jax.make_mesh((2, 4), ("replica", "data"), (AxisType.Auto,) * 2)
  else:
    mesh = jax.make_mesh((8,), ("data",))
  if stage == 3 and option == "quantized":
    options["quantized_weights"] = "int8"
  return getattr(zerojax, f"zero{stage}")(optax.adam(1e-2), mesh=mesh, **options)


@pytest.mark.parametrize("how", COPIES)
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_copies_keep_every_setting(stage, option, how):
  tx = _transformation(stage, option)
  copied = COPIES[how](tx)
  assert type(copied) is zerojax.ZeroTransformation
  for name in ATTRIBUTES:
    assert getattr(copied, name) == getattr(tx, name), name
  params = models.make_params()
  assert jax.tree.map(str, copied.layout(params)) == jax.tree.map(str, tx.layout(params))
  assert copied == tx and hash(copied) == hash(tx)


def _train_one_step(tx):
  params, batch = models.make_params(), models.make_batch()
  state, placed = tx.init(params), tx.shard(params)
  placed, state, _ = models.explicit_step(tx)(placed, state, *batch)
  return tx.gather(tx.master_params(placed, state))


@pytest.fixture(scope="module")
def original():
  # What a copy holds is checked for every stage and option above; one
  # configuration shows that holding it is enough to train the same.
  tx = _transformation(2, "bf16")
  return tx, _train_one_step(tx)


@pytest.mark.parametrize("how", COPIES)
def test_a_copy_trains_like_the_original(original, how):
  tx, expected = original
  chex.assert_trees_all_equal(_train_one_step(COPIES[how](tx)), expected)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_keyword_of_a_factory_reaches_the_settings(stage):
  factory = getattr(zerojax, f"zero{stage}")
  keywords = set(inspect.signature(factory).parameters) - {"inner"}
  stage_3_only = {"quantized_weights", "secondary_axis", "packed_gathers"}
  assert keywords == set(inspect.signature(zerojax.zero3).parameters) - {"inner"} - (
    stage_3_only if stage < 3 else set()
  )
  tx = factory(optax.sgd(0.1), mesh=jax.make_mesh((8,), ("data",)), min_shard_size=7)
  assert tx.stage == stage and tx.layout({"w": jnp.ones(7)}).leaves[0].dim is not None
  assert tx.layout({"w": jnp.ones(6)}).leaves[0].dim is None


def test_transformations_from_two_calls_differ_and_settings_are_immutable():
  mesh = jax.make_mesh((8,), ("data",))
  one, two = (zerojax.zero2(optax.sgd(0.1), mesh=mesh) for _ in range(2))
  assert one != two and one == copy.deepcopy(one)
  with pytest.raises(AttributeError):
    one.stage = 3
  with pytest.raises(AttributeError):
    one.anything = 1


def test_chain_and_nested_use_work():
  tx = zerojax.zero3(optax.adam(1e-2), mesh=jax.make_mesh((8,), ("data",)))
  chained = optax.chain(optax.clip_by_global_norm(1.0), tx)
  assert isinstance(chained, optax.GradientTransformationExtraArgs)
  assert optax.with_extra_args_support(tx) is tx


def test_a_replaced_init_loses_the_settings_with_a_clear_error():
  tx = zerojax.zero1(optax.sgd(0.1), mesh=jax.make_mesh((8,), ("data",)))
  foreign = tx._replace(init=optax.sgd(0.1).init)
  with pytest.raises(ValueError, match="init is not zerojax's any more"):
    _ = foreign.stage
  with pytest.raises(ValueError, match=r"not an optax\.chain"):
    zerojax.value_and_grad(lambda p, x: jnp.sum(x), optax.chain(tx))
