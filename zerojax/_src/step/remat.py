"""What a layer's backward pass keeps: the user's checkpoint policies, never a gathered weight.

zerojax runs each layer of a stack under a checkpoint of its own, so that the
gathered weights are gathered again in the backward pass instead of being kept.
But JAX nests checkpoints by letting the outermost policy decide for every
value inside, so that checkpoint alone would override the policy of a layer
that arrives under the user's own ``jax.checkpoint`` (``nn.remat``,
``nnx.remat``, ``jax.remat``): a layer the user asked to recompute would be
saved whole, a named activation they asked to offload would stay on the
device. Here the layer is traced to a jaxpr instead, and each value is judged
by the policy of the innermost checkpoint the user put around it (zerojax's own
``policy=`` outside them all), with one rule on top: a value computed from the
gathered weights and the values every layer shares alone (a weight, its cast or
transpose, a causal mask) is never kept. The values kept are marked with
checkpoint names, and the one outer checkpoint keeps (or offloads to host
memory) exactly the marked values. A mark goes where ``jax.checkpoint``'s policy
would look: in the derivative of each primitive (``exp``'s derivative reads
``exp``'s output, which a mark on the primal output would not reach, so the
backward pass would keep ``exp``'s input and compute it again).

Tracing ``f`` once also closes it over nothing: every value of an enclosing
trace that ``f`` captures (a causal mask, rotary tables, a dropout key) becomes
an explicit operand, which a ``jax.custom_vjp`` needs (``jax.closure_convert``
hoists only floating-point ones).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.core import Tracer
from jax.custom_derivatives import SymbolicZero
from jax.extend import core as jex

from zerojax._src.comm import shards as shards_lib

#: The checkpoint name of a value the backward pass reads from device memory.
SAVED = "zerojax_saved"
#: The checkpoint name of a value the backward pass reads from host memory.
OFFLOADED = "zerojax_offloaded"

#: What a layer keeps of its values under no checkpoint of the user's, unless told otherwise:
#: none (full rematerialisation: only the layer's inputs, the backward pass computing the rest
#: again). Compiled for TPU v5e, the seeds' 7.5B and a 70B model fit a sequence a chip this way
#: and not keeping every value, at one more forward pass of compute (a third more a step):
#: docs/design.md, "What the backward pass keeps by default".
DEFAULT_POLICY = jax.checkpoint_policies.nothing_saveable

#: The primitives that call a jaxpr the judging looks into (``jax.jit`` inside a layer).
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call"})
#: ``jax.checkpoint``'s primitive.
_REMAT = "remat2"


@dataclasses.dataclass(frozen=True, eq=False)
class Traced:
  """A function traced once: its jaxpr, its output structure and what it closes over.

  Attributes:
    jaxpr: the function's jaxpr, its closed-over values as its ``consts``.
    out_tree: the structure of its output.
    consts: the values of enclosing traces (tracers) it closes over, as
      explicit operands of ``function``; concrete constants stay in
      ``jaxpr``.
  """

  jaxpr: jex.ClosedJaxpr
  out_tree: Any
  hoisted: tuple[bool, ...]  # per constant of ``jaxpr``: whether it is one of ``consts``
  consts: tuple[Any, ...]

  def function(self, *args: Any) -> Any:
    """The function again, with ``consts`` as trailing arguments: ``function(*args, *consts)``."""
    flat = jax.tree.leaves(args[: len(args) - len(self.consts)])
    out = _evaluate(self.jaxpr, self.constants(args[len(args) - len(self.consts) :]), flat)
    return jax.tree.unflatten(self.out_tree, out)

  def constants(self, hoisted: Sequence[Any]) -> list[Any]:
    """The jaxpr's constants, with ``hoisted`` where ``consts`` were."""
    given = iter(hoisted)
    return [next(given) if h else c for h, c in zip(self.hoisted, self.jaxpr.consts, strict=True)]


