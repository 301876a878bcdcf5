"""One stage's program in ``zerojax.pipeline``: its slots, its hand-offs, its saved VJPs.

Each function ``*_program`` runs on every device of the stage axis, inside a
``jax.shard_map`` manual over that axis only (and inside whatever the caller
made manual, such as ``zerojax.value_and_grad``'s data axes). It runs the
phases of a ``Timetable``: a loop over ticks in which each stage runs a
forward slot and/or a backward slot, then sends activations one stage on and
cotangents one stage back with ``jax.lax.ppermute``.

Every stage runs every slot of a phase, and a slot without a micro-batch
(the bubble) is computed on stale inputs and masked out, never skipped with a
conditional: stages then run the same collectives in the same order, which
XLA:CPU needs (its collective-permutes meet every device), and a stage waits
for the slowest one once per tick anyway.

A forward slot keeps its micro-batch's VJP (``jax.vjp``'s residuals) in a
ring of as many slots as the schedule holds micro-batches; the stage's
weights, which a VJP keeps among its residuals, are found by identity and
shared rather than stored per micro-batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from zerojax._src.comm import shards as shards_lib
from zerojax._src.pipeline.timetable import Timetable, pipeline_timetable

#: The names (``jax.named_scope``) of a tick's forward and backward slots, in profiles and HLO.
FORWARD_SLOT, BACKWARD_SLOT = "pipeline_forward_slot", "pipeline_backward_slot"

#: When stage gradients are reduce-scattered over the data axes (stages 2 and 3).
REDUCTIONS = ("step", "microbatch")


def reduces_once(reduce: str | None, splits_params: bool) -> bool:
  """Whether gradients are reduce-scattered once per step: ``reduce``, or the stage's default.

  By default stage 2 reduces once per step (a stage's whole gradient held
  during the step, as stage 1 holds it) and stage 3 once per micro-batch
  (reducing once would also hold the stage's gathered weights for the step).

  Raises:
    ValueError: for a ``reduce`` that is not ``"step"``, ``"microbatch"`` or ``None``.
  """
  if reduce not in (*REDUCTIONS, None):
    raise ValueError(
      f"reduce must be 'step' (one reduce-scatter per step), 'microbatch' (one per "
      f"micro-batch) or None (the stage's default), got {reduce!r}."
    )
  return reduce == "step" or (reduce is None and not splits_params)


class Config(NamedTuple):
  """What one pipeline is, as static (hashable) facts.

  ``stage_fn`` and ``loss_fn`` take, first, the operands that replace the
  tracers they close over (``closures.Closure``).
  """

  stage_fn: Callable[..., Any]
  loss_fn: Callable[..., jax.Array] | None
  axis_name: str
  mesh: Any
  schedule: str
  microbatches: int
  reduce: str | None
  parts: Parts
  virtual_stages: int | None = None

  @property
  def stages(self) -> int:
    return self.mesh.shape[self.axis_name]

  def timetable(self, backward: bool) -> Timetable:
    return pipeline_timetable(
      self.schedule,
      stages=self.stages,
      microbatches=self.microbatches,
      backward=backward,
      virtual_stages=self.virtual_stages,
    )


def is_shard(x: Any) -> bool:
  return isinstance(x, shards_lib.Shard)


class Stage:
  """One stage inside the stage ``shard_map``: its parameters, micro-batches and helpers.

  Values are made the stage's own (varying over the stage axis) first, so that
  no derivative taken here sums over that axis behind our back. Over the
  parent's manual axes (the data axes inside ``value_and_grad``) types are
  left as given, except for opened weights (see ``opened``).
  """

  def __init__(
    self,
    config: Config,
    weights: Any,
    loss_params: Any = None,
    key: Any = None,
    closed: tuple[Any, Any] = ((), ()),
  ):
    self.config = config
    self.parts = config.parts
    self.key = key
    self.axes = tuple(jax.sharding.get_abstract_mesh().manual_axes)
    self.index = jax.lax.axis_index(config.axis_name)
    self.first = self.index == 0
    self.last = self.index == config.stages - 1
    weights = jax.tree.map(lambda a: self.own(a[0]), weights)  # this stage's slice
    self.chunks = config.virtual_stages or 1
    self.per_chunk = jax.tree.leaves(weights)[0].shape[0] // self.chunks
    self.weights = Params(weights, config.reduce, self.opened)
    self.loss_params = Params(jax.tree.map(self.own, loss_params), config.reduce, self.opened)
    # What stage_fn and loss_fn close over: a float one differentiated like a parameter.
    own = lambda c: self.own(c) if _inexact(c) else c
    self.closed, self.loss_closed = (
      Params(jax.tree.map(own, list(c)), config.reduce, self.opened) for c in closed
    )

  def own(self, x: jax.Array, axes: tuple[str, ...] = ()) -> jax.Array:
    """``x`` typed as varying over the stage axis and ``axes`` (the same value)."""
    varying = jax.typeof(x).manual_axis_type.varying
    missing = tuple(a for a in (self.config.axis_name, *axes) if a not in varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  def call(self, closed: list[Any], params: Any, h: Any, m: Any, k: Any) -> Any:
    """``stage_fn`` on micro-batch ``m``, chunk ``k``: with its key, if the pipeline has one."""
    if self.key is None:
      return self.config.stage_fn(closed, params, h)
    return self.config.stage_fn(closed, params, h, self.key_for(m, k))

  def key_for(self, m: Any, k: Any) -> Any:
    """The key of micro-batch ``m`` in chunk ``k`` of this stage: ``key`` folded with ``m``,
    then the virtual stage ``k S + s`` (the stage itself, with one chunk).

    So each virtual stage draws its own numbers, and a stage function that folds in its
    layer's index within the chunk gives every layer of the model its own.
    """
    virtual = k * self.config.stages + self.index
    fold = lambda key: jax.random.fold_in(jax.random.fold_in(key, m), virtual)
    return jax.tree.map(fold, self.key)

  def opened(self, x: jax.Array) -> jax.Array:
    """An opened (gathered or read) weight, typed as each device's own over every manual axis.

    So its gradient is the device's alone, summed over the data axes by the one
    reduce-scatter of ``Params.finish``, not by an implicit all-reduce.
    """
    return self.own(x, self.axes)

  def split(self, tree: Any) -> Any:
    """Leaves as ``(microbatches, rows, ...)``: row ``i`` goes to micro-batch ``i % M``.

    Strided rather than contiguous, so that rows split over other mesh axes
    (the data axes, in a drop-in step) stay on their devices.
    """
    m = self.config.microbatches
    split = lambda a: self.own(jnp.swapaxes(a.reshape(a.shape[0] // m, m, *a.shape[1:]), 0, 1))
    return jax.tree.map(split, tree)

  def merge(self, tree: Any) -> Any:
    """The inverse of ``split``."""
    return jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1).reshape(-1, *a.shape[2:]), tree)

  def consts(self, x: Any, targets: tuple[Any, ...] = ()) -> dict[str, Any]:
    """What every slot reads: both parts of the parameters and of what the functions close
    over (``c*`` stage_fn's, ``lc*`` loss_fn's), micro-batches of ``x`` and targets."""
    return {
      "wd": self.weights.diff,
      "wf": self.weights.fixed,
      "ld": self.loss_params.diff,
      "lf": self.loss_params.fixed,
      "cd": self.closed.diff,
      "cf": self.closed.fixed,
      "lcd": self.loss_closed.diff,
      "lcf": self.loss_closed.fixed,
      "xs": self.split(x),
      "ts": self.split(targets),
    }

  def zeros(self, like: Any, dtype: Any = None, lead: int | None = None) -> jax.Array:
    """Zeros of ``like``'s shape (after a leading axis of ``lead``), dtype and placement.

    They vary over every manual axis, so that whatever a loop writes into them
    keeps their type.
    """
    shape = tuple(like.shape) if lead is None else (lead, *like.shape)
    kind = like if isinstance(like, jax.ShapeDtypeStruct) else jax.typeof(like)
    spec = tuple(getattr(kind.sharding, "spec", None) or ())
    spec = spec if lead is None else (None, *spec)
    placed = {"out_sharding": P(*spec)} if any(e is not None for e in spec) else {}
    return self.own(jnp.zeros(shape, dtype or like.dtype, **placed), self.axes)

  def only(self, where: jax.Array, tree: Any) -> Any:
    """``tree`` summed over stages where only the stages ``where`` holds on contribute.

    Every other stage gives zeros, so the sum is exact: the value of the one
    stage that has it (the last stage's loss, the first stage's input
    gradient), now on every stage.
    """
    return self.summed(jax.tree.map(lambda v: jnp.where(where, v, jnp.zeros_like(v)), tree))

  def summed(self, tree: Any) -> Any:
    """``tree`` summed over the stages (the gradient of what every stage reads)."""

    def total(v):  # summed in float32 or wider: XLA:CPU fails to compile a bfloat16 psum here
      wide = v.astype(jnp.promote_types(v.dtype, jnp.float32))
      return jax.lax.psum(wide, self.config.axis_name).astype(v.dtype)

    return jax.tree.map(total, tree)

  def shift(self, tree: Any, direction: int) -> Any:
    """``tree`` from each stage to the next (``direction=1``) or the previous one (``-1``).

    With chunks (interleaved) the ends meet: the last stage's chunk hands on to
    the first stage's next chunk, and cotangents go the other way.
    """
    stages = self.config.stages
    if self.chunks > 1:
      pairs = [(s, (s + direction) % stages) for s in range(stages)]
    else:
      pairs = [(s, s + direction) for s in range(stages) if 0 <= s + direction < stages]
    return jax.lax.ppermute(tree, self.config.axis_name, pairs)

  def chunk_of(self, tree: Any, k: Any) -> Any:
    """Chunk ``k`` of the stage's layers (their leading axis): the whole stack for one chunk."""
    if self.chunks == 1:
      return tree
    n = self.per_chunk
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, k * n, n, 0), tree)

  def added(self, active: jax.Array, sums: list[Any], grads: list[Any], k: Any) -> list[Any]:
    """``sums`` with the gradients of chunk ``k`` added where they belong, if ``active``."""
    if self.chunks == 1:
      return _added(active, sums, grads)
    n = self.per_chunk

    def add(s, g):
      part = jax.lax.dynamic_slice_in_dim(s, k * n, n, 0)
      part = part + jnp.where(active, g.astype(s.dtype), jnp.zeros_like(part))
      return jax.lax.dynamic_update_slice_in_dim(s, part, k * n, 0)

    return [add(s, g) for s, g in zip(sums, grads, strict=True)]

  def first_chunk(self, k: Any) -> jax.Array:
    """Whether chunk ``k`` of this stage is the first virtual stage (reads ``x``)."""
    return self.first & (k == 0)

  def last_chunk(self, k: Any) -> jax.Array:
    """Whether chunk ``k`` of this stage is the last virtual stage (computes the loss)."""
    return self.last & (k == self.chunks - 1)


