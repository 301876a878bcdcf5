"""The public surface; meshes, placement, recompilation and donation (errors: test_bad_input.py)."""

import functools
import inspect
import subprocess
import sys
import tomllib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import zerojax
import zerojax.flax.linen
import zerojax.flax.nnx
import zerojax.launch
import zerojax_launch
from tests import models
from tests.environment import ROOT, subprocess_env
from tests.helpers import ROUNDING


def test_an_unknown_top_level_name_is_an_attribute_error():
  with pytest.raises(AttributeError, match="module 'zerojax' has no attribute 'zero4'"):
    zerojax.zero4  # noqa: B018


def test_the_launcher_starts_without_jax_and_every_public_name_is_found():
  # `python -m zerojax_launch`, which only starts and watches processes, imports neither JAX
  # nor anything built on it (zerojax itself imports JAX).
  code = (
    "import runpy, sys; sys.argv = ['zerojax_launch', '--help']\n"
    "try: runpy.run_module('zerojax_launch', run_name='__main__')\n"
    "except SystemExit: print(*{m.split('.')[0] for m in sys.modules})"
  )
  run = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=subprocess_env()
  )
  assert "usage: python -m zerojax_launch" in run.stdout
  assert not {"jax", "jaxlib", "optax", "orbax", "flax", "zerojax"} & set(run.stdout.split())
  assert zerojax.launch.launch is zerojax_launch.launch
  assert set(zerojax.__all__) <= set(dir(zerojax))
  assert all(getattr(zerojax, name) is not None for name in zerojax.__all__)


def test_a_linen_program_imports_no_nnx():
  # zerojax.flax.linen and zerojax.flax.nnx import their own Flax API each: NNX costs a Linen
  # program 0.7 s of imports (IPython among them).
  code = "import sys, zerojax.flax.linen; print(any(m.startswith('flax.nnx') for m in sys.modules))"
  run = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=subprocess_env()
  )
  assert run.stdout.split() == ["False"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_stage_is_a_plain_function_with_its_signature(stage):
  factory = getattr(zerojax, f"zero{stage}")
  signature = inspect.signature(factory)
  assert factory.__name__ == f"zero{stage}" and inspect.isfunction(factory)
  assert signature.return_annotation == "ZeroTransformation"
  assert signature.parameters["precision"].kind is inspect.Parameter.KEYWORD_ONLY
  stage_3_only = {"quantized_weights", "secondary_axis", "packed_gathers"}
  expected = [
    parameter
    for name, parameter in inspect.signature(zerojax.zero3).parameters.items()
    if stage == 3 or name not in stage_3_only
  ]
  assert list(signature.parameters.values()) == expected


def test_console_scripts_are_public_and_the_version_is_written_once():
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())
  for target in project["project"]["scripts"].values():
    module, _, function = target.partition(":")
    assert "._" not in module and callable(getattr(__import__(module, fromlist=["_"]), function))
  assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
  assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "zerojax.__version__"}


def make_mesh(n, types=AxisType.Auto, extra=None):
  devices = jax.devices()[: n * (extra or 1)]
  if extra:
    return jax.make_mesh((n, extra), ("data", "model"), (types, types), devices=devices)
  return jax.make_mesh((n,), ("data",), (types,), devices=devices)


@functools.cache
def adam_reference():
  return models.reference(optax.adam(1e-2), models.make_params(), models.make_batch(), 2)


# Stage 3 on every mesh; stages 1 and 2 take turns (test_equivalence.py runs all three on the
# whole 8-device mesh).
MESH_CASES = [
  *(((1,), 1), ((2,), 2), ((4,), 1), ((8, AxisType.Explicit), 2), ((4, AxisType.Auto, 2), 1)),
  *(((1,), 3), ((2,), 3), ((4,), 3), ((8, AxisType.Explicit), 3), ((4, AxisType.Auto, 2), 3)),
]


@pytest.mark.parametrize("mesh_args, stage", MESH_CASES, ids=str)
def test_meshes_match_plain_optax(mesh_args, stage):
  mesh = make_mesh(*mesh_args)
  params, batch = models.make_params(), models.make_batch()
  tx = getattr(zerojax, f"zero{stage}")(optax.adam(1e-2), mesh=mesh, min_shard_size=1)
  chex.assert_trees_all_close(models.train(tx, params, batch, 2), adam_reference(), **ROUNDING)


