"""Whether a loss sums over its batch: ``value_and_grad`` averages the per-device losses.

``zerojax.value_and_grad`` returns the mean of the losses of every device (and
micro-batch), which is the loss on the whole batch when each is a mean over its
slice. A loss that sums over its slice (``jnp.sum`` of per-example losses)
comes out 1/N of ``jax.value_and_grad``'s on the whole batch, gradients too.
That shows in the loss's trace: a mean divides by its batch size, a constant
that changes with it (``jnp.mean``'s divisor, ``x.shape[0]``), or by a count
computed from the batch (a masked mean); a sum does neither.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.core import ShapedArray
from jax.extend import core


def looks_summed(
  fn: Callable[..., Any],
  batch: Sequence[Any],
  *,
  params: Sequence[Any] = (),
  traced: core.ClosedJaxpr | None = None,
) -> bool:
  """Whether ``fn(*params, *batch)`` (a scalar, or a tuple whose first leaf is) sums over the batch.

  ``fn`` is traced on ``batch`` and on twice as many rows of each of its
  arguments: it sums if its value depends on the batch, no constant of the
  trace changes with the batch size, and it divides by no scalar computed from
  the batch. A loss that cannot be traced at another batch size gets no verdict
  (``False``). Nothing runs, nothing is added to an enclosing trace, and what
  the loss prints or warns while traced at twice the size is dropped (its real
  trace shows it).

  Args:
    fn: the loss of one micro-batch.
    batch: its batch arguments, arrays, tracers or their types, with a leading
      batch dimension.
    params: arguments before the batch that do not change with it.
    traced: ``jax.make_jaxpr(fn)(*params, *batch)``, if the caller has it
      (then only the trace at twice the size is made here).

  Example:
    >>> import jax.numpy as jnp
    >>> batch = (jnp.ones((4, 3)),)
    >>> looks_summed(lambda x: jnp.sum(x**2), batch), looks_summed(lambda x: jnp.mean(x**2), batch)
    (True, False)
    >>> masked_mean = lambda x: jnp.sum(x * (x > 0)) / jnp.sum(x > 0)
    >>> looks_summed(masked_mean, batch)
    False
    >>> looks_summed(lambda w, x: jnp.sum(x @ w), batch, params=(jnp.ones(3),))
    True
  """
  try:  # the loss may fix its batch size; then there is no verdict
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
      warnings.simplefilter("ignore")
      small = traced or jax.make_jaxpr(fn)(*params, *batch)
      large = jax.make_jaxpr(fn)(*params, *resized(batch, 2))
  except Exception:
    return False
  if small.jaxpr.outvars[0].aval.shape:  # not a loss; value_and_grad says so
    return False
  if _constants(small.jaxpr) != _constants(large.jaxpr):
    return False
  fixed = len(jax.tree.leaves(params))
  marked = [i >= fixed for i in range(len(small.jaxpr.invars))]
  depends, divides = _batch_dependence(small.jaxpr, marked)
  return depends[0] and not divides


def resized(batch: Any, numerator: int, denominator: int = 1) -> Any:
  """The types of ``batch``'s leaves (arrays, tracers or types) with ``numerator /
  denominator`` times their leading dimension."""
  typed = lambda x: x if isinstance(x, ShapedArray) else jax.typeof(x)
  return jax.tree.map(
    lambda x: typed(x).update(shape=(x.shape[0] * numerator // denominator, *x.shape[1:])), batch
  )


def _constants(jaxpr: core.Jaxpr) -> list[tuple[str, Any]]:
  """Every literal of ``jaxpr`` and of the jaxprs inside it, in order."""
  found = []
  for eqn in jaxpr.eqns:
    for var in eqn.invars:
      if isinstance(var, core.Literal):
        value = np.asarray(var.val)
        found.append((str(value.dtype), value.tolist()))
    for inner in core.jaxprs_in_params(eqn.params):
      found += _constants(inner)
  return found


def _batch_dependence(jaxpr: core.Jaxpr, batch: list[bool]) -> tuple[list[bool], bool]:
  """Which outputs depend on the inputs marked in ``batch``; whether a scalar of them divides.

  Inner jaxprs whose inputs are the equation's (``jit``, custom derivatives,
  ``checkpoint``) are followed; for the others, every output of an equation
  depends on the batch if an input does.
  """
  dependent = {var for var, marked in zip(jaxpr.invars, batch, strict=True) if marked}
  on_batch = lambda var: not isinstance(var, core.Literal) and var in dependent
  divides = False
  for eqn in jaxpr.eqns:
    marks = [on_batch(var) for var in eqn.invars]
    if eqn.primitive.name == "div" and marks[1] and not getattr(eqn.invars[1].aval, "shape", ()):
      divides = True
    for inner in core.jaxprs_in_params(eqn.params):
      if len(inner.invars) == len(marks):
        divides |= _batch_dependence(inner, marks)[1]
    if any(marks):
      dependent.update(eqn.outvars)
  return [on_batch(var) for var in jaxpr.outvars], divides
