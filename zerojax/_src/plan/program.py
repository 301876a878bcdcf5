"""The user's model, as the planner takes it, and the training step each ``Setup`` makes of it.

A ``Program`` is a model written as zerojax users write one: an embedding, a
stack of layers that ``zerojax.scan`` runs (or a pipeline's stages, each a
scan of its share of the layers), and a head that computes the loss. The
planner owns the choices a ``Setup`` makes (the optimizer's wrapping, the
mesh, ``scan`` 's options, the pipeline), so it builds the step around the
program's pieces; the pieces are the user's code, run as they are, closures,
``jax.checkpoint`` s and all.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._src.core import transformation
from zerojax._src.pipeline import loop as pipeline_lib
from zerojax._src.plan.setup import Setup
from zerojax._src.step import scan as scan_lib
from zerojax._src.step import value_and_grad as value_and_grad_lib

#: The stacked layers' key in a program's parameters.
LAYERS = "layers"
#: The optimizer a ``Program`` that names none is planned with (its state: two moments).
DEFAULT_OPTIMIZER = optax.adamw(1e-4)
#: The pipeline's mesh axis.
STAGE = "stage"


@dataclasses.dataclass(frozen=True)
class Program:
  """A model for ``zerojax.plan``: an embedding, a stack of layers and a head.

  The parameters are a dict whose ``"layers"`` entry holds every layer's
  parameters stacked along a leading layer axis; its other entries (the
  embedding, the head) are the program's own. ``embed`` and ``head`` receive
  the parameters as ``zerojax.value_and_grad`` gives them to a loss (at stage
  3, ``zerojax.Shard`` s: open what you use with ``zerojax.gather``), without
  ``"layers"``; ``layer`` receives one layer's, gathered. The planner never
  runs ``init``: it reads its shapes (``jax.eval_shape``).

  The planner imports the program in worker processes, so define it at the
  top level of a module (or of a script), and pass it, or ``"module:name"``
  / ``"path/to/file.py:name"``, to ``zerojax.plan``.

  Attributes:
    init: ``init(key) -> params``, the float parameters.
    embed: ``embed(params, batch) -> h``, the first layer's input for one
      device's share of the batch.
    layer: ``layer(h, layer_params) -> h``; it may close over module-level
      values, sit under its own ``jax.checkpoint`` and name activations with
      ``checkpoint_name``.
    head: ``head(params, h, batch) -> loss``, the mean loss over the share.
    batch: ``batch(examples) -> pytree of jax.ShapeDtypeStruct``: a global
      batch of ``examples`` (every leaf's leading axis).
    optimizer: the optax optimizer zerojax wraps.
    precision: ``zerojax.zero3`` 's ``precision=`` (``"bf16"``, ...).
    names: the ``checkpoint_name`` s of the layer's activations that
      ``Setup(remat="names")`` keeps and ``"offload"`` moves to host memory.
    tokens_per_example: tokens in one example, for tokens per second (1 if
      the examples are not sequences).
    name: what reports call the program.

  Example:
    >>> import jax, jax.numpy as jnp, optax, zerojax
    >>> def init(key):
    ...   return {"layers": {"w": jnp.zeros((4, 64, 64))}, "out": jnp.zeros((64, 10))}
    >>> program = zerojax.planning.Program(
    ...   init=init,
    ...   embed=lambda params, batch: batch["x"],
    ...   layer=lambda h, w: jnp.tanh(h @ w["w"]),
    ...   head=lambda params, h, batch: jnp.mean((h @ zerojax.gather(params["out"])) ** 2),
    ...   batch=lambda n: {"x": jax.ShapeDtypeStruct((n, 64), jnp.float32)},
    ...   optimizer=optax.adam(1e-3),
    ... )
    >>> program.layers, program.parameters
    (4, 17024)
  """

  init: Callable[[jax.Array], Any]
  embed: Callable[[Any, Any], Any]
  layer: Callable[[Any, Any], Any]
  head: Callable[[Any, Any, Any], jax.Array]
  batch: Callable[[int], Any]
  optimizer: optax.GradientTransformation = DEFAULT_OPTIMIZER
  precision: str | None = None
  names: tuple[str, ...] = ()
  tokens_per_example: int = 1
  name: str = "program"

  def abstract_params(self) -> Any:
    """The parameters' shapes and dtypes, checked to hold the stacked ``"layers"``."""
    params = jax.eval_shape(self.init, jax.ShapeDtypeStruct((2,), "uint32"))
    if not isinstance(params, dict) or LAYERS not in params:
      raise ValueError(
        f"{self.name}'s init returns {type(params).__name__}; the planner needs a dict whose "
        f"{LAYERS!r} entry stacks every layer's parameters along a leading axis."
      )
    sizes = {x.shape[0] if x.ndim else 0 for x in jax.tree.leaves(params[LAYERS])}
    if len(sizes) != 1 or 0 in sizes:
      raise ValueError(
        f"{self.name}'s params[{LAYERS!r}] leaves have leading axes {sorted(sizes)}; stack every "
        "layer's parameters along one leading axis of the layer count."
      )
    return params

  @property
  def layers(self) -> int:
    """How many layers the stack has."""
    return jax.tree.leaves(self.abstract_params()[LAYERS])[0].shape[0]

  @property
  def parameters(self) -> int:
    """How many parameters the program has."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(self.abstract_params()))


#: ``zerojax.scan`` 's ``policy=`` for each ``Setup.remat``, as code (``names`` fills in the
#: program's ``checkpoint_name`` s).
POLICY_CODE = {
  "full": "None",
  "dots": "jax.checkpoint_policies.dots_saveable",
  "names": "jax.checkpoint_policies.save_only_these_names({names})",
  "offload": (
    "jax.checkpoint_policies.save_and_offload_only_these_names(names_which_can_be_saved=[], "
    'names_which_can_be_offloaded=[{names}], offload_src="device", offload_dst="pinned_host")'
  ),
  "none": '"everything_saveable"',
}


def policy(remat: str, names: tuple[str, ...]) -> Any:
  """``zerojax.scan`` 's ``policy=`` for ``Setup.remat`` (see ``POLICY_CODE``)."""
  policies = jax.checkpoint_policies
  if remat == "names":
    return policies.save_only_these_names(*names)
  if remat == "offload":
    return policies.save_and_offload_only_these_names(
      names_which_can_be_saved=[],
      names_which_can_be_offloaded=list(names),
      offload_src="device",
      offload_dst="pinned_host",
    )
  return {"full": None, "dots": policies.dots_saveable, "none": "everything_saveable"}[remat]


def optimizer(program: Program, setup: Setup, mesh: jax.sharding.Mesh):
  """The ``zerojax.zero1/2/3`` transformation ``setup`` wraps the program's optimizer in."""
  factory = {1: transformation.zero1, 2: transformation.zero2, 3: transformation.zero3}
  options = zero_options(setup, mesh.axis_names)
  return factory[setup.stage](program.optimizer, mesh=mesh, precision=program.precision, **options)


def zero_options(setup: Setup, axis_names: tuple[str, ...]) -> dict[str, Any]:
  """The keyword arguments of ``zerojax.zero{stage}`` for ``setup`` on a mesh of ``axis_names``."""
  data: tuple[str, ...] = tuple(a for a in axis_names if a != STAGE)
  options: dict[str, Any] = {"axis_name": data[0] if len(data) == 1 else data}
  if setup.sharding == "hybrid":
    options = {"axis_name": "data", "replica_axis": "node"}
  elif setup.sharding == "hpz":
    options["secondary_axis"] = "data"
  if setup.quantized_weights:
    options["quantized_weights"] = "int8"
  if setup.quantized_gradients:
    options["quantized_gradients"] = "int8"
  if setup.offload:
    options["offload"] = setup.offload
  return options


def step_function(program: Program, setup: Setup, tx: Any) -> Callable[..., Any]:
  """``step(params, opt_state, batch) -> (params, opt_state, loss)`` for ``setup``."""
  scan_policy = policy(setup.remat, program.names)

  def stack(weights: Any, h: Any) -> Any:
    layer = lambda h, w: (program.layer(h, w), None)
    return scan_lib.scan(layer, h, weights, prefetch=setup.prefetch, policy=scan_policy)[0]

  def loss(params: dict[str, Any], batch: Any) -> jax.Array:
    others = {k: v for k, v in params.items() if k != LAYERS}
    h = program.embed(others, batch)
    if setup.pipeline == 1:
      return program.head(others, stack(params[LAYERS], h), batch)
    leaves, treedef = jax.tree.flatten(batch)
    return pipeline_lib.pipeline(
      stack,
      params[LAYERS],
      h,
      microbatches=setup.microbatches,
      schedule=setup.schedule,
      loss_fn=lambda head, h, *leaves: program.head(head, h, treedef.unflatten(leaves)),
      loss_params=others,
      targets=tuple(leaves),
    )

  def step(params, opt_state, batch):
    value, grads = value_and_grad_lib.value_and_grad(loss, tx)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return step


def restacked(params: dict[str, Any], setup: Setup) -> dict[str, Any]:
  """``params`` with a pipeline's layers stacked by stage: ``(layers, ...)`` to ``(stages,
  layers // stages, ...)``; as they are without a pipeline."""
  if setup.pipeline == 1:
    return params
  restack = lambda x: x.reshape(setup.pipeline, x.shape[0] // setup.pipeline, *x.shape[1:])
  return {**params, LAYERS: jax.tree.map(restack, params[LAYERS])}


def placed_params(program: Program, setup: Setup, mesh: jax.sharding.Mesh) -> Any:
  """The whole parameters as ``jax.ShapeDtypeStruct`` s on ``mesh``: replicated, but a
  pipeline's layers over its stages."""
  params = jax.eval_shape(lambda p: restacked(p, setup), program.abstract_params())
  staged = lambda path: P(STAGE) if path[0].key == LAYERS and setup.pipeline > 1 else P()
  return jax.tree_util.tree_map_with_path(
    lambda path, x: _described(x, NamedSharding(mesh, staged(path))), params
  )


def abstract_arguments(program: Program, setup: Setup, tx: Any, mesh: jax.sharding.Mesh):
  """The step's arguments as ``jax.ShapeDtypeStruct`` s placed on ``mesh``: the stored
  parameters, the optimizer state and the global batch (``setup.batch`` a data rank)."""
  placed = placed_params(program, setup, mesh)
  stored = jax.tree.map(_described, jax.eval_shape(tx.shard, placed), tx.param_shardings(placed))
  state = jax.tree.map(_described, jax.eval_shape(tx.init, placed), tx.state_shardings(placed))
  ranks = mesh.size // setup.pipeline
  rows = NamedSharding(mesh, P(tx.batch_axes))
  batch = jax.tree.map(lambda x: _described(x, rows), program.batch(setup.batch * ranks))
  return stored, state, batch


def _described(x: Any, sharding: Any) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