class Params:
  """A stage's (or the head's) parameters, and what their gradient is taken with respect to.

  ``diff`` are the differentiated arrays and ``join(diff, fixed)`` the
  parameters the user's function receives. Reducing once per step
  (``reduces_once``), the
  ``zerojax.Shard`` s are opened first (gathered or read, once per step) and
  the full arrays differentiated; ``finish`` reduce-scatters their summed
  gradients once. Otherwise the shards themselves are passed on and only their
  differentiable part (stage 3's value, stage 2's gradient sink) is
  differentiated: its gradient arrives reduce-scattered, micro-batch by
  micro-batch. Integer and boolean leaves pass through, undifferentiated.
  """

  def __init__(self, tree: Any, reduce: str | None, opened: Callable[[Any], Any]):
    self.leaves, self.treedef = jax.tree.flatten(tree, is_leaf=is_shard)
    self.trained = tuple(map(_trained, self.leaves))
    shards = [leaf for leaf in self.leaves if is_shard(leaf)]
    stage3 = any(shard.sink is None for shard in shards)
    self.opened = bool(shards) and reduces_once(reduce, stage3)
    self.fixed = self.leaves
    if self.opened:
      # Not differentiated here: the gather runs forward only, no reduce-scatter yet.
      full = jax.tree.leaves(shards_lib.gather(tree))
      self.fixed = [opened(a) if t else a for a, t in zip(full, self.trained, strict=True)]
    self.diff = [_differentiable(a) for a, t in zip(self.fixed, self.trained, strict=True) if t]

  def join(self, diff: list[Any], fixed: list[Any]) -> Any:
    """The parameters as the user's function receives them, from ``diff`` and ``fixed``."""
    return jax.tree.unflatten(self.treedef, self._joined(fixed, diff))

  def _joined(self, leaves: list[Any], diff: list[Any]) -> list[Any]:
    parts = iter(diff)
    return [_with(a, next(parts)) if t else a for a, t in zip(leaves, self.trained, strict=True)]

  def accumulators(self, zeros: Callable[..., jax.Array]) -> list[jax.Array]:
    """Zeros to sum the micro-batches' gradients in, float32 or wider."""
    return [zeros(d, jnp.promote_types(d.dtype, jnp.float32)) for d in self.diff]

  def finish(self, sums: list[jax.Array]) -> Any:
    """The gradient of the parameters as given, from the summed gradients of ``diff``."""
    trained = [a for a, t in zip(self.leaves, self.trained, strict=True) if t]
    if self.opened:
      # The transpose of the gather on stage-3 shards of the differentiable
      # parts, in the reduce dtype: the reduce-scatter either stage gives its
      # gradient, once per step. The gather itself goes unused.
      wide = [_reducing(a) for a in self.leaves]

      def gathered(diff):
        full = jax.tree.leaves(
          shards_lib.gather(jax.tree.unflatten(self.treedef, self._joined(wide, diff)))
        )
        return [a for a, t in zip(full, self.trained, strict=True) if t]

      parts = [_differentiable(a) for a, t in zip(wide, self.trained, strict=True) if t]
      full, reduce = jax.vjp(gathered, parts)
      (sums,) = reduce([s.astype(f.dtype) for s, f in zip(sums, full, strict=True)])
    grads = iter(
      _with(a, s.astype(_differentiable(a).dtype), cotangent=True)
      for a, s in zip(trained, sums, strict=True)
    )
    return jax.tree.unflatten(self.treedef, [next(grads) if t else None for t in self.trained])


