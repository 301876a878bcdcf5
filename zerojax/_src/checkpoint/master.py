"""Moving the master parameters between where a checkpoint keeps them and where a spec does.

Under a precision policy whose compute dtype is lower than its master dtype,
stages 1 and 2 keep the master copy in the optimizer state
(``opt_state.master``) beside parameters rounded from it, while stage 3's
parameters are the master copy; without such a policy the parameters are the
master copy in every stage. A restore reads the master copy from the
checkpoint's place into the spec's (``reading_plan``), moves it back where the
spec keeps it (``master_in_place``), and remakes rounded parameters from it
(``with_rounded_params``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from zerojax._src.checkpoint.spec import PARAMS, StateSpec
from zerojax._src.sharding import mesh as mesh_lib

Keys = tuple[str | int, ...]


def at(tree: Any, keys: Sequence[str | int]) -> Any:
  """The node of ``tree`` at ``keys`` (dict keys, sequence indices, attribute names).

  Example:
    >>> import optax
    >>> at({"opt_state": optax.EmptyState(), "params": [{"w": 1}]}, ("params", 0, "w"))
    1
  """
  for key in keys:
    tree = tree[key] if isinstance(tree, dict) or isinstance(key, int) else getattr(tree, key)
  return tree


def replaced(tree: Any, keys: Keys, value: Any) -> Any:
  """``tree`` with the node at ``keys`` replaced by ``value`` (``tree`` itself is unchanged).

  Example:
    >>> from typing import NamedTuple
    >>> class State(NamedTuple):
    ...   master: object
    >>> tree = {"opt_state": State(master=[1, 2])}
    >>> replaced(tree, ("opt_state", "master", 1), 3), tree
    ({'opt_state': State(master=[1, 3])}, {'opt_state': State(master=[1, 2])})
  """
  if not keys:
    return value
  key, rest = keys[0], keys[1:]
  if isinstance(tree, dict):
    return {**tree, key: replaced(tree.get(key), rest, value)}
  if isinstance(key, str):
    return tree._replace(**{key: replaced(getattr(tree, key), rest, value)})
  items = list(tree)
  items[key] = replaced(items[key], rest, value)
  return type(tree)(items)


def separate(master_path: Keys) -> bool:
  """Whether a state whose master parameters live at ``master_path`` keeps them apart.

  Its parameters are then a copy rounded to the compute dtype.
  """
  return tuple(master_path) != PARAMS


def reading_plan(spec: StateSpec, saved_master: Keys) -> Any:
  """What to read: ``spec.stored`` with the master copy moved to where the checkpoint has it.

  A checkpoint's rounded parameters (beside a separate master copy) are not
  read at all: the plan has no ``"params"``.

  Args:
    spec: the spec to restore into.
    saved_master: where the checkpoint keeps its master parameters.
  """
  master = at(spec.stored, spec.master_path)
  item = spec.stored
  if separate(spec.master_path):
    item = replaced(item, spec.master_path, None)
  if separate(saved_master):
    item = {name: x for name, x in item.items() if name != "params"}
  return replaced(item, saved_master, master)


def master_in_place(spec: StateSpec, saved_master: Keys, state: Any) -> Any:
  """A state read by ``reading_plan``, its master copy moved back to where the spec has it.

  Where the spec keeps a separate master copy, its ``"params"`` are ``None``:
  ``with_rounded_params`` remakes them.
  """
  master = at(state, saved_master)
  if separate(saved_master):
    state = replaced(state, saved_master, None)
  if separate(spec.master_path):
    state = replaced(state, PARAMS, None)
  return replaced(state, spec.master_path, master)


def with_rounded_params(spec: StateSpec, state: Any) -> Any:
  """``state`` with parameters rounded from its master copy, where the spec keeps one apart.

  They are what ``tx.shard`` makes of the master copy: its logical region in
  the compute dtype, placed (and padded) as ``spec.stored`` says.
  """
  if not separate(spec.master_path):
    return state
  master = at(state, spec.master_path)
  return replaced(state, PARAMS, rounded(master, spec.logical["params"], spec.stored["params"]))


def rounded(master: Any, logical: Any, stored: Any) -> Any:
  """Parameters in ``stored``'s dtypes, shapes and shardings, rounded from the master copy.

  Args:
    master: the master parameters, as stored (padded, sharded).
    logical: their ``jax.ShapeDtypeStruct`` s without padding.
    stored: the ``jax.ShapeDtypeStruct`` s of the parameters to make.
  """

  def round_leaf(x, shape, struct):
    x = x[tuple(slice(0, n) for n in shape.shape)].astype(struct.dtype)
    widths = [(0, want - have) for want, have in zip(struct.shape, x.shape, strict=True)]
    # jnp.pad refuses the empty widths of a scalar.
    return jnp.pad(x, widths) if x.ndim else x

  shardings = jax.tree.map(lambda struct: struct.sharding, stored)
  mesh = jax.tree.leaves(shardings)[0].mesh
  # In the global view: on explicit axes, slicing a padded dimension that the
  # master copy splits over the data axis is a sharding-type error outside it.
  round_all = mesh_lib.global_view(
    mesh,
    lambda master: jax.tree.map(round_leaf, master, logical, stored),
    jax.tree.map(lambda sharding: sharding.spec, shardings),
  )
  # An offloaded master copy is read in device memory, where the rounding runs.
  fetched = lambda master: round_all(jax.device_put(master, jax.memory.Space.Device))
  return jax.jit(fetched, out_shardings=shardings)(master)