def trace(f: Callable[..., Any], *args: Any) -> Traced:
  """``f`` traced at ``args`` (arrays or ``jax.ShapeDtypeStruct`` s), its captured tracers hoisted.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from zerojax._src.step import remat
    >>> mask = jnp.tril(jnp.ones((3, 3), bool))
    >>> traced = remat.trace(lambda x: jnp.where(mask, x, 0.0), jnp.ones((3, 3)))
    >>> traced.consts  # a concrete mask stays a constant of the jaxpr
    ()
    >>> traced.function(jnp.ones((3, 3))).sum()
    Array(6., dtype=float32)
  """
  jaxpr, shape = jax.make_jaxpr(f, return_shape=True)(*args)
  hoisted = tuple(isinstance(c, Tracer) for c in jaxpr.consts)
  consts = tuple(c for c, h in zip(jaxpr.consts, hoisted, strict=True) if h)
  return Traced(jaxpr, jax.tree.structure(shape), hoisted, consts)


def checkpoint(
  f: Callable[..., Any], policy: Callable[..., Any] | None, shared_argnums: Sequence[int] = ()
) -> Callable[..., Any]:
  """``jax.checkpoint(f)``, keeping what the user's checkpoints in ``f`` keep but gathered weights.

  Each value of ``f`` is kept for the backward pass if the policy of the
  innermost ``jax.checkpoint`` around it in ``f`` would keep it (``policy``
  for values outside any), as ``jax.checkpoint`` judges it: in ``f``'s
  derivative, so that a value a derivative rule reads (``exp``'s output) is
  the value kept. But a value computed from the gathered weights, the
  arguments in ``shared_argnums`` and constants alone is never kept (the
  weights, their casts and transposes, a causal mask): the backward pass
  computes it again from what it has anyway. Values that policy offloads
  (``save_and_offload_only_these_names``) are offloaded.

  Args:
    f: the function (a layer).
    policy: the policy for the values of ``f`` under no checkpoint of the
      user's; ``None`` keeps none of them (``DEFAULT_POLICY``): the backward
      pass computes them again from ``f``'s inputs.
    shared_argnums: the positions of ``f``'s arguments the backward pass
      holds anyway: gathered weights (gathered again), values every layer
      shares. What ``f`` closes over is shared too.

  Returns:
    The checkpointed function.

  Raises:
    ValueError: if ``f`` offloads to two different memory kinds, or if
      ``policy`` is given and ``f`` is all under a checkpoint of its own,
      so that ``policy`` would decide nothing.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from zerojax._src.step import remat
    >>> layer = lambda h, w: jnp.tanh(h @ w)
    >>> h, w = jnp.ones((2, 3)), jnp.ones((3, 3))
    >>> _, pullback = jax.vjp(remat.checkpoint(layer, None), h, w)
    >>> sorted(leaf.shape for leaf in jax.tree.leaves(pullback))  # the inputs only
    [(2, 3), (3, 3)]
    >>> keep_all = jax.checkpoint_policies.everything_saveable
    >>> _, pullback = jax.vjp(remat.checkpoint(layer, keep_all), h, w)
    >>> sorted(leaf.shape for leaf in jax.tree.leaves(pullback))  # and tanh, 1 - tanh
    [(2, 3), (2, 3), (2, 3), (3, 3)]
  """

  def layer(*args):
    traced = trace(f, *args)
    if policy is not None and _wholly_checkpointed(traced.jaxpr.jaxpr):
      raise ValueError(
        "this layer runs under its own jax.checkpoint (jax.remat, nn.remat, nnx.remat), whose "
        f"policy decides what its backward pass keeps, and zerojax's policy={policy!r} would "
        "decide nothing: pass the policy to the layer's own jax.checkpoint(..., policy=) or "
        "zerojax's policy= (without the layer's checkpoint), not both."
      )
    marks = _Marks()
    shared = [i in shared_argnums for i, arg in enumerate(args) for _ in jax.tree.leaves(arg)]

    def marked(consts, flat):
      judge = _Judge(policy or DEFAULT_POLICY, marks)
      return judge.evaluate(traced.jaxpr.jaxpr, traced.constants(consts), flat, shared)[0]

    # The policy is asked once ``marked`` has been traced, when ``marks`` knows where to offload.
    chosen = lambda *args, **params: marks.policy()(*args, **params)
    checkpointed = jax.checkpoint(marked, policy=chosen, prevent_cse=False)
    out = checkpointed(traced.consts, jax.tree.leaves(args))
    return jax.tree.unflatten(traced.out_tree, out)

  return layer