def received(tree: Any, reduce: str | None) -> Any:
  """``tree`` as the user's function receives it: opened, if reduced once per step."""
  params = Params(tree, reduce, lambda a: a)
  return params.join(params.diff, params.fixed)


def _trained(leaf: Any) -> bool:
  return is_shard(leaf) or jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)


def _differentiable(leaf: Any) -> jax.Array:
  """What a parameter's gradient is taken with respect to: stage 2's sink, stage 3's value."""
  if is_shard(leaf):
    return leaf.value if leaf.sink is None else leaf.sink
  return leaf


def _with(leaf: Any, diff: Any, cotangent: bool = False) -> Any:
  """``leaf`` with its differentiable part ``diff`` (for a cotangent, the other part ``None``)."""
  if not is_shard(leaf):
    return diff
  if leaf.sink is None:
    return dataclasses.replace(leaf, value=diff)
  return dataclasses.replace(leaf, value=None if cotangent else leaf.value, sink=diff)


def _reducing(leaf: Any) -> Any:
  """A stage-3 shard of ``leaf``'s differentiable part, in the reduce dtype, to reduce with.

  The transpose of its gather is the reduce-scatter ``leaf``'s gradient takes
  at its stage (stage 2's into the sink is the same reduction).
  """
  if not is_shard(leaf):
    return leaf
  reduce = jnp.dtype(leaf.reduce_dtype or leaf.compute_dtype or leaf.value.dtype)
  part = _differentiable(leaf).astype(reduce)
  return dataclasses.replace(leaf, value=part, sink=None, compute_dtype=reduce)


