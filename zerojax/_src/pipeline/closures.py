"""What ``stage_fn`` and ``loss_fn`` close over, handed to the stages as operands.

A layer function closes over values of the enclosing loss (a causal mask, rotary
tables, a key, a scalar computed from a parameter): tracers of the trace around
``zerojax.pipeline``. The stages run inside a ``jax.shard_map`` manual over the
stage axis, where such a tracer is typed on the wrong mesh (JAX refuses it on
Explicit axes, and on Auto axes inside ``zerojax.value_and_grad``), and the
pipeline's custom VJP would drop its gradient. So each function is traced once
outside the stages (``remat.trace``) to find the tracers it reads; they enter the
``shard_map`` as operands, replicated over the stage axis, and while a stage
traces the user's function, the closure cells that hold them hold the operands
instead.

Not the jaxpr of that trace evaluated inside: a jaxpr traced outside the stages
keeps the outer context in it (each equation's mesh, a nested scan's carry typed
without the stage axis), which the stage cannot bind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.core import Tracer

from zerojax._src.step import remat


@dataclasses.dataclass(frozen=True, eq=False)
class Closure:
  """A function and the closure cells holding the tracers it reads, swapped for operands.

  Attributes:
    fn: the user's function.
    cells: each cell holding such tracers (its contents a tracer or a pytree of
      them), with the positions, among the operands, of the tracers its
      leaves hold (``-1`` for a leaf that is not one).
  """

  fn: Callable[..., Any]
  cells: tuple[tuple[Any, tuple[int, ...]], ...] = ()

  def _key(self) -> tuple[Any, ...]:
    # Cells compare by their contents (tracers): the same cells are the same objects.
    return (self.fn, tuple((id(cell), where) for cell, where in self.cells))

  def __eq__(self, other: object) -> bool:
    return isinstance(other, Closure) and self._key() == other._key()

  def __hash__(self) -> int:
    return hash(self._key())

  def __call__(self, operands: Any, *args: Any) -> Any:
    """``fn(*args)``, each tracer it closes over replaced by its operand while it runs."""
    if not self.cells:
      return self.fn(*args)
    saved = [cell.cell_contents for cell, _ in self.cells]
    try:
      for (cell, where), contents in zip(self.cells, saved, strict=True):
        leaves, treedef = jax.tree.flatten(contents)
        swapped = [operands[i] if i >= 0 else a for a, i in zip(leaves, where, strict=True)]
        cell.cell_contents = jax.tree.unflatten(treedef, swapped)
      return self.fn(*args)
    finally:
      for (cell, _), contents in zip(self.cells, saved, strict=True):
        cell.cell_contents = contents


def close(fn: Callable[..., Any], example: tuple[Any, ...]) -> tuple[Closure, tuple[Any, ...]]:
  """``fn`` as a ``Closure``, and the tracers it reads that its closure cells hold.

  ``fn`` is traced at ``example`` (types); what it prints or warns then is
  dropped (its real trace, in the stages, shows it). A function that cannot be
  traced outside the stages (one that reads ``jax.lax.axis_index`` of the stage
  axis) is handed every tracer its closure cells hold. A tracer held where no
  closure cell reaches (an object's attribute) is left where it is: JAX then
  refuses it inside the stages.
  """
  try:
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
      warnings.simplefilter("ignore")
      consts = remat.trace(fn, *example).consts
  except Exception:  # its real trace, in the stages, raises whatever is wrong with it
    held = [a for cell in _cells(fn) for a in jax.tree.leaves(cell.cell_contents)]
    consts = tuple({id(a): a for a in held if isinstance(a, Tracer)}.values())
  position = {id(c): i for i, c in enumerate(consts)}
  cells = []
  for cell in _cells(fn):
    where = tuple(position.get(id(a), -1) for a in jax.tree.leaves(cell.cell_contents))
    if any(i >= 0 for i in where):
      cells.append((cell, where))
  # Only the tracers some cell holds become operands, renumbered in order.
  kept = sorted({i for _, where in cells for i in where if i >= 0})
  renumber = {i: k for k, i in enumerate(kept)}
  cells = [(cell, tuple(renumber.get(i, -1) for i in where)) for cell, where in cells]
  return Closure(fn, tuple(cells)), tuple(consts[i] for i in kept)


def _cells(fn: Any) -> Iterator[Any]:
  """The closure cells of ``fn`` and of the functions its cells (and partials) hold, once each."""
  seen, cells, todo = set(), set(), [fn]
  while todo:
    f = todo.pop()
    if id(f) in seen:
      continue
    seen.add(id(f))
    if isinstance(f, functools.partial):
      todo.append(f.func)
    f = getattr(f, "__func__", f)  # a bound method's function
    for cell in getattr(f, "__closure__", None) or ():
      try:
        contents = cell.cell_contents
      except ValueError:  # a cell not filled yet
        continue
      if id(cell) not in cells:
        cells.add(id(cell))
        if any(isinstance(a, Tracer) for a in jax.tree.leaves(contents)):
          yield cell
      if callable(contents):
        todo.append(contents)