class _Marks:
  """Where the judged function offloads to: one memory kind, or none."""

  def __init__(self):
    self.offload: tuple[str, str] | None = None

  def offloads_to(self, src: str, dst: str) -> None:
    if self.offload not in (None, (src, dst)):
      raise ValueError(
        f"a layer's checkpoint policies offload from {self.offload[0]!r} to {self.offload[1]!r} "
        f"and from {src!r} to {dst!r}: zerojax.scan offloads a layer's values to one memory "
        "kind; use one save_and_offload_only_these_names policy for the layer."
      )
    self.offload = (src, dst)

  def policy(self) -> Callable[..., Any]:
    if self.offload is None:
      return jax.checkpoint_policies.save_only_these_names(SAVED)
    src, dst = self.offload
    return jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=[SAVED],
      names_which_can_be_offloaded=[OFFLOADED],
      offload_src=src,
      offload_dst=dst,
    )


@dataclasses.dataclass
class _Judge:
  """Evaluates a jaxpr, marking each value its region's policy keeps.

  A value is shared if it is computed from the shared arguments, gathered
  weights and constants alone: those are never marked.
  """

  policy: Callable[..., Any]
  marks: _Marks

  def evaluate(
    self, jaxpr: jex.Jaxpr, consts: Sequence[Any], args: Sequence[Any], shared: Sequence[bool]
  ) -> tuple[list[Any], list[bool]]:
    """``jaxpr``'s outputs, and for each whether it is shared."""
    env: dict[Any, Any] = {}
    common = set(jaxpr.constvars) | {v for v, s in zip(jaxpr.invars, shared, strict=True) if s}
    read = lambda v: v.val if isinstance(v, jex.Literal) else env[v]
    is_shared = lambda v: isinstance(v, jex.Literal) or v in common
    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
      ins = [read(v) for v in eqn.invars]
      with eqn.ctx.manager:
        outs, shares = self._equation(eqn, ins, [is_shared(v) for v in eqn.invars])
      env.update(zip(eqn.outvars, outs, strict=True))
      common.update(v for v, s in zip(eqn.outvars, shares, strict=True) if s)
    return [read(v) for v in jaxpr.outvars], [is_shared(v) for v in jaxpr.outvars]

  def _equation(self, eqn: Any, ins: list[Any], shared: list[bool]) -> tuple[list[Any], list[bool]]:
    name, params = eqn.primitive.name, eqn.params
    if name == _REMAT:  # the user's checkpoint: its policy rules inside it
      inner = params["policy"] or jax.checkpoint_policies.nothing_saveable
      return _Judge(inner, self.marks).evaluate(params["jaxpr"], (), ins, shared)
    if name in _CALLS and isinstance(params.get("jaxpr"), jex.ClosedJaxpr):
      return self.evaluate(params["jaxpr"].jaxpr, params["jaxpr"].consts, ins, shared)
    if shards_lib.names_secondary(eqn.primitive, params):  # hpZ's partition: always kept
      return [checkpoint_name(_bind(eqn, ins)[0], SAVED)], [False]
    if shards_lib.gathers(eqn.primitive, params) or (all(shared) and not eqn.effects):
      return _bind(eqn, ins), [True] * len(eqn.outvars)
    choice = self.policy(eqn.primitive, *(v.aval for v in eqn.invars), **params)
    if _kept(choice) and _differentiable(eqn):
      # Marking the output would not do: the derivative rule reads the primitive's own output.
      return self._differentiated(eqn, ins), [False] * len(eqn.outvars)
    return [self._marked(out, choice) for out in _bind(eqn, ins)], [False] * len(eqn.outvars)

  def _differentiated(self, eqn: Any, ins: list[Any]) -> list[Any]:
    """``eqn``'s outputs, their derivative marking the values of it the policy keeps."""

    @jax.custom_jvp
    def applied(*primals):
      return _bind(eqn, primals)

    def rule(primals, tangents):
      # Only the operands that move: a zero tangent instantiated would make the derivative read
      # the other operands (``x * scale``'s derivative in a constant ``scale`` reads ``x``).
      moving = [not isinstance(t, SymbolicZero) for t in tangents]

      def moved(*values):
        given = iter(values)
        return _bind(eqn, [next(given) if m else p for p, m in zip(primals, moving, strict=True)])

      pick = lambda values: [v for v, m in zip(values, moving, strict=True) if m]
      jvp = lambda p, t: jax.jvp(moved, p, t)
      closed = jax.make_jaxpr(jvp)(pick(primals), pick(tangents))
      out = self._tangents_apart(closed, pick(primals), pick(tangents))
      return out[: len(out) // 2], out[len(out) // 2 :]

    applied.defjvp(rule, symbolic_zeros=True)
    return applied(*ins)

  def _tangents_apart(self, closed: jex.ClosedJaxpr, primals: list, tangents: list) -> list[Any]:
    """A derivative's jaxpr evaluated, its values computed from the primals marked by the policy."""
    jaxpr = closed.jaxpr
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, [*primals, *tangents], strict=True))
    read = lambda v: v.val if isinstance(v, jex.Literal) else env[v]
    primal = set(jaxpr.invars[: len(primals)])  # not the operands held still: shared, or not
    tangent = set(jaxpr.invars[len(primals) :])
    for eqn in jaxpr.eqns:
      with eqn.ctx.manager:
        outs = _bind(eqn, [read(v) for v in eqn.invars])
      if any(v in tangent for v in eqn.invars if not isinstance(v, jex.Literal)):
        tangent.update(eqn.outvars)
      elif any(v in primal for v in eqn.invars if not isinstance(v, jex.Literal)):
        choice = self.policy(eqn.primitive, *(v.aval for v in eqn.invars), **eqn.params)
        outs = [self._marked(out, choice) for out in outs]
        primal.update(eqn.outvars)
      env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]

  def _marked(self, value: Any, choice: Any) -> Any:
    dst = getattr(choice, "dst", None)  # jax's Offloadable(src, dst)
    if dst is not None:
      self.marks.offloads_to(choice.src, dst)
      return checkpoint_name(value, OFFLOADED)
    if _kept(choice):
      return checkpoint_name(value, SAVED)
    return value