@jax.tree_util.register_pytree_node_class
class Residuals:
  """A micro-batch's VJP as arrays to store, without the arrays every micro-batch shares.

  ``jax.vjp`` keeps its inputs (the stage's weights) among the residuals as
  the very same arrays; those are found by identity and put back when the
  pullback is rebuilt, rather than stored once per micro-batch.
  """

  def __init__(self, stored, treedef, where):
    self.stored, self.treedef, self.where = stored, treedef, where

  @classmethod
  def of(cls, pullback: Callable, known: list[Any]) -> Residuals:
    leaves, treedef = jax.tree.flatten(pullback)
    where = tuple(next((k for k, a in enumerate(known) if leaf is a), -1) for leaf in leaves)
    stored = [leaf for leaf, k in zip(leaves, where, strict=True) if k < 0]
    return cls(stored, treedef, where)

  def pullback(self, known: list[Any]) -> Callable:
    """The VJP again, the shared arrays put back where it kept them."""
    kept = iter(self.stored)
    return jax.tree.unflatten(
      self.treedef, [known[k] if k >= 0 else next(kept) for k in self.where]
    )

  def tree_flatten(self):
    return (self.stored,), (self.treedef, self.where)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)


def _known(stage: Stage, consts, k) -> list[Any]:
  """The arrays every micro-batch shares, which a VJP may keep: found by identity, not stored.

  Chunk ``k`` of the weights (interleaved) counts: it is cut again, the same,
  when the pullback is rebuilt.
  """
  chunk = stage.chunk_of((consts["wd"], consts["wf"]), k)
  shared = [consts[name] for name in ("wd", "wf", "ld", "lf", "cd", "cf", "lcd", "lcf")]
  return jax.tree.leaves((*shared, chunk))


