"""``zerojax.pipeline``: a layer stack split into stages over a mesh axis, micro-batches flowing.

Each device of the stage mesh axis holds one stage's layers (the leading
axis of the stacked stage parameters is split over it) and runs them on one
micro-batch at a time, handing activations to the next stage and cotangents
to the previous one with ``jax.lax.ppermute``, as a ``Timetable`` says
(``timetable.py``; one stage's program is ``stage.py``).

The whole pipeline, forward and backward, is one ``jax.custom_vjp`` around
``jax.shard_map`` s that are manual over the stage axis only. So it nests
inside ``zerojax.value_and_grad`` (manual over the data axes) without binding
an axis its parent bound, and JAX never differentiates the stage program: the
backward pass is run here, slot by slot, from each micro-batch's saved VJP.

* With ``loss_fn`` (any schedule) one program runs the whole step, the last
  stage computing each micro-batch's loss and its gradient in the
  micro-batch's forward slot; the custom VJP's backward rule only scales the
  gradients it already has by the loss's cotangent.
* Without (``"gpipe"`` only) the forward program returns the last stage's
  output and the residuals, and the backward rule runs the backward program
  once the rest of the model has given the output's cotangent.

Inside ``zerojax.value_and_grad`` the stage parameters may be ``zerojax.Shard``
s (stages 2 and 3). Reducing once per step (``reduce="step"``, stage 2's
default) each stage's weights are opened once per step (gathered at stage 3,
read at stage 2), the micro-batches' gradients summed at full size in the
reduce dtype and reduce-scattered once, after the last backward pass: one
reduce-scatter (and at stage 3 one all-gather) per step instead of one per
micro-batch, for a stage's whole gradient (and, at stage 3, its gathered
weights) held during the step. With ``reduce="microbatch"`` (stage 3's
default) the stage function receives the shards (``zerojax.scan`` gathers
them a layer at a time, one layer ahead) and each micro-batch's gradient is
reduce-scattered as its backward pass produces it: ZeRO's memory, ``M`` times
the traffic.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._src.pipeline import closures
from zerojax._src.pipeline import stage as pipeline_stage
from zerojax._src.pipeline.stage import Config, Parts, is_shard, reduces_once
from zerojax._src.pipeline.timetable import check_schedule, check_virtual_stages
from zerojax._src.step import batch_mean


def pipeline(
  stage_fn: Callable[..., Any],
  stage_params: Any,
  x: Any,
  *,
  microbatches: int,
  schedule: str = "gpipe",
  loss_fn: Callable[..., jax.Array] | None = None,
  loss_params: Any = None,
  targets: tuple[Any, ...] = (),
  axis_name: str = "stage",
  reduce: str | None = None,
  key: Any = None,
  virtual_stages: int | None = None,
) -> Any:
  """Runs ``stage_fn`` as a pipeline over the ``axis_name`` mesh axis, micro-batch by micro-batch.

  ``stage_params`` holds every stage's parameters stacked along a leading axis
  of size ``S`` (the size of the mesh axis), placed on that axis
  (``NamedSharding(mesh, P(axis_name))``; ``tx.shard`` keeps the placement and
  shards over the data axes a dimension after the stage's layer dimension).
  ``stage_fn(params, h)`` computes one stage: ``params`` is that stage's slice
  (the leading axis removed; the stage's stacked layers, for
  ``zerojax.scan``), ``h`` one micro-batch's activations, and it returns the
  activations for the next stage, of the same shape and dtype. ``x`` (the
  first stage's input) is split along its leading axis into ``microbatches``
  micro-batches.

  Call it in the loss function given to ``zerojax.value_and_grad`` (the
  explicit path) or in a plain ``jax.jit`` step (drop-in). Without
  ``loss_fn`` it returns the last stage's output for the whole of ``x`` (on
  every stage), to be fed to the rest of the model; only ``"gpipe"`` can,
  since it finishes every forward before any backward. With ``loss_fn`` the
  last stage computes ``loss_fn(loss_params, h, *targets)`` for each
  micro-batch (``targets`` split like ``x``) and the pipeline returns the mean
  over micro-batches; this is what ``"1f1b"`` needs.

  Randomness inside the stages (dropout) comes from ``key``: ``stage_fn`` is
  then called as ``stage_fn(params, h, key)``, with ``key`` (a PRNG key, or a
  pytree of them) folded with the micro-batch ``m`` and then the virtual stage
  ``c`` (the stage ``s``; with ``virtual_stages``, ``k S + s`` for chunk ``k``):
  ``jax.random.fold_in(jax.random.fold_in(key, m), c)``, the same in the
  forward pass and the backward pass. Fold in each layer's index within the
  stage (or chunk) for a mask per layer. Inside ``zerojax.value_and_grad`` every
  data device gets the same key unless it differs per device (fold in
  ``jax.lax.axis_index("data")``, or pass one key per device as a batch
  argument). The activations may also carry integer leaves (keys, positions)
  from stage to stage: only their inexact leaves are differentiated.

  ``stage_fn`` and ``loss_fn`` may close over values the enclosing function
  computed (a causal mask, rotary tables, a key, a scalar computed from a
  parameter): they reach the stages as operands, replicated over the stage
  axis, and the floating-point ones are differentiated (``closures.py``). One
  held in an object's attribute is not reached: read it into a variable first.

  Args:
    stage_fn: one stage's computation, ``stage_fn(params, h) -> h``, or
      ``stage_fn(params, h, key) -> h`` with ``key``.
    stage_params: a pytree of arrays (or ``zerojax.Shard`` s) with a leading
      stage axis.
    x: the first stage's input: a pytree of arrays whose leading axis divides
      by ``microbatches``.
    microbatches: how many micro-batches ``x`` is split into.
    schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"`` (see
      ``zerojax.pipeline_timetable``).
    loss_fn: ``loss_fn(loss_params, h, *targets) -> scalar``, the mean loss of
      one micro-batch, computed by the last stage.
    loss_params: the parameters ``loss_fn`` differentiates (the head); may hold
      ``zerojax.Shard`` s.
    targets: arrays ``loss_fn`` reads, split into micro-batches like ``x``.
    axis_name: the mesh axis of the stages.
    reduce: ``"step"`` to reduce-scatter sharded stage gradients once per step,
      ``"microbatch"`` to reduce-scatter each micro-batch's (stages 2 and 3),
      ``None`` for the stage's default: once per step at stage 2, where it
      holds a stage's whole gradient as stage 1 does; per micro-batch at stage
      3, which would otherwise hold the stage's gathered weights as well.
    key: a PRNG key (or a pytree of them) for randomness inside the stages,
      handed to ``stage_fn`` folded with the micro-batch and the virtual stage.
    virtual_stages: ``schedule="interleaved"``'s chunks per stage, ``v``.
      Each stage's stacked layers (their second axis) are then ``v`` chunks
      in turn, chunk ``k`` of stage ``s`` being virtual stage ``k S + s``,
      and ``stage_fn`` runs one chunk: restack ``(layers, ...)`` as
      ``a.reshape(v, S, -1, ...).swapaxes(0, 1).reshape(S, -1, ...)``.

  Returns:
    The last stage's output for ``x``, or the mean loss with ``loss_fn``.

  Example:
    >>> import jax, jax.numpy as jnp, zerojax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((2, 4), ("stage", "data"))
    >>> w = jax.device_put(jnp.full((2, 3, 16, 16), 0.1), NamedSharding(mesh, P("stage")))
    >>> def stage_fn(w, h):  # one stage: its 3 layers
    ...   return zerojax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, w)[0]
    >>> with jax.set_mesh(mesh):
    ...   y = jax.jit(lambda w, x: zerojax.pipeline(stage_fn, w, x, microbatches=4))(
    ...     w, jnp.ones((8, 16)))
    >>> y.shape
    (8, 16)
  """
  check_schedule(schedule)
  reduces_once(reduce, splits_params=True)  # raises for anything else
  if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
    raise ValueError(f"microbatches must be a positive int, got {microbatches!r}.")
  if loss_fn is None and schedule != "gpipe":
    raise ValueError(
      f"schedule={schedule!r} runs a micro-batch's backward pass before later micro-batches' "
      "forward passes, so the loss must be computed inside the pipeline: pass loss_fn=... "
      "(and loss_params=, targets=), or use schedule='gpipe'."
    )
  if loss_fn is None and (loss_params is not None or targets):
    raise ValueError("loss_params= and targets= are read by loss_fn=...: pass loss_fn too.")
  if not isinstance(targets, tuple):
    raise ValueError(f"targets must be a tuple of arrays (or pytrees), got {_kind(targets)}.")
  _check_stage_fn(stage_fn, key)
  mesh = mesh_of(axis_name, (stage_params, x))
  stages = mesh.shape[axis_name]
  check_virtual_stages(schedule, virtual_stages, stages, microbatches)
  _check_stage_params(stage_params, stages, axis_name, virtual_stages or 1)
  _check_microbatches(microbatches, x, targets)
  parts = Parts.of(x)
  config = Config(
    stage_fn, loss_fn, axis_name, mesh, schedule, microbatches, reduce, parts, virtual_stages
  )
  if loss_fn is not None:
    _warn_if_summed(loss_fn, loss_params, x, targets, microbatches)
  config, closed = _closed_over(config, stage_params, loss_params, x, targets, key)
  try:
    return _run(config, stage_params, loss_params, x, targets, key, closed)
  except (NotImplementedError, ValueError) as error:
    if not any(sign in str(error) for sign in _CLOSED_OVER):
      raise
    raise ValueError(
      "zerojax.pipeline: stage_fn or loss_fn closes over an array from outside the pipeline "
      "that zerojax could not hand to the stages, so it reached the stages' shard_map "
      f"as a value of another mesh ({str(error).splitlines()[0]}). zerojax hands over the "
      "arrays a function reads through its closure (variables of the enclosing function, "
      "directly or in a tuple, list or dict, and the functions it calls that close over "
      "them), but not one held in an object's attribute. Read it into a variable first "
      "(key = holder.key), or pass it: "
      "random keys with key=..., arrays the stages read in stage_params, the head's in "
      "loss_params."
    ) from error


#: What JAX says when a function inside a ``shard_map`` closes over an array ``closures``
#: could not hand over: the ``shard_map`` refuses it (Explicit axes), or an operation on it
#: finds that its mesh is not the one inside (where the stage axis is manual).
_CLOSED_OVER = (
  "Closing over inputs to shard_map",
  "should match the aval mesh",
  "should match the mesh of sharding",
)


def _closed_over(
  config: Config, stage_params, loss_params, x, targets, key
) -> tuple[Config, tuple[list[Any], list[Any]]]:
  """``config`` with ``stage_fn`` and ``loss_fn`` as ``closures.Closure`` s, and the tracers
  each closes over.

  Each is traced at one micro-batch's types, with one stage's (one chunk's)
  parameters as the stage receives them (``closures.close``).
  """
  chunks, reduce = config.virtual_stages or 1, config.reduce
  batch = batch_mean.resized(x, 1, config.microbatches)

  def sliced(a):  # one chunk of one stage: the leading stage axis dropped
    kind = jax.typeof(a)
    spec = tuple(getattr(kind.sharding, "spec", None) or ())[1:]
    shape = (kind.shape[1] // chunks, *kind.shape[2:]) if chunks > 1 else kind.shape[1:]
    return kind.update(shape=shape, sharding=kind.sharding.update(spec=P(*spec)))

  def view(tree):  # the types the function receives (ShapedArrays: their manual axes too)
    received = lambda t: pipeline_stage.received(t, reduce)
    jaxpr, shape = jax.make_jaxpr(received, return_shape=True)(tree)
    return jax.tree.unflatten(jax.tree.structure(shape), jaxpr.out_avals)

  keys = () if key is None else (jax.tree.map(jax.typeof, key),)
  stage_fn, stage_closed = closures.close(
    config.stage_fn, (view(jax.tree.map(sliced, stage_params)), batch, *keys)
  )
  if config.loss_fn is None:
    return config._replace(stage_fn=stage_fn), (list(stage_closed), [])
  targets = batch_mean.resized(targets, 1, config.microbatches)
  loss_fn, loss_closed = closures.close(config.loss_fn, (view(loss_params), batch, *targets))
  closed = (list(stage_closed), list(loss_closed))
  return config._replace(stage_fn=stage_fn, loss_fn=loss_fn), closed


def _warn_if_summed(loss_fn, loss_params, x, targets, microbatches: int) -> None:
  """Warns if ``loss_fn`` sums over its micro-batch, which the mean over micro-batches shrinks.

  It is traced, not run, on one micro-batch's types (a stage's output has its
  input's), by ``batch_mean.looks_summed`` as ``zerojax.value_and_grad``
  checks its own loss.
  """
  batch = (batch_mean.resized(x, 1, microbatches), *batch_mean.resized(targets, 1, microbatches))
  if not batch_mean.looks_summed(loss_fn, batch, params=(loss_params,)):
    return
  warnings.warn(
    "zerojax.pipeline: loss_fn's loss looks like a sum over its micro-batch, not a mean (no "
    "constant in it changes with the micro-batch size, as jnp.mean's divisor does, and it "
    "divides by nothing computed from the batch). The pipeline returns the mean of the "
    f"{microbatches} micro-batches' losses (and zerojax.value_and_grad the mean over the data "
    f"devices), so a sum comes out 1/{microbatches} (times 1/data devices) of the loss on the "
    "whole batch, and so do the gradients. Average over the micro-batch (jnp.mean), or "
    "multiply a sum you mean by the number of micro-batches (and data devices).",
    stacklevel=3,
  )


@functools.partial(jax.jit, static_argnums=0)
def _run(config: Config, stage_params, loss_params, x, targets, key, closed):
  """The pipeline, as one program even where its caller runs op by op.

  ``zerojax.value_and_grad`` called outside ``jax.jit`` runs its
  ``shard_map`` eagerly, and JAX cannot run a ``shard_map`` nested in an
  eager one (the inner one's arguments arrive with a leading axis of size 1
  that it maps to the outer axes). Under ``jax.jit`` this is inlined.
  """
  stage_params, loss_params, x, targets, key, closed = _placed(
    config, stage_params, loss_params, x, targets, key, closed
  )
  if config.loss_fn is None:
    return _activations(config, stage_params, x, key, closed)
  return _loss(config, stage_params, loss_params, x, targets, key, closed)


def _kind(x: Any) -> str:
  shape = getattr(x, "shape", None)
  return f"an array of shape {tuple(shape)}" if shape is not None else f"a {type(x).__name__}"


def _arrays(tree: Any) -> list[Any]:
  """The arrays of ``tree``, those inside ``zerojax.Shard`` s included."""
  return jax.tree.leaves(tree)


def stage_count(tree: Any, axis_name: str = "stage") -> int:
  """The number of pipeline stages: the size of ``axis_name`` on the mesh of ``tree``.

  The mesh is the one in context (``jax.set_mesh``, or the one inside
  ``zerojax.value_and_grad``), else the one ``tree``'s arrays are placed on.
  """
  return mesh_of(axis_name, tree).shape[axis_name]


def by_stage(tree: Any, axis_name: str = "stage") -> Any:
  """Layers stacked ``(layers, ...)`` restacked ``(stages, layers per stage, ...)``.

  ``zerojax.Shard`` s keep their facts (the sharded dimension counts from the
  end). The stage axis splits the layers into contiguous blocks, so a stack
  placed on it along its leading dimension stays where it is.
  """
  stages = stage_count(tree, axis_name)

  def restack(path, a):
    if a.shape[0] % stages:
      raise ValueError(
        f"layers{jax.tree_util.keystr(path)} stacks {a.shape[0]} layers, which the "
        f"{stages} stages of the {axis_name!r} axis cannot share evenly: use a number of "
        f"layers that divides by {stages}, or another number of stages."
      )
    return a.reshape(stages, a.shape[0] // stages, *a.shape[1:])

  return jax.tree_util.tree_map_with_path(restack, tree)


def mesh_of(axis_name: str, trees: Any) -> Any:
  """The mesh in context (``jax.set_mesh``, or inside ``value_and_grad``), else the arrays'."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    for leaf in _arrays(trees):
      sharding = jax.typeof(leaf).sharding if isinstance(leaf, Tracer) else None
      sharding = sharding or getattr(leaf, "sharding", None)
      found = getattr(sharding, "mesh", None)
      if found is not None and not found.empty and axis_name in found.axis_names:
        mesh = getattr(found, "abstract_mesh", found)
        break
  if mesh.empty:
    raise ValueError(
      f"zerojax.pipeline found no mesh with a {axis_name!r} axis: call it under "
      "jax.set_mesh(mesh), or place the stage parameters on the mesh with "
      f"NamedSharding(mesh, P({axis_name!r}))."
    )
  if axis_name not in mesh.axis_names:
    close = difflib.get_close_matches(axis_name, mesh.axis_names, n=1)
    fix = f"did you mean axis_name={close[0]!r}?" if close else "pass axis_name=... naming one."
    raise ValueError(
      f"mesh has no axis {axis_name!r} (its axes are {mesh.axis_names}) to run the "
      f"pipeline stages over; {fix}"
    )
  return mesh


def _check_stage_fn(stage_fn: Callable[..., Any], key: Any) -> None:
  """Raises if ``key=`` is given and ``stage_fn`` cannot take it as a third argument.

  A function whose signature Python cannot read (some builtins) is not checked.
  """
  if key is None:
    return
  try:
    signature = inspect.signature(stage_fn)
  except (TypeError, ValueError):
    return
  try:
    signature.bind(None, None, None)
  except TypeError:
    raise ValueError(
      f"zerojax.pipeline was given key=, so it calls stage_fn(params, h, key), but stage_fn "
      f"takes {signature.replace(return_annotation=inspect.Signature.empty)}: give it a third "
      "parameter, stage_fn(params, h, key), and draw each layer's numbers from it (fold in "
      "the layer's index), or drop key=."
    ) from None


def _check_stage_params(stage_params: Any, stages: int, axis_name: str, chunks: int) -> None:
  leaves = jax.tree_util.tree_flatten_with_path(stage_params, is_leaf=is_shard)[0]
  if not leaves:
    raise ValueError("stage_params holds no arrays: pass the stages' stacked parameters.")
  for path, leaf in leaves:
    where = f"stage_params{jax.tree_util.keystr(path)}"
    value = leaf.value if is_shard(leaf) else leaf
    shape = tuple(np.shape(value))
    if not shape or shape[0] != stages:
      raise ValueError(
        f"{where} has shape {shape}, but the mesh's {axis_name!r} axis has {stages} stages: "
        f"stack the stages' parameters along a leading axis of size {stages} (reshape "
        f"(layers, ...) to ({stages}, layers // {stages}, ...))."
      )
    if chunks > 1 and (len(shape) < 2 or shape[1] % chunks):
      raise ValueError(
        f"{where} has shape {shape}: the interleaved schedule splits each stage's layers "
        f"(the second axis) into virtual_stages={chunks} chunks, which does not divide. "
        f"Give each stage a multiple of {chunks} layers."
      )
    if is_shard(leaf) and value.ndim + leaf.dim < 2 and value.ndim >= 3:
      raise ValueError(
        f"{where} is split over the data axes along dimension {value.ndim + leaf.dim}, its "
        "per-stage layer axis: place the stacked stage parameters on the stage axis "
        f"(NamedSharding(mesh, P({axis_name!r}))) before tx.shard, so that the layout keeps "
        "the stage and layer axes whole."
      )


def _check_microbatches(microbatches: int, x: Any, targets: tuple[Any, ...]) -> None:
  rows = None
  for name, tree in (("x", x), *((f"targets[{i}]", t) for i, t in enumerate(targets))):
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      where = f"{name}{jax.tree_util.keystr(path)}"
      shape = tuple(np.shape(leaf))
      if not shape or shape[0] % microbatches:
        raise ValueError(
          f"zerojax.pipeline splits {where} of shape {shape} into {microbatches} "
          f"micro-batches along its leading axis, which does not divide. Inside "
          "zerojax.value_and_grad that is each device's slice: make the global batch a "
          f"multiple of the data devices times {microbatches}."
        )
      if rows is None:
        rows = (where, shape[0])
      elif shape[0] != rows[1]:
        raise ValueError(
          f"{where} has {shape[0]} rows but {rows[0]} has {rows[1]}: targets are split "
          "into micro-batches like x, so they must have as many rows."
        )


# The custom VJPs. JAX calls the forward rule under differentiation, and the
# primal function otherwise (evaluation).


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _loss(config: Config, weights, loss_params, x, targets, key, closed):
  return _fused(config, weights, loss_params, x, targets, key, closed)[0]


def _loss_forward(config, weights, loss_params, x, targets, key, closed):
  loss, grads = _fused(config, weights, loss_params, x, targets, key, closed)
  return loss, (grads, _types((weights, loss_params, x, closed)))


def _loss_backward(config, residuals, cotangent):
  # The pipeline ran the backward pass with a cotangent of 1 for the loss: the
  # gradients scale with the cotangent that arrives (1, or a loss scale).
  grads, types = residuals
  gw, gl, dx, gc = jax.tree.map(lambda g: (g * cotangent.astype(g.dtype)).astype(g.dtype), grads)
  gw, gl, dx, gc = _matched((gw, gl, config.parts.cotangent(dx), gc), types)
  return gw, gl, dx, None, None, gc


_loss.defvjp(_loss_forward, _loss_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _activations(config: Config, weights, x, key, closed):
  return _forward_only(config, weights, x, key, closed)[0]


def _activations_forward(config, weights, x, key, closed):
  y, saved = _forward_only(config, weights, x, key, closed)
  return y, (saved, weights, x, closed, _types((weights, x, closed)))


def _activations_backward(config, residuals, dy):
  # Only the inexact leaves of the activations carry a cotangent (the rest: float0).
  saved, weights, x, closed, types = residuals
  gw, dx, gc = _backward_only(config, saved, weights, x, config.parts.diff(dy), closed)
  gw, dx, gc = _matched((gw, config.parts.cotangent(dx), gc), types)
  return gw, dx, None, gc


_activations.defvjp(_activations_forward, _activations_backward)


def _shard_map(config: Config, program: Callable[..., Any], in_specs: Any, out_specs: Any):
  """``program`` run by every stage: manual over the stage axis only."""
  return jax.shard_map(
    program, mesh=config.mesh, in_specs=in_specs, out_specs=out_specs, axis_names={config.axis_name}
  )


def _fused(config: Config, weights, loss_params, x, targets, key, closed):
  staged = P(config.axis_name)
  program = functools.partial(pipeline_stage.fused_program, config)
  in_specs, out_specs = (staged, *[P()] * 5), (P(), (staged, P(), P(), P()))
  return _shard_map(config, program, in_specs, out_specs)(
    weights, loss_params, x, targets, key, closed
  )


def _forward_only(config: Config, weights, x, key, closed):
  found: list[Any] = []
  staged = P(config.axis_name)
  program = functools.partial(pipeline_stage.forward_program, config, found)
  y, stored = _shard_map(config, program, (staged, P(), P(), P()), (P(), staged))(
    weights, x, key, closed
  )
  return y, _Saved(stored, *found[0])


def _backward_only(config: Config, saved, weights, x, dy, closed):
  staged = P(config.axis_name)
  program = functools.partial(pipeline_stage.backward_program, config, saved.treedef, saved.where)
  return _shard_map(config, program, (staged, staged, P(), P(), P()), (staged, P(), P()))(
    saved.stored, weights, x, dy, closed
  )


@jax.tree_util.register_pytree_node_class
class _Saved:
  """The forward program's residuals, stacked per stage, and the form of their pullback."""

  def __init__(self, stored, treedef, where):
    self.stored, self.treedef, self.where = stored, treedef, where

  def tree_flatten(self):
    return (self.stored,), (self.treedef, self.where)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)


@jax.tree_util.register_pytree_node_class
class _Types:
  """The manual axes each array of a tree varies over: static, to match cotangents to."""

  def __init__(self, tree):
    self.tree = tree

  def tree_flatten(self):
    leaves, treedef = jax.tree.flatten(self.tree)
    return (), (treedef, tuple(leaves))

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(jax.tree.unflatten(*aux))


def _types(tree: Any) -> _Types:
  return _Types(jax.tree.map(lambda a: frozenset(jax.typeof(a).manual_axis_type.varying), tree))


def _matched(cotangents: Any, types: _Types) -> Any:
  """Cotangents summed over the manual axes their primal does not vary over.

  A primal that is the same on every device of an axis gets the sum of their
  cotangents, as JAX's own transposes give it.
  """

  def match(c, varying):
    if c is None:
      return None
    extra = tuple(sorted(set(jax.typeof(c).manual_axis_type.varying) - varying))
    return jax.lax.psum(c, extra) if extra else c

  return jax.tree.map(match, cotangents, types.tree, is_leaf=lambda x: x is None)


def _placed(config: Config, weights, loss_params, x, targets, key, closed) -> tuple[Any, ...]:
  """The arguments typed as the stage ``shard_map`` takes them (explicit stage axes only).

  The stage parameters are placed on the stage axis along their leading
  dimension, the rest replicated over it; other axes keep their placement.
  The placement names the mesh, so that it holds without ``jax.set_mesh``
  (a drop-in step on arrays placed with ``NamedSharding``).
  """
  mesh, axis = config.mesh, config.axis_name
  if mesh.axis_types[mesh.axis_names.index(axis)] != AxisType.Explicit:
    return weights, loss_params, x, targets, key, closed

  def place(leaf, staged):
    entries = [_without(e, axis) for e in (*jax.typeof(leaf).sharding.spec, *[None] * leaf.ndim)]
    entries = entries[: leaf.ndim]
    if staged:
      entries[0] = axis if entries[0] is None else (axis, *_names(entries[0]))
    return jax.sharding.reshard(leaf, NamedSharding(mesh, P(*entries)))

  return (
    jax.tree.map(lambda a: place(a, True), weights),
    *(
      jax.tree.map(lambda a: place(a, False), tree)
      for tree in (loss_params, x, targets, key, closed)
    ),
  )


def _names(entry: Any) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _without(entry: Any, axis: str) -> Any:
  rest = tuple(n for n in _names(entry) if n != axis)
  return None if not rest else rest[0] if len(rest) == 1 else rest