def _kept(choice: Any) -> bool:
  """Whether a policy's choice keeps the value, on the device or offloaded."""
  return choice is True or getattr(choice, "__name__", None) == "Saveable" or hasattr(choice, "dst")


def _differentiable(eqn: Any) -> bool:
  """Whether an equation maps floating-point values to floating-point values, and no others."""
  floating = lambda v: jnp.issubdtype(v.aval.dtype, jnp.inexact)
  return bool(eqn.invars) and all(floating(v) for v in [*eqn.invars, *eqn.outvars])


def _bind(eqn: Any, ins: Sequence[Any]) -> list[Any]:
  """``eqn``'s primitive applied to ``ins``, its outputs as a list."""
  outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
  return list(outs) if eqn.primitive.multiple_results else [outs]


def _wholly_checkpointed(jaxpr: jex.Jaxpr) -> bool:
  """Whether every equation of ``jaxpr`` is a user's checkpoint (inside ``jax.jit`` s or not)."""

  def checkpointed(eqn) -> bool:
    if eqn.primitive.name in _CALLS and isinstance(eqn.params.get("jaxpr"), jex.ClosedJaxpr):
      return _wholly_checkpointed(eqn.params["jaxpr"].jaxpr)
    return eqn.primitive.name == _REMAT

  return bool(jaxpr.eqns) and all(checkpointed(eqn) for eqn in jaxpr.eqns)


def _evaluate(jaxpr: jex.ClosedJaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
  """``jaxpr`` evaluated at ``args`` with ``consts`` as its constants."""
  return jex.jaxpr_as_fun(jex.ClosedJaxpr(jaxpr.jaxpr, list(consts)))(*args)