class Parts(NamedTuple):
  """Which leaves of the activations are differentiated: the inexact ones.

  Integer leaves (random keys, positions, masks carried from stage to stage)
  move with the activations but take no cotangent.
  """

  treedef: Any
  inexact: tuple[bool, ...]

  @classmethod
  def of(cls, tree: Any) -> Parts:
    leaves, treedef = jax.tree.flatten(tree)
    return cls(treedef, tuple(_inexact(leaf) for leaf in leaves))

  def diff(self, tree: Any) -> list[Any]:
    """The inexact leaves of ``tree`` (a tree of the activations' form), in order."""
    leaves = self.treedef.flatten_up_to(tree)
    return [leaf for leaf, d in zip(leaves, self.inexact, strict=True) if d]

  def join(self, diff: list[Any], tree: Any) -> Any:
    """``tree`` with its inexact leaves replaced by ``diff``."""
    parts = iter(diff)
    leaves = self.treedef.flatten_up_to(tree)
    return self.treedef.unflatten(
      [next(parts) if d else leaf for leaf, d in zip(leaves, self.inexact, strict=True)]
    )

  def cotangent(self, diff: list[Any]) -> Any:
    """The cotangent of a tree of the activations' form: ``diff``, ``None`` for the rest."""
    parts = iter(diff)
    return self.treedef.unflatten([next(parts) if d else None for d in self.inexact])


def _inexact(x: Any) -> bool:
  dtype = getattr(x, "dtype", None)
  return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def _forward(stage: Stage, consts, h, m, k) -> tuple[Any, Residuals]:
  """Micro-batch ``m`` through chunk ``k`` of the stage: its output and its VJP.

  The VJP is of the chunk's weights, the inexact leaves of the activations and
  the float values ``stage_fn`` closes over.
  """
  wd, wf = stage.chunk_of((consts["wd"], consts["wf"]), k)
  parts = stage.parts

  def apply(diff, hd, cd):
    closed = stage.closed.join(cd, consts["cf"])
    out = stage.call(closed, stage.weights.join(diff, wf), parts.join(hd, h), m, k)
    return parts.diff(out), out

  _, pullback, h_out = jax.vjp(apply, wd, parts.diff(h), consts["cd"], has_aux=True)
  return h_out, Residuals.of(pullback, _known(stage, consts, k))


class Form(NamedTuple):
  """The types of a stage's output and of its VJP's stored residuals, and the VJP's form."""

  output: Any
  stored: tuple[Any, ...]
  treedef: Any
  where: tuple[int, ...]

  @classmethod
  def of(cls, stage: Stage, consts) -> Form:
    """Traced once, abstractly, on the first micro-batch."""
    found = []

    def trace(consts):
      h = jax.tree.map(lambda x: x[0], consts["xs"])
      h_out, residuals = _forward(stage, consts, h, 0, 0)
      found.append((residuals.treedef, residuals.where))
      return h_out, residuals.stored

    output, stored = jax.eval_shape(trace, consts)
    check_output(output, jax.tree.map(lambda x: x[0], consts["xs"]))
    return cls(output, tuple(stored), *found[0])

  def forward(self, stage: Stage, consts, h, slot: Slot) -> tuple[Any, list[jax.Array]]:
    h_out, residuals = _forward(stage, consts, h, slot.m, slot.chunk)
    assert residuals.where == self.where, "a stage's VJP changed form between two traces"
    return h_out, residuals.stored

  def pullback(self, stage: Stage, consts, stored: list[jax.Array], k) -> Callable:
    return Residuals(stored, self.treedef, self.where).pullback(_known(stage, consts, k))


