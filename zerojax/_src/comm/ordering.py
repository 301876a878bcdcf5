"""Loops that communicate, linked by data to every other collective, for XLA:CPU.

Inside ``jax.shard_map`` every collective is lowered with the same channel id,
and XLA:CPU uses the channel id as the key of the rendezvous where devices
meet: all reduce-scatters of a program share one rendezvous, all all-gathers
another. XLA:CPU orders a collective after a while loop that holds
collectives with a *scheduling* edge only, so the collective may start as
soon as the loop has been launched, before it has finished; its default
concurrency-optimized scheduler places collectives after loops precisely so
that they overlap. Devices that go ahead then join the loop's rendezvous for
another operation, and the process aborts ("Check failed: id < num_threads")
or waits until XLA's termination timeout. docs/troubleshooting.md has the
plain-JAX reproduction.

``link_loops`` removes the race at its root. It traces a function and
re-emits it with a data dependency wherever a loop that holds collectives
and another collective have no data path between them: XLA's runtime waits
for data dependencies to complete. A link reads one element and adds
``-0.0`` to the smallest input, so it changes no value and costs nothing measurable.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jex
import jax.extend.source_info_util as source_info_util
import jax.numpy as jnp

#: The primitives that make devices meet.
_COLLECTIVES = frozenset(
  {
    "all_gather",
    "all_gather_invariant",
    "all_to_all",
    "pmax",
    "pmin",
    "ppermute",
    "psum",
    "psum_invariant",
    "ragged_all_to_all",
    "reduce_scatter",
  }
)

#: The primitives XLA keeps as nested programs (while loops and conditionals).
_CONTROL_FLOW = frozenset({"cond", "scan", "while"})


def links_needed(mesh: jax.sharding.Mesh) -> bool:
  """Whether programs on ``mesh`` need ``link_loops`` (its devices are XLA:CPU's).

  GPU and TPU runtimes order collectives on their own, and there the extra
  links would only take freedom from XLA's latency-hiding scheduler.
  """
  return mesh.devices.flat[0].platform == "cpu"


def ordered(mesh: jax.sharding.Mesh, fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn`` as it must run on ``mesh``: ``link_loops(fn)`` on XLA:CPU, else ``fn`` itself.

  The one seam where zerojax's programs meet XLA:CPU's ordering race.
  """
  return link_loops(fn) if links_needed(mesh) else fn


def link_loops(fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn``, with every loop that communicates linked by data to every other collective.

  A collective after such a loop reads one element of the loop's output, and
  the loop reads one element of the output of every collective since the
  previous loop, so that no collective can run while a loop's collectives
  still do; collectives between two loops keep XLA's order, which is safe
  because each completes before the next starts. The body of a scan that
  holds such loops itself (the micro-batch loop around the layer loops) is
  linked the same way; inside a loop with no loop in it, the order is the
  compiler's.
  """

  @functools.wraps(fn)
  def linked(*args):
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    outs = _evaluate(closed.jaxpr, closed.consts, jax.tree.leaves(args))
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

  return linked


def _evaluate(jaxpr: jex.Jaxpr, consts: list[Any], args: list[Any]) -> list[Any]:
  """``jax.core.eval_jaxpr`` plus the links around loops that communicate.

  A link is added only where the program has no data path already: one
  through the values themselves costs nothing, and reading a collective's
  output later than the program would could keep a gathered weight alive.
  """
  env: dict[jex.Var, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))
  # For each value, the operations that communicate which it depends on.
  upstream: dict[jex.Var, frozenset[int]] = {}
  outputs: list[list[Any]] = []  # the outputs of each operation that communicates
  last_loop = None  # the index in ``outputs`` of the last loop that communicates
  since: list[int] = []  # the indices of the collectives since that loop
  read = lambda var: var.val if isinstance(var, jex.Literal) else env[var]
  for eqn in jaxpr.eqns:
    values = [read(var) for var in eqn.invars]
    depends = frozenset().union(
      *(upstream.get(v, frozenset()) for v in eqn.invars if not isinstance(v, jex.Literal))
    )
    communicates, loops = _communicates(eqn), _loops(eqn)
    if communicates:
      before = [last_loop, *since] if loops else [last_loop]
      missing = [outputs[k] for k in before if k is not None and k not in depends]
      values = _after(values, missing)
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    context = source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack)
    with context, eqn.ctx.manager:
      if eqn.primitive.name == "scan" and _holds(eqn.params["jaxpr"].jaxpr, _loops):
        outs = _linked_scan(eqn.params, values)
      else:
        outs = eqn.primitive.bind(*values, **eqn.primitive.get_bind_params(eqn.params))
    outs = outs if eqn.primitive.multiple_results else [outs]
    env.update(zip(eqn.outvars, outs, strict=True))
    if communicates:
      depends |= {len(outputs)}
      outputs.append(outs)
      if loops:
        last_loop, since = len(outputs) - 1, []
      else:
        since.append(len(outputs) - 1)
    upstream.update((var, depends) for var in eqn.outvars)
  return [read(var) for var in jaxpr.outvars]


def _linked_scan(params: dict[str, Any], values: list[Any]) -> list[Any]:
  """A scan equation re-emitted with its body linked by ``_evaluate``."""
  body, num_consts, num_carry = params["jaxpr"], params["num_consts"], params["num_carry"]
  consts, carry = values[:num_consts], values[num_consts : num_consts + num_carry]
  xs = values[num_consts + num_carry :]

  def step(carry, x):
    outs = _evaluate(body.jaxpr, body.consts, [*consts, *carry, *x])
    return outs[:num_carry], outs[num_carry:]

  carry, ys = jax.lax.scan(
    step,
    carry,
    xs,
    length=params["length"],
    reverse=params["reverse"],
    unroll=params["unroll"],
  )
  return [*carry, *ys]


def _communicates(eqn: jex.JaxprEqn) -> bool:
  """Whether ``eqn`` is a collective or holds one."""
  return eqn.primitive.name in _COLLECTIVES or any(
    _holds(jaxpr, _communicates) for jaxpr in jex.jaxprs_in_params(eqn.params)
  )


def _loops(eqn: jex.JaxprEqn) -> bool:
  """Whether ``eqn`` is, or holds, a loop or branch that holds a collective.

  XLA keeps those as nested programs, which its CPU runtime may leave running
  while it starts what comes next; calls, remat and custom derivatives are
  inlined.
  """
  subjaxprs = list(jex.jaxprs_in_params(eqn.params))
  if eqn.primitive.name in _CONTROL_FLOW:
    return any(_holds(jaxpr, _communicates) for jaxpr in subjaxprs)
  return any(_holds(jaxpr, _loops) for jaxpr in subjaxprs)


@functools.lru_cache(maxsize=4096)
def _holds(jaxpr: jex.Jaxpr, predicate: Callable[[jex.JaxprEqn], bool]) -> bool:
  return any(predicate(eqn) for eqn in jaxpr.eqns)


def _after(values: list[Any], outputs: list[list[Any]]) -> list[Any]:
  """``values`` with one of them made to depend on each of ``outputs``, unchanged in value.

  Each list of outputs is represented by its smallest array. The smallest
  input takes the dependency, so that if the compiler must copy it rather
  than update it in place, the copy is small; its varying mesh axes must
  include the anchors', or the dependency would change its type.
  """
  anchors = [min(arrays, key=_size) for arrays in map(_arrays, outputs) if arrays]
  if not anchors:
    return values
  axes = frozenset().union(*map(_varying, anchors))
  targets = [i for i, x in enumerate(values) if _is_array(x) and axes <= _varying(x)]
  if not targets:
    # Every input is the same on all devices and the anchors are not (rare:
    # zerojax's own loops and collectives always take per-device values).
    return values
  index = min(targets, key=lambda i: _size(values[i]))
  values = list(values)
  values[index] = _depend(values[index], anchors)
  return values


def _arrays(values: list[Any]) -> list[jax.Array]:
  return [x for x in values if _is_array(x)]


def _is_array(x: Any) -> bool:
  """Whether ``x`` can anchor or take a link: a non-empty number array, whole on each device.

  An array typed as split over an explicit mesh axis (pipeline stages'
  parameters) cannot: explicit sharding refuses to read or update one element
  of it, which lives on some devices only.
  """
  if not (isinstance(x, jax.Array) and x.size > 0 and jnp.issubdtype(x.dtype, jnp.number)):
    return False
  spec = getattr(jax.typeof(x).sharding, "spec", None) or ()
  return all(entry is None for entry in spec)


def _size(x: jax.Array) -> int:
  return x.size


def _varying(x: jax.Array) -> frozenset[str]:
  """The manual mesh axes over which ``x`` varies."""
  return jax.typeof(x).manual_axis_type.varying


def _depend(x: jax.Array, anchors: list[jax.Array]) -> jax.Array:
  """``x``, bit for bit, computed after every array of ``anchors``.

  ``0.0 * a`` is a zero or, for an infinite or NaN ``a``, NaN; XLA keeps the
  product because it cannot know which (it folds what it can prove, such as
  ``|a| < 0`` or integer ``0 * a``). NaN is then replaced by zero and the sign
  made negative: every element of ``x`` gets ``-0.0`` added (``y + -0.0 == y``
  for every float ``y``, ``-0.0`` included) or, for integers, ``0``.

  Every element, not one: inside a ``shard_map`` manual over some axes, XLA's
  partitioner may split ``x`` over an ``Auto`` axis that its type does not
  show (a ``model`` axis), and it partitions a one-element update wrongly
  there: each part writes the whole array's first element into its own
  first element (``x.at[0, 0].add(-0.0)`` on rows split in two copies row 0
  into row ``n / 2``). An elementwise add is partitioned like any other.
  ``x`` is the smallest input that can take the link, so the add is cheap.
  """
  product = sum(jnp.float32(0.0) * a.reshape(-1)[0].astype(jnp.float32) for a in anchors)
  nothing = -jnp.abs(jnp.where(product != product, jnp.float32(0.0), product)).astype(x.dtype)
  missing = _varying(x) - _varying(nothing)
  if missing:
    nothing = jax.lax.pcast(nothing, tuple(missing), to="varying")
  return x + nothing