def test_mesh_from_set_mesh():
  mesh = make_mesh(8, AxisType.Explicit)
  with jax.set_mesh(mesh):
    tx = zerojax.zero3(optax.sgd(0.1))
  assert tx.mesh is mesh and tx.axis_name == "data" and tx.stage == 3


def test_stage_layouts_and_shardings(mesh):
  params = {"w": jnp.ones((16, 64)), "b": jnp.ones(3)}
  for stage, w_spec in [(1, ()), (2, ()), (3, (None, "data"))]:
    tx = getattr(zerojax, f"zero{stage}")(optax.adam(0.1), mesh=mesh)
    placed = tx.shard(params)
    assert tuple(placed["w"].sharding.spec) in {w_spec, (None, None)}
    state = tx.init(placed)
    assert state.inner_state[0].mu["w"].sharding.spec == jax.P(None, "data")
    stored = lambda x: x.value if isinstance(x, zerojax.Stored) else x
    assert stored(tx.param_shardings(params)["w"]) == stored(placed["w"]).sharding
    assert jax.tree.structure(tx.state_shardings(params)) == jax.tree.structure(state)
    gathered = tx.gather(placed)
    np.testing.assert_array_equal(gathered["w"], params["w"])
    assert gathered["w"].sharding.is_fully_replicated


def test_padded_leaf_round_trip(mesh):
  tx = zerojax.zero3(optax.adam(0.1), mesh=mesh, min_shard_size=1)
  x = jnp.arange(7 * 13, dtype=jnp.float32).reshape(7, 13)
  placed = tx.shard({"x": x})
  assert placed["x"].shape == (7, 16)
  assert placed["x"].value.addressable_shards[0].data.shape == (7, 2)
  np.testing.assert_array_equal(tx.gather(placed)["x"], x)
  np.testing.assert_array_equal(jax.jit(tx.gather)(placed)["x"], x)


@pytest.mark.parametrize("types", [AxisType.Auto, AxisType.Explicit])
def test_stored_params_carry_their_layout(types):
  # What tx.shard returns says what it is: another transformation, which has never seen the
  # model, reads the logical shapes from it, inside jit too, on either axis type; a model of
  # its own whose logical shapes are the padded ones is never mistaken for it.
  mesh = make_mesh(8, types)
  fresh = lambda: zerojax.zero3(optax.sgd(0.1), mesh=mesh, min_shard_size=1)
  params = {"w": jnp.arange(7 * 13, dtype=jnp.float32).reshape(7, 13)}
  placed = zerojax.zero3(optax.adam(0.1), mesh=mesh, min_shard_size=1).shard(params)
  assert isinstance(placed["w"], zerojax.Stored)
  assert (placed["w"].shape, placed["w"].layout.shape) == ((7, 16), (7, 13))
  np.testing.assert_array_equal(jax.jit(fresh().gather)(placed)["w"], params["w"])
  np.testing.assert_array_equal(fresh().gather(placed)["w"], params["w"])
  # Two models stored with the same shapes, padded along other dimensions: each leaf knows.
  rows = zerojax.zero3(optax.sgd(0.1), mesh=mesh, min_shard_size=1, layout=jax.P("data"))
  tall = rows.shard({"w": jnp.ones((13, 16))})
  square = fresh().shard({"w": jnp.ones((16, 13))})
  assert tall["w"].shape == square["w"].shape == (16, 16)
  assert fresh().gather(square)["w"].shape == (16, 13)
  # Stored in another layout: laid out again through the logical values.
  np.testing.assert_array_equal(fresh().gather(tall)["w"], np.ones((13, 16)))
  for other_model in (np.ones((7, 16)), jnp.ones((7, 16)), jax.device_put(jnp.ones((7, 16)))):
    tx = fresh()  # has seen no model
    assert tx.gather(tx.shard({"w": other_model}))["w"].shape == (7, 16)
    tx = fresh()
    tx.shard(params)  # has seen a model of another structure, stored with these shapes
    assert tx.gather(tx.shard({"v": other_model}))["v"].shape == (7, 16)