def check_output(output: Any, h: Any) -> None:
  """Raises unless ``stage_fn`` returned activations like those it received."""
  want = jax.tree.map(lambda a: (tuple(a.shape), str(a.dtype)), h)
  got = jax.tree.map(lambda a: (tuple(a.shape), str(a.dtype)), output)
  if jax.tree.structure(want) != jax.tree.structure(got) or want != got:
    pair = isinstance(output, tuple) and len(output) == 2 and _shapes(output[0]) == _shapes(h)
    raise ValueError(
      f"stage_fn returned {_shapes(output)} for a micro-batch of {_shapes(h)}: a stage's "
      "output is the next stage's input, so it must have the same shapes and dtypes. "
      + (
        "Return the activations alone: (carry, y) is a scan body's form, and a stage that "
        "runs zerojax.scan returns its carry, zerojax.scan(layer, h, layers)[0]."
        if pair
        else "Keep the activations' shape through every stage (a projection that changes it "
        "belongs before the pipeline or in loss_fn)."
      )
    )


def _shapes(tree: Any) -> str:
  """``float32[4, 16]`` for an array; a tuple's or list's entries in parentheses; else leaves."""
  if isinstance(tree, tuple | list):
    return "(" + ", ".join(map(_shapes, tree)) + ")"
  if tree is None:
    return "None"
  if hasattr(tree, "shape") and hasattr(tree, "dtype"):
    return f"{np.dtype(tree.dtype)}{list(tree.shape)}"
  return ", ".join(_shapes(leaf) for leaf in jax.tree.leaves(tree))


def _at(tree: Any, index: Any) -> Any:
  """Entry ``index`` of the leading axis of every leaf (a dynamic slice, not a gather)."""
  return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index, keepdims=False), tree)


def _masked(active: jax.Array, buffers: Any, values: Any, index: Any) -> Any:
  """``buffers`` with ``values`` written at ``index`` of their leading axes if ``active``."""

  def write(buffer, value):
    value = jnp.where(active, value.astype(buffer.dtype), _at(buffer, index))
    return jax.lax.dynamic_update_index_in_dim(buffer, value, index, 0)

  return jax.tree.map(write, buffers, values)


def _added(active: jax.Array, sums: list[Any], grads: list[Any]) -> list[Any]:
  add = lambda s, g: s + jnp.where(active, g.astype(s.dtype), jnp.zeros_like(s))
  return [add(s, g) for s, g in zip(sums, grads, strict=True)]


class Slot(NamedTuple):
  """What a stage runs in one slot of a tick (traced: read from the timetable)."""

  m: jax.Array  #: the micro-batch, -1 for none (the bubble)
  chunk: jax.Array  #: which chunk of the stage's layers (interleaved; else 0)
  entry: jax.Array  #: where the micro-batch's saved activations live (``Timetable.ring``)

  @property
  def active(self) -> jax.Array:
    return self.m >= 0

  def valid(self) -> Slot:
    """The slot with micro-batch 0 in place of none: a bubble computes on stale inputs."""
    return self._replace(m=jnp.maximum(self.m, 0))


def _ticks(stage: Stage, table: Timetable, consts, state, forward_slot, backward_slot):
  """Runs ``table``'s phases: each tick, the slots the phase needs, then the hand-offs."""
  ring_f, ring_b, _ = table.ring()
  tables = [
    [jnp.asarray(a) for a in (table.forward, table.chunk(False), ring_f)],
    [jnp.asarray(a) for a in (table.backward, table.chunk(True), ring_b)],
  ]
  slot = lambda kind, t: Slot(*(a[t, stage.index] for a in tables[kind]))

  def tick(phase, state, t):
    if phase.forward:
      with jax.named_scope(FORWARD_SLOT):
        state = forward_slot(state, consts, slot(0, t))
      state["act"] = stage.shift(state["sent_act"], 1)
    if phase.backward:
      with jax.named_scope(BACKWARD_SLOT):
        state = backward_slot(state, consts, slot(1, t))
      state["cot"] = stage.shift(state["sent_cot"], -1)
    return state, None

  for phase in table.phases():
    if (phase.forward and forward_slot) or (phase.backward and backward_slot):
      body = lambda state, t, phase=phase: tick(phase, state, t)
      state = jax.lax.scan(body, state, jnp.arange(phase.start, phase.stop))[0]
  return state


