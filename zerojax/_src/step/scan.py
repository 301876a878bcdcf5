"""``zerojax.scan``: a layer stack whose gathers run one layer ahead of the compute.

In a plain ``jax.lax.scan`` over stacked stage-3 shards, each iteration
all-gathers its layer and then computes with it, so on an accelerator the
compute waits for the network once per layer, forward and backward. Here the
loop is rewritten so that it need not:

* forward: layer 0 is gathered before the loop; iteration i issues the
  all-gather of layer i+1, then computes layer i with the weights the previous
  iteration gathered (carried in the loop state);
* backward: a reversed loop, built by a ``jax.custom_vjp``, computes layer i's
  VJP with weights gathered one iteration earlier, while it gathers layer
  i-1, and reduce-scatters layer i's gradient (or, with ``defer_reductions``,
  the gradient of layer i+1, which the previous iteration produced). The last
  layer's weights are kept from the forward pass, so the backward pass starts
  without a gather. Under hpZ (``secondary_axis``) the forward loop also keeps
  each layer's secondary partition (``comm/hierarchical.py``), and the backward loop gathers
  layer i-1 from it, inside the node.

Each layer's VJP reuses what the forward pass saved under the layer's
``jax.checkpoint`` policy (never the gathered weights, which are re-gathered),
so the arithmetic is the one a ``jax.checkpoint``-ed scan does. The first and
last iterations of each loop are peeled, so that no iteration gathers a layer
it does not use. At stage 2 the weights are read, not gathered, and only the
reductions apply.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from zerojax._src.comm import opening as opening_lib
from zerojax._src.comm import primitives as comm
from zerojax._src.comm import shards as shards_lib
from zerojax._src.comm.group import Group
from zerojax._src.step import remat


def scan(
  f: Callable[[Any, Any], tuple[Any, Any]],
  init: Any,
  xs: Any = None,
  length: int | None = None,
  *,
  prefetch: int = 1,
  policy: Callable[..., bool] | str | None = None,
  defer_reductions: bool | None = None,
) -> tuple[Any, Any]:
  """``jax.lax.scan`` over a layer stack whose parameter shards ``f`` receives gathered.

  ``xs`` may hold stacked parameter shards (``zerojax.Shard`` s with a
  leading layer axis, as ``zerojax.value_and_grad`` passes them to the loss)
  next to other per-layer inputs. Inside ``f`` those leaves arrive as full
  arrays, so ``f`` needs no ``zerojax.gather``; a layer's shards travel in one
  all-gather, and their gradients in one reduce-scatter.

  With ``prefetch=1`` layer i+1's all-gather is issued before layer i's compute,
  in the forward pass and, in reverse, in the backward pass: on GPUs and TPUs
  the gathers then overlap the compute, and at most two layers' gathered
  weights are alive at once. Each layer's gradient is reduce-scattered as the
  backward pass makes it; with ``defer_reductions=True``, one iteration later,
  while the next layer's backward runs, at the price of one more layer's
  gradient alive. By default, on GPUs, reductions are deferred where XLA:GPU
  does not pipeline them into the next iteration by itself: quantized
  gradients (qgZ's all-to-alls) and reductions across nodes (several data
  axes of more than one device each). Compiled for 2 to 16 nodes of 8 H100,
  that takes hpZ + qwZ + qgZ from 0.64-0.68x GSPMD FSDP's step in XLA's
  estimate to 0.51-0.58x (docs/scaling.md). On one data axis it pays only
  where XLA may run two collectives at once
  (``--xla_gpu_experimental_parallel_collective_overlap_limit=2``: 0.70x GSPMD
  FSDP's step, against 0.80x without it; docs/performance.md), and on TPUs,
  where XLA prints no estimate, it cost 2-3 layers of temporaries: there it
  is off unless asked for. ``prefetch=0`` gathers each layer in its own iteration,
  under ``jax.checkpoint``. All give the same numbers, to rounding (XLA fuses
  the programs differently).

  What the backward pass reads from the forward pass is the layer's own
  choice: each value is kept if the policy of the innermost ``jax.checkpoint``
  around it in ``f`` (``jax.remat``, ``nn.remat``, ``nnx.remat``) keeps it,
  offloaded if that policy offloads it (``save_and_offload_only_these_names``),
  and for values under no checkpoint of ``f``'s, as ``policy`` says: by
  default only the layer's inputs are saved and the whole layer is recomputed
  (what the backward pass of a big model must do to fit);
  ``jax.checkpoint_policies.dots_saveable`` saves matmul outputs (the rest is
  recomputed), ``everything_saveable`` every value (none recomputed).
  Whatever the policies, the gathered weights are never saved, nor anything
  computed from them and what every layer shares alone (a cast or a transpose
  of a weight, a causal mask):
  the backward pass gathers the layer again, so a layer's weights are whole on
  a device only while it computes. ``f`` may close over values of the
  enclosing function (a causal mask, rotary tables, a key): every layer reads
  the same copy.

  Outside ``zerojax.value_and_grad`` (on full arrays, for evaluation) and at
  stage 1 (no shards) it is ``jax.lax.scan`` of the layer checkpointed the
  same way.

  Args:
    f: ``f(carry, x) -> (carry, y)``, as for ``jax.lax.scan``; ``x`` holds
      one layer of ``xs``, its shards gathered.
    init: the initial carry (no shards).
    xs: the per-layer inputs, each leaf with a leading axis of ``length``.
    length: the number of layers, if ``xs`` has no leaves.
    prefetch: 1 to gather one layer ahead, 0 not to.
    policy: a ``jax.checkpoint`` policy (``jax.checkpoint_policies``) naming
      the values the backward pass reads from the forward pass, or the name
      of one (``"dots_saveable"``), for the values of ``f`` under no
      ``jax.checkpoint`` of its own. ``None`` (the default) saves none of
      them, only the layer's inputs: the backward pass computes the layer
      again, which big models need to fit (``"everything_saveable"`` saves
      every one but the weights, as ``jax.lax.scan`` of ``f`` would). Refused
      for an ``f`` wholly under its own checkpoint, which it would not
      change.
    defer_reductions: with ``prefetch=1``, reduce-scatter each layer's
      gradient one iteration late; ``None`` (the default) does so on GPUs
      for quantized gradients or reductions across nodes, and with
      ``prefetch=0`` never.

  Returns:
    ``(carry, ys)``, as ``jax.lax.scan`` returns them.

  Example:
    >>> import jax, jax.numpy as jnp, optax, zerojax
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = zerojax.zero3(optax.sgd(0.1), mesh=mesh)
    >>> params = tx.shard({"layers": jnp.full((4, 64, 64), 0.01)})
    >>> def loss_fn(params, x):
    ...   layer = lambda h, w: (jnp.tanh(h @ w), None)
    ...   h, _ = zerojax.scan(layer, x, params["layers"])
    ...   return jnp.mean(h)
    >>> loss, grads = zerojax.value_and_grad(loss_fn, tx)(params, jnp.ones((8, 64)))
    >>> grads["layers"].shape, grads["layers"].sharding.spec
    ((4, 64, 64), P(None, 'data'))
  """
  policy = shards_lib.named_policy(policy)
  if prefetch not in (0, 1):
    raise ValueError(
      f"prefetch is how many layers ahead to gather: 0 or 1 (two layers alive at once), "
      f"got {prefetch!r}."
    )
  if defer_reductions and prefetch == 0:
    raise ValueError(
      "defer_reductions=True reduce-scatters each layer's gradient in the next iteration of the "
      "prefetching backward loop; prefetch=0 has none (each gather's own derivative reduces): "
      "pass prefetch=1, or drop defer_reductions."
    )
  if any(isinstance(x, shards_lib.Shard) for x in _leaves(init)):
    raise ValueError(
      "zerojax.scan's init holds a zerojax.Shard: only xs may hold parameter shards (a layer's "
      "own, stacked); gather a shared parameter with zerojax.gather before the scan."
    )
  f = _checked(f)
  leaves, treedef = jax.tree.flatten(xs, is_leaf=_is_shard)
  shards = [i for i, leaf in enumerate(leaves) if _is_shard(leaf)]
  if not shards:
    return jax.lax.scan(remat.checkpoint(f, policy), init, xs, length)
  _check_layer_axis([leaves[i] for i in shards])
  if prefetch == 0:
    body = remat.checkpoint(lambda carry, x: f(carry, shards_lib.gather(x)), policy)
    return jax.lax.scan(body, init, xs, length)
  return _prefetched(f, init, leaves, treedef, shards, policy, defer_reductions)


def _is_shard(x: Any) -> bool:
  return isinstance(x, shards_lib.Shard)


def _leaves(tree: Any) -> list[Any]:
  return jax.tree.leaves(tree, is_leaf=_is_shard)


class _Stack(NamedTuple):
  """The static facts of one layer stack (hashable, for the custom VJP).

  Attributes:
    group: one layer's shards, opened and reduced together.
    reads: stage 2: the weights are read whole, their gradients go to sinks.
    treedef: the structure of ``xs``, ``Shard`` s as leaves.
    shards: the positions of the shards among ``xs``' leaves.
    length: the number of layers.
    policy: zerojax's ``jax.checkpoint`` policy for one layer's values that
      are under no checkpoint of the user's (``remat.checkpoint``).
    defer: reduce-scatter each layer's gradient one iteration late, while the
      next layer's backward runs, rather than in its own iteration.
  """

  group: Group
  reads: bool
  treedef: Any
  shards: tuple[int, ...]
  length: int
  policy: Callable[..., Any] | None
  defer: bool

  @property
  def opening(self) -> opening_lib.Opening:
    return opening_lib.of(self.group, self.reads)

  def kept(self, values: list[jax.Array]) -> list[jax.Array]:
    """What the forward pass keeps of one layer (hpZ's secondary partitions); else none."""
    return self.opening.kept(self.group, values)

  def opened(
    self, values: list[jax.Array], sinks: list[jax.Array], kept: list[jax.Array]
  ) -> list[jax.Array]:
    """One layer's full weights, the ``Opening``'s way; no derivative rule."""
    del sinks
    return self.opening.opened(self.group, values, kept)

  def reduced(self, cotangents: list[jax.Array]) -> list[jax.Array]:
    """One layer's gradient shards (for the values at stage 3, the sinks at stage 2)."""
    return self.opening.reduced(self.group, cotangents)

  def x(self, weights: list[jax.Array], others: list[Any]) -> Any:
    """One layer's ``x`` for ``f``: the weights where the shards were, the rest as given."""
    opened, rest = iter(weights), iter(others)
    leaves = [next(opened) if i in self.shards else next(rest) for i in range(self.size)]
    return jax.tree.unflatten(self.treedef, leaves)

  def stored_dtypes(self, grads: list[Any]) -> list[Any]:
    """The dtype each stacked gradient is kept in while the backward loop fills it.

    The dtype its reduction returns where that is narrower than the gradient's
    own (``grads``): unquantized reductions return the reduce dtype, so a
    bfloat16 one round-trips through the gradient's float32 exactly; quantized
    ones sum in float32 and keep ``grads``.
    """
    if self.group.gradients is not None:
      return list(grads)
    return [
      transfer.reduce if jnp.dtype(transfer.reduce).itemsize < jnp.dtype(grad).itemsize else grad
      for transfer, grad in zip(self.group.transfers, grads, strict=True)
    ]

  @property
  def size(self) -> int:
    return self.treedef.num_leaves


def _check_layer_axis(shards: list[shards_lib.Shard]) -> None:
  """Raises if a layout splits a stacked shard's layer axis, which a scan must see whole."""
  for shard in shards:
    if shard.value.ndim + shard.dim == 0:
      raise ValueError(
        f"zerojax.scan got a stacked parameter of shape {shard.value.shape} (this device's "
        f"shard) whose leading (layer) axis is split over the data axes {shard.axis_name!r}, "
        "so no device holds every layer: shard another dimension (a layout= override such "
        "as P(None, 'data') for a stacked leaf, or None for the default rule, which never "
        "splits the layer axis)."
      )


def _checked(f: Callable[[Any, Any], tuple[Any, Any]]) -> Callable[[Any, Any], tuple[Any, Any]]:
  """``f``, raising a clear error unless it returns ``(carry, y)`` with the carry it was given."""

  @functools.wraps(f)
  def checked(carry, x):
    out = f(carry, x)
    if not (isinstance(out, tuple | list) and len(out) == 2):
      kind = f"a {type(out).__name__}" + (f" of {len(out)}" if isinstance(out, tuple) else "")
      raise ValueError(
        f"zerojax.scan's f must return a pair (carry, y), as jax.lax.scan's does; it returned "
        f"{kind}. Return (new_carry, None) for a layer with no per-layer output."
      )
    _check_carry(carry, out[0])
    return tuple(out)

  return checked


def _check_carry(given: Any, returned: Any) -> None:
  """Raises if a layer returns a carry of another structure, shape or dtype than it was given."""
  if jax.tree.structure(given) != jax.tree.structure(returned):
    raise ValueError(
      f"zerojax.scan's f returned a carry of structure {jax.tree.structure(returned)}, but was "
      f"given one of structure {jax.tree.structure(given)}: a layer must return its carry in "
      "the form it received it, as for jax.lax.scan."
    )
  paths = jax.tree_util.tree_flatten_with_path(given)[0]
  for (path, a), b in zip(paths, jax.tree.leaves(returned), strict=True):
    before, after = (jax.ShapeDtypeStruct(jnp.shape(v), jnp.result_type(v)) for v in (a, b))
    if (before.shape, before.dtype) != (after.shape, after.dtype):
      promoted = jnp.issubdtype(after.dtype, jnp.floating) and after.dtype != before.dtype
      raise ValueError(
        f"zerojax.scan's f returned the carry{jax.tree_util.keystr(path)} as "
        f"{after.dtype}{list(after.shape)}, but was given it as "
        f"{before.dtype}{list(before.shape)}: a layer must return its carry with the shape and "
        "dtype it received, as for jax.lax.scan."
        + (
          f" Something in the layer promoted {before.dtype} to {after.dtype}: a NumPy scalar "
          "(np.sqrt(d) is a float64, which JAX takes as float32) or a float32 array; use a "
          "Python float (math.sqrt(d)), or cast the result back with .astype(h.dtype)."
          if promoted
          else ""
        )
      )


def _prefetched(f, init, leaves, treedef, shard_positions, policy, defer_reductions):
  shards = [leaves[i] for i in shard_positions]
  others = [x for i, x in enumerate(leaves) if i not in shard_positions]
  length = shards[0].value.shape[0]
  for x in [*(s.value for s in shards), *others]:
    if jnp.shape(x)[:1] != (length,):
      raise ValueError(
        f"zerojax.scan's xs must all have the same leading (layer) axis; found {length} and "
        f"{jnp.shape(x)[:1]}."
      )
  first = [_layer_shard(s) for s in shards]
  stack = _Stack(
    shards_lib.group_of(first),
    first[0].sink is not None,
    treedef,
    tuple(shard_positions),
    length,
    policy,
    _defers(first[0]) if defer_reductions is None else defer_reductions,
  )
  values = [s.value for s in shards]
  sinks = [s.sink for s in shards] if stack.reads else []
  # Example arguments of the right types for tracing ``f`` (shapes, dtypes and
  # varying axes); unused, so the compiler drops the gather that makes them.
  weights = stack.opened(_at(values, 0), _at(sinks, 0), stack.kept(_at(values, 0)))
  x0 = stack.x(weights, _at(others, 0))
  traced = remat.trace(f, init, x0)
  return _layers(traced.function, stack, list(traced.consts), init, values, sinks, others)


def _defers(shard: shards_lib.Shard) -> bool:
  """``defer_reductions``' default: on GPUs, where XLA:GPU does not pipeline a reduction itself.

  Quantized (qgZ's all-to-alls) or across nodes: there a deferred reduction
  overlaps the next layer's backward pass (docs/scaling.md).
  """
  rounds = shard.quantized_gradients is not None or comm.spans_nodes(shard.axis_name)
  return comm.on_gpu() and rounds


def _layer_shard(shard: shards_lib.Shard) -> shards_lib.Shard:
  """The ``Shard`` of one layer of a stacked shard (the static facts kept)."""
  sink = None if shard.sink is None else shard.sink[0]
  return dataclasses.replace(shard, value=shard.value[0], sink=sink)


def _at(arrays: list[Any], index: Any) -> list[Any]:
  """Layer ``index`` of each stacked array (a static or a traced index)."""
  return [jax.lax.dynamic_index_in_dim(a, index, keepdims=False) for a in arrays]


@jax.tree_util.register_pytree_node_class
class _Pullback:
  """A layer's VJP as residual arrays, without the values every layer shares.

  Those are the gathered weights (re-gathered in the backward pass) and the
  values the layer closes over (a mask, rotary tables: one copy serves every
  layer). They are the ones the layer was called with: ``jax.checkpoint``
  keeps its inputs as residuals themselves, so they are found by identity.
  """

  def __init__(self, residuals, treedef, input_of):
    self.residuals, self.treedef, self.input_of = residuals, treedef, input_of

  @classmethod
  def of(cls, pullback: Callable, inputs: list[Any]) -> _Pullback:
    leaves, treedef = jax.tree.flatten(pullback)
    # For each residual: the index of the input it is, or -1.
    input_of = tuple(next((k for k, x in enumerate(inputs) if leaf is x), -1) for leaf in leaves)
    kept = [leaf for leaf, k in zip(leaves, input_of, strict=True) if k < 0]
    return cls(kept, treedef, input_of)

  def with_inputs(self, inputs: list[Any]) -> Callable:
    """The VJP function again, the inputs put back where the forward pass had them."""
    kept = iter(self.residuals)
    leaves = [inputs[k] if k >= 0 else next(kept) for k in self.input_of]
    return jax.tree.unflatten(self.treedef, leaves)

  def tree_flatten(self):
    return (self.residuals,), (self.treedef, self.input_of)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)


def _layer(body, stack: _Stack, consts, carry, weights, others):
  return body(carry, stack.x(weights, others), *consts)


def _vjp_layer(body, stack, consts, carry, weights, others):
  """``((carry, y), pullback)`` of one layer, the pullback without the weights or the consts."""
  layer = functools.partial(_layer, body, stack)
  checkpointed = remat.checkpoint(layer, stack.policy, shared_argnums=(0, 2))
  out, pullback = jax.vjp(checkpointed, consts, carry, weights, others)
  return out, _Pullback.of(pullback, [*weights, *consts])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _layers(body, stack, consts, init, values, sinks, others):
  return _forward(body, stack, consts, init, values, sinks, others)[0]


def _forward(body, stack: _Stack, consts, init, values, sinks, others):
  """The prefetching forward loop: ``((carry, ys), residuals)``.

  Under hpZ the residuals hold the secondary partitions of every layer but the
  last (whose weights are kept whole), for the backward loop to gather from.
  """
  last = stack.length - 1
  kept = stack.kept(_at(values, 0))
  weights = stack.opened(_at(values, 0), _at(sinks, 0), kept)

  def step(state, i):
    carry, weights, kept = state
    upcoming_kept = stack.kept(_at(values, i + 1))  # before the compute
    upcoming = stack.opened(_at(values, i + 1), _at(sinks, i + 1), upcoming_kept)
    (carry, y), pullback = _vjp_layer(body, stack, consts, carry, weights, _at(others, i))
    return (carry, upcoming, upcoming_kept), (y, pullback, kept)

  state = (init, weights, kept)
  (carry, weights, _), (ys, pullbacks, kept) = jax.lax.scan(step, state, jnp.arange(last))
  (carry, y), pullback = _vjp_layer(body, stack, consts, carry, weights, _at(others, last))
  ys = jax.tree.map(lambda stacked, y: jnp.concatenate([stacked, y[None]]), ys, y)
  return (carry, ys), (pullbacks, pullback, weights, kept, consts, values, sinks, others)


def _forward_rule(body, stack, consts, init, values, sinks, others):
  return _forward(body, stack, consts, init, values, sinks, others)


def _backward_rule(body, stack: _Stack, residuals, cotangents):
  """The reversed loop: layer i's VJP while layer i-1 is gathered and layer i+1 reduced."""
  pullbacks, pullback, weights, kept, consts, values, sinks, others = residuals
  dcarry, dys = cotangents
  last = stack.length - 1
  targets = sinks if stack.reads else values
  # The stacked gradients are kept, until the loop ends, in the dtype the reductions return
  # (a bfloat16 reduce dtype: half a float32 stack), and cast to the gradients' dtype after it,
  # as GSPMD FSDP keeps its bfloat16 ones. The cast widens, so the numbers are the same.
  kept_in = stack.stored_dtypes([jnp.result_type(t) for t in targets])
  grads = [_zeros_like(t, dtype) for t, dtype in zip(targets, kept_in, strict=True)]
  dothers = [_zeros_like(o) if _differentiable(o) else None for o in others]
  dconsts = [_zeros_like(c) if _differentiable(c) else None for c in consts]

  def layer_vjp(pullback, weights, i, dcarry, dconsts, dothers):
    vjp = pullback.with_inputs([*weights, *consts])
    dy = jax.tree.map(lambda d: jax.lax.dynamic_index_in_dim(d, i, keepdims=False), dys)
    dc, dcarry, dweights, dx = vjp((dcarry, dy))
    dconsts = [None if a is None else a + b for a, b in zip(dconsts, dc, strict=True)]
    dothers = [
      None if d is None else jax.lax.dynamic_update_index_in_dim(d, g, i, 0)
      for d, g in zip(dothers, dx, strict=True)
    ]
    return dcarry, dweights, dconsts, dothers

  def store(grads, dweights, i):
    """``grads`` with layer ``i``'s reduced gradient in (no-op for no gradient)."""
    if not dweights:
      return grads
    return [
      jax.lax.dynamic_update_index_in_dim(g, r.astype(g.dtype), i, 0)
      for g, r in zip(grads, stack.reduced(dweights), strict=True)
    ]

  def settle(grads, dweights, i):
    """``(grads, pending)``: layer ``i``'s gradient reduced now, or left for the next iteration."""
    return (grads, dweights) if stack.defer else (store(grads, dweights, i), [])

  # The last layer, with the weights the forward pass ended with.
  opened = lambda i: stack.opened(_at(values, i), _at(sinks, i), _at(kept, i))
  upcoming = opened(last - 1) if last else weights
  # Its recomputation, too, reads only what the forward pass kept: XLA may run it beside the
  # forward pass's last layer, two layers' attention scores at once, unless it waits for the
  # cotangent, as the layers in the loop do.
  pullback, dcarry = jax.lax.optimization_barrier((pullback, dcarry))
  dcarry, dweights, dconsts, dothers = layer_vjp(pullback, weights, last, dcarry, dconsts, dothers)
  grads, pending = settle(grads, dweights, last)

  def step(state, i):
    dcarry, weights, pending, dconsts, dothers, grads = state
    upcoming = opened(i - 1)  # before the compute

    grads = store(grads, pending, i + 1)  # layer i+1's gradient, one iteration late
    layer = jax.tree.map(lambda r: r[i], pullbacks)
    dcarry, dweights, dconsts, dothers = layer_vjp(layer, weights, i, dcarry, dconsts, dothers)
    grads, pending = settle(grads, dweights, i)
    return (dcarry, upcoming, pending, dconsts, dothers, grads), None

  if last:
    middle = jnp.arange(1, last)
    state = (dcarry, upcoming, pending, dconsts, dothers, grads)
    state, _ = jax.lax.scan(step, state, middle, reverse=True)
    dcarry, weights, pending, dconsts, dothers, grads = state
    grads = store(grads, pending, 1)
    # The first layer's recomputation reads only what its forward pass kept, so XLA may run it
    # before the loop and hold what it makes (a layer's attention scores) all through it; its
    # residuals tied to the loop's result, it runs after the loop, as the layers in the loop do.
    # The whole stack goes through the barrier, not layer 0's slice, which it would copy.
    pullbacks, dcarry = jax.lax.optimization_barrier((pullbacks, dcarry))
    first = jax.tree.map(lambda r: r[0], pullbacks)
    dcarry, pending, dconsts, dothers = layer_vjp(first, weights, 0, dcarry, dconsts, dothers)
  grads = store(grads, pending, 0)
  grads = [g.astype(jnp.result_type(t)) for g, t in zip(grads, targets, strict=True)]
  dvalues = [None] * len(values) if stack.reads else grads
  dsinks = grads if stack.reads else []
  return dconsts, dcarry, dvalues, dsinks, dothers


_layers.defvjp(_forward_rule, _backward_rule)


def _differentiable(x: Any) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _zeros_like(x: jax.Array, dtype: Any = None) -> jax.Array:
  """Zeros of ``x``'s shape, dtype (or ``dtype``) and varying mesh axes, for a loop to carry."""
  zeros = jnp.zeros(jnp.shape(x), dtype or jnp.result_type(x))
  varying = tuple(jax.typeof(x).manual_axis_type.varying)
  return jax.lax.pcast(zeros, varying, to="varying") if varying else zeros