def test_a_stored_leaf_whose_array_a_map_reshaped_is_refused(mesh):
  tx = zerojax.zero3(optax.sgd(0.1), mesh=mesh, min_shard_size=1)
  placed = tx.shard({"w": jnp.ones((7, 13))})
  cut = jax.tree.map(lambda x: x[:, :13], placed)  # the Stored node is kept, its array cut
  with pytest.raises(ValueError, match=r"holds an array of shape \(7, 13\), but its layout"):
    tx.gather(cut)


def test_integer_leaves_pass_through(mesh):
  inner = optax.masked(optax.adam(0.1), {"w": True, "ids": False})
  tx = zerojax.zero3(inner, mesh=mesh)
  params = {"w": jnp.ones((8, 128)), "ids": jnp.arange(16)}
  placed = tx.shard(params)
  assert placed["ids"].sharding.is_fully_replicated
  state = tx.init(placed)
  grads = {"w": jnp.ones((8, 128)), "ids": jnp.zeros(16, jnp.int32)}
  updates, _ = tx.update(grads, state, placed)
  new = optax.apply_updates(placed, updates)
  np.testing.assert_array_equal(tx.gather(new)["ids"], params["ids"])


def test_aux_is_stacked_per_device(mesh):
  tx = zerojax.zero2(optax.sgd(0.1), mesh=mesh)
  params = tx.shard({"w": jnp.ones((4, 128))})

  def loss_fn(params, x):
    w = zerojax.gather(params)["w"]
    return jnp.mean(x @ w), {"rows": x.shape[0]}

  x = jnp.ones((16, 4))
  (loss, aux), grads = zerojax.value_and_grad(loss_fn, tx, has_aux=True)(params, x)
  assert aux["rows"].shape == (8,) and int(aux["rows"][0]) == 2
  assert float(loss) == pytest.approx(4.0)
  np.testing.assert_allclose(tx.gather(grads)["w"], np.full((4, 128), 1 / 128))


def test_second_step_does_not_recompile_and_donation_works(mesh):
  params, batch = models.make_params(), models.make_batch()
  tx = zerojax.zero3(optax.adam(1e-2), mesh=mesh, min_shard_size=1)
  params = tx.shard(params)
  state = tx.init(params)
  step = jax.jit(models.explicit_step(tx).__wrapped__, donate_argnums=(0, 1))
  params, state, _ = step(params, state, *batch)
  old = params
  before = step._cache_size()
  params, state, _ = step(params, state, *batch)
  assert step._cache_size() == before
  assert old["embed"].value.is_deleted(), "donated params buffer was not reused"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_init_on_shape_dtype_structs_and_stable_state_types(stage, mesh):
  tx = getattr(zerojax, f"zero{stage}")(optax.adam(0.1), mesh=mesh, min_shard_size=1)
  params = {"w": jnp.ones((7, 13)), "b": jnp.ones(64)}
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  shapes = jax.eval_shape(tx.init, abstract)
  placed = tx.shard(params)
  state = tx.init(placed)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), shapes) == jax.tree.map(
    lambda x: (x.shape, x.dtype), state
  )
  assert jax.tree.map(lambda s: s.spec, tx.state_shardings(abstract)) == jax.tree.map(
    lambda x: x.sharding.spec, state
  )
  grads = tx.shard(params) if stage == 3 else params
  _, new_state = jax.jit(tx.update)(grads, state, placed)
  assert jax.tree.map(jax.typeof, new_state) == jax.tree.map(jax.typeof, state)
  assert jax.tree.map(lambda x: x.sharding, new_state) == jax.tree.map(lambda x: x.sharding, state)