def _input(stage: Stage, state, consts, slot: Slot):
  """The slot's input: ``x``'s on the first (virtual) stage, the activations received elsewhere."""
  first = stage.first_chunk(slot.chunk)
  return jax.tree.map(lambda x, a: jnp.where(first, x, a), _at(consts["xs"], slot.m), state["act"])


def fused_program(config: Config, weights, loss_params, x, targets, key, closed):
  """The whole step on one stage: ``(loss, (weights', loss_params', x's, closed's gradients))``.

  The last stage computes each micro-batch's loss, and its gradient, in the
  micro-batch's forward slot; backward slots then run as the schedule says.
  ``x``'s gradients are those of its inexact leaves, in order; ``closed`` is
  what ``stage_fn`` and ``loss_fn`` close over (``None`` for what is not
  differentiated).
  """
  stage = Stage(config, weights, loss_params, key, closed)
  table = config.timetable(backward=True)
  slots = table.in_flight
  loss_fn = config.loss_fn
  assert loss_fn is not None, "the fused program computes the loss in the last stage"
  consts = stage.consts(x, targets)
  form = Form.of(stage, consts)
  parts = stage.parts
  state = {
    "act": jax.tree.map(stage.zeros, form.output),
    "cot": [stage.zeros(h) for h in parts.diff(form.output)],
    "stored": [stage.zeros(r, lead=slots) for r in form.stored],
    "dys": [stage.zeros(h, lead=slots) for h in parts.diff(form.output)],
    "losses": stage.zeros(jax.ShapeDtypeStruct((config.microbatches,), jnp.float32)),
    "dxs": [stage.zeros(x) for x in parts.diff(consts["xs"])],
    "gw": stage.weights.accumulators(stage.zeros),
    "gl": stage.loss_params.accumulators(stage.zeros),
    "gc": stage.closed.accumulators(stage.zeros),
    "glc": stage.loss_closed.accumulators(stage.zeros),
  }
  state["sent_act"], state["sent_cot"] = state["act"], state["cot"]

  def forward_slot(state, consts, slot):
    state, active, slot = dict(state), slot.active, slot.valid()
    m = slot.m
    h_out, stored = form.forward(stage, consts, _input(stage, state, consts, slot), slot)
    state["sent_act"] = h_out
    state["stored"] = _masked(active, state["stored"], stored, slot.entry)
    targets = _at(consts["ts"], m)

    def head(diff, hd, cd):  # this micro-batch's share of the mean over micro-batches
      h = parts.join(hd, h_out)
      closed = stage.loss_closed.join(cd, consts["lcf"])
      loss = loss_fn(closed, stage.loss_params.join(diff, consts["lf"]), h, *targets)
      return loss / config.microbatches, loss

    (_, loss), (dl, dh, dc) = jax.value_and_grad(head, argnums=(0, 1, 2), has_aux=True)(
      consts["ld"], parts.diff(h_out), consts["lcd"]
    )
    # Every stage computes the loss; the last (virtual) stage's counts.
    mine = active & stage.last_chunk(slot.chunk)
    state["losses"] = _masked(mine, state["losses"], loss.astype(jnp.float32), m)
    state["dys"] = _masked(mine, state["dys"], dh, slot.entry)
    state["gl"] = _added(mine, state["gl"], dl)
    state["glc"] = _added(mine, state["glc"], dc)
    return state

  backward_slot = _backward_slot(
    stage, form, lambda state, slot: _at((state["stored"], state["dys"]), slot.entry)
  )
  state = _ticks(stage, table, consts, state, forward_slot, backward_slot)
  loss = stage.only(stage.last, jnp.mean(state["losses"]))
  gl = stage.only(stage.last, stage.loss_params.finish(state["gl"]))
  closed = (
    stage.summed(stage.closed.finish(state["gc"])),
    stage.only(stage.last, stage.loss_closed.finish(state["glc"])),
  )
  gw, dx = _gradients(stage, state)
  return loss, (gw, gl, dx, closed)


def forward_program(config: Config, found: list[Any], weights, x, key, closed):
  """GPipe's first half: ``(last stage's output, stored residuals)``; their form to ``found``."""
  stage = Stage(config, weights, key=key, closed=closed)
  slots = config.microbatches
  consts = stage.consts(x)
  form = Form.of(stage, consts)
  state = {
    "act": jax.tree.map(stage.zeros, form.output),
    "stored": [stage.zeros(r, lead=slots) for r in form.stored],
    "ys": jax.tree.map(lambda h: stage.zeros(h, lead=slots), form.output),
  }
  state["sent_act"] = state["act"]

  def forward_slot(state, consts, slot):
    state, active, slot = dict(state), slot.active, slot.valid()
    h_out, stored = form.forward(stage, consts, _input(stage, state, consts, slot), slot)
    state["sent_act"] = h_out
    state["stored"] = _masked(active, state["stored"], stored, slot.m)
    state["ys"] = _masked(active, state["ys"], h_out, slot.m)
    return state

  state = _ticks(stage, config.timetable(backward=False), consts, state, forward_slot, None)
  found.append((form.treedef, form.where))
  y = stage.only(stage.last, stage.merge(state["ys"]))
  return y, [r[None] for r in state["stored"]]


def backward_program(config: Config, treedef, where, stored, weights, x, dy, closed):
  """GPipe's second half: ``(weights', x's, closed's gradients)`` from the stored residuals.

  ``dy`` and ``x``'s gradient are those of the inexact leaves, in order.
  """
  stage = Stage(config, weights, closed=closed)
  full = config.timetable(backward=True)
  turn = config.microbatches + config.stages - 2  # the tick of the last forward pass
  table = Timetable(np.full_like(full.forward[turn:], -1), full.backward[turn:])
  consts = stage.consts(x)
  form = Form(None, (), treedef, where)
  dys = stage.split(dy)
  state = {
    "cot": [stage.zeros(d[0]) for d in dys],
    "stored": [stage.own(r[0]) for r in stored],
    "dxs": [stage.zeros(x) for x in stage.parts.diff(consts["xs"])],
    "gw": stage.weights.accumulators(stage.zeros),
    "gc": stage.closed.accumulators(stage.zeros),
  }
  state["sent_cot"] = state["cot"]

  backward_slot = _backward_slot(
    stage, form, lambda state, slot: _at((state["stored"], dys), slot.m)
  )
  state = _ticks(stage, table, consts, state, None, backward_slot)
  gw, dx = _gradients(stage, state)
  return gw, dx, (stage.summed(stage.closed.finish(state["gc"])), [])


def _backward_slot(stage: Stage, form: Form, saved: Callable[..., Any]) -> Callable[..., Any]:
  """A backward slot: micro-batch ``m``'s pullback applied to its output's cotangent.

  ``saved(state, slot)`` gives the micro-batch's stored residuals and the
  loss's cotangent of its output, which the last (virtual) stage uses; the
  others use the cotangent the next one sent.
  """

  def backward_slot(state, consts, slot):
    state, active, slot = dict(state), slot.active, slot.valid()
    stored, dys = saved(state, slot)
    last = stage.last_chunk(slot.chunk)
    cotangent = [jnp.where(last, d, c) for d, c in zip(dys, state["cot"], strict=True)]
    dw, dh, dc = form.pullback(stage, consts, stored, slot.chunk)(cotangent)
    state["gw"] = stage.added(active, state["gw"], dw, slot.chunk)
    state["gc"] = _added(active, state["gc"], dc)
    state["dxs"] = _masked(active & (slot.chunk == 0), state["dxs"], dh, slot.m)
    state["sent_cot"] = dh
    return state

  return backward_slot


def _gradients(stage: Stage, state) -> tuple[Any, Any]:
  """The stage's weights' gradient (with its stage axis) and ``x``'s, from the summed slots."""
  gw = jax.tree.map(lambda g: g[None], stage.weights.finish(state["gw"]))
  return gw, stage.only(stage.first, stage.merge(state["dxs"]))