@pytest.mark.parametrize("types", [AxisType.Auto, AxisType.Explicit])
def test_shard_inside_jit_and_gather_compiles_once(types):
  mesh = make_mesh(8, types)
  tx = zerojax.zero3(optax.adam(1e-3), mesh=mesh, min_shard_size=1)
  params = {"w": jnp.ones((64, 64)), "odd": jnp.ones((7, 13))}
  with jax.set_mesh(mesh):  # explicit axes: a jit with no placed input needs the mesh context
    placed = jax.jit(tx.shard)(params)
  assert placed["w"].sharding.spec == jax.P(None, "data") and placed["odd"].shape == (7, 16)
  tx.gather(placed)
  # Every program JAX lowers from here on (a jit's cache miss lowers before compiling; what
  # jax.eval_shape traces, to plan a layout, is not lowered).
  lowered = []
  listener = lambda event, seconds, **kwargs: lowered.append((event, kwargs))
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    for _ in range(3):
      gathered = tx.gather(placed)
    # Nor does another transformation's over the same model, whatever its optimizer.
    other = zerojax.zero3(optax.sgd(0.1), mesh=mesh, min_shard_size=1)
    assert other.layout(params) == tx.layout(params)
    np.testing.assert_array_equal(other.gather(placed)["odd"], params["odd"])
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert [e for e in lowered if e[0] == "/jax/core/compile/jaxpr_to_mlir_module_duration"] == []
  np.testing.assert_array_equal(gathered["odd"], params["odd"])


def test_drop_in_stage3_with_padded_leaves_on_explicit_axes():
  # Explicit axes cannot type an uneven split: tx.unpad hands the model padded
  # leaves whole over the data axis instead of failing in the slice.
  mesh = make_mesh(8, AxisType.Explicit)
  tx = zerojax.zero3(optax.adam(1e-2), mesh=mesh, min_shard_size=1)
  params = {"w": jnp.linspace(-1.0, 1.0, 16 * 13).reshape(16, 13), "v": jnp.ones((13, 24)) / 13}
  x = jnp.linspace(0.0, 1.0, 4 * 16).reshape(4, 16)
  loss_fn = lambda p: jnp.mean((x @ p["w"] @ p["v"]) ** 2)

  @jax.jit
  def step(params, state):
    unpadded = tx.unpad(params)
    assert unpadded["w"].shape == (16, 13) and unpadded["v"].shape == (13, 24)
    updates, state = tx.update(jax.grad(loss_fn)(unpadded), state, params)
    return optax.apply_updates(params, updates), state

  placed = tx.shard(params)
  assert placed["w"].shape == (16, 16)
  state = tx.init(placed)
  plain, plain_state = params, optax.adam(1e-2).init(params)
  for _ in range(2):
    placed, state = step(placed, state)
    updates, plain_state = optax.adam(1e-2).update(jax.grad(loss_fn)(plain), plain_state, plain)
    plain = optax.apply_updates(plain, updates)
  assert placed["w"].sharding.spec == jax.P(None, "data")
  with jax.set_mesh(mesh):  # stored (padded) params placed again inside jit
    again = jax.jit(tx.shard)(placed)
  for actual in (tx.gather(placed), tx.gather(again)):
    chex.assert_trees_all_close(actual, plain, **ROUNDING)


def test_trees_of_another_structure_raise(mesh):
  tx = zerojax.zero2(optax.adam(0.1), mesh=mesh)
  params = tx.shard({"w": jnp.ones((8, 128))})
  state = tx.init(params)
  other = tx.init(tx.shard({"w": jnp.ones((8, 128)), "v": jnp.ones((8, 128))}))
  with pytest.raises(ValueError, match="does not have the structure"):
    tx.update(params, other, params)
  with pytest.raises(ValueError, match="structure does not match the layout"):
    tx.update({"v": jnp.ones((8, 128))}, state, params)


def _public_callables():
  """Every public function, and every public method of a public class, with its qualified name."""
  modules = (zerojax, zerojax.diagnostics, zerojax.distributed, zerojax.launch)
  modules += (zerojax.flax.linen, zerojax.flax.nnx)
  for module in modules:
    for name in module.__all__:
      value = getattr(module, name)
      if inspect.isfunction(value):
        yield f"{module.__name__}.{name}", value
      elif inspect.isclass(value):
        for attribute, member in vars(value).items():
          member = getattr(member, "__func__", getattr(member, "fget", member))
          if inspect.isfunction(member) and not attribute.startswith("_"):
            yield f"{module.__name__}.{name}.{attribute}", member


def test_every_public_function_says_what_it_returns():
  missing = [
    name
    for name, function in _public_callables()
    if inspect.signature(function).return_annotation is inspect.Signature.empty
  ]
  assert not missing, missing
