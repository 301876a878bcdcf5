"""What a training state looks like, as stored on a mesh and logically: ``StateSpec``."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._src.core import transformation as zero_lib

#: Where the master parameters of a state without a separate master copy live
#: (stage 3, or no lower compute dtype): the parameters themselves.
PARAMS = ("params",)


class StateSpec(NamedTuple):
  """What a training state looks like, as stored on a mesh and logically.

  Build one with ``train_state_spec``. A ``CheckpointManager`` saves states of
  this spec and restores checkpoints into it, whichever spec they were saved
  with, as long as the logical leaves agree.

  Attributes:
    stored: a pytree of ``jax.ShapeDtypeStruct`` with ``sharding`` set: the
      state's arrays as they live on the mesh (padded where the layout pads).
    logical: the same pytree without padding or shardings: what the state is,
      whatever the device count or stage.
    master_path: the keys that lead from the state's root to its full-precision
      parameters (what ``export_safetensors`` writes).

  Example:
    >>> import jax, jax.numpy as jnp, optax, zerojax
    >>> tx = zerojax.zero3(optax.adam(1e-3), mesh=jax.make_mesh((jax.device_count(),), ("data",)))
    >>> spec = zerojax.train_state_spec(tx, {"w": jnp.ones((5, 1001))})
    >>> spec.stored["params"]["w"].shape, spec.logical["params"]["w"].shape, spec.master_path
    ((5, 1008), (5, 1001), ('params',))
  """

  stored: Any
  logical: Any
  master_path: tuple[str | int, ...] = PARAMS


def train_state_spec(tx: zero_lib.ZeroTransformation, params: Any, **extras: Any) -> StateSpec:
  """The spec of ``{"params": ..., "opt_state": ..., **extras}`` for ``tx``.

  Args:
    tx: the ``ZeroTransformation`` the state is (or will be) trained with: its
      mesh, stage and precision policy decide how the state is stored.
    params: the parameters, full or as ``tx`` stores them, as arrays or
      ``jax.ShapeDtypeStruct``. For a spec of another device count or stage,
      pass the full ones (another transformation's padding would be taken
      for part of the model).
    **extras: more leaves of the state (a step counter, an RNG key, ...), as
      arrays or ``jax.ShapeDtypeStruct``; they are replicated on ``tx.mesh``.
      Use raw keys (``jax.random.PRNGKey`` or ``jax.random.key_data``).

  Returns:
    The ``StateSpec``.

  Raises:
    ValueError: if ``extras`` names ``params`` or ``opt_state``, or holds a
      typed PRNG key.

  Example:
    >>> import jax, jax.numpy as jnp, optax, zerojax
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = zerojax.zero3(optax.adam(1e-3), mesh=mesh)
    >>> spec = zerojax.train_state_spec(tx, {"w": jnp.zeros((5, 1001))}, step=jnp.int32(0))
    >>> spec.stored["params"]["w"].shape, spec.logical["params"]["w"].shape
    ((5, 1008), (5, 1001))
    >>> spec.stored["params"]["w"].sharding.spec
    P(None, 'data')
  """
  if "opt_state" in extras:
    raise ValueError(
      "train_state_spec makes opt_state itself from tx and params; name the extra leaf otherwise."
    )
  master = tx.layout(params).map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
  replicated = NamedSharding(tx.mesh, P())
  extras = {name: _extra(name, x) for name, x in extras.items()}
  stored = {
    "params": _placed(jax.eval_shape(tx.shard, master), tx.param_shardings(master)),
    "opt_state": _placed(jax.eval_shape(tx.init, master), tx.state_shardings(master)),
    **{name: _placed(x, replicated) for name, x in extras.items()},
  }
  logical_params, logical_state = tx.logical_shapes(master)
  logical = {"params": logical_params, "opt_state": logical_state, **extras}
  master_params = tx.master_params(stored["params"], stored["opt_state"])
  return StateSpec(stored, logical, _path_of(stored, master_params))


def _extra(name: str, x: Any) -> jax.ShapeDtypeStruct:
  struct = jax.eval_shape(lambda x: x, x)
  if not isinstance(struct, jax.ShapeDtypeStruct) or jnp.issubdtype(
    struct.dtype, jax.dtypes.prng_key
  ):
    raise ValueError(
      f"extra state leaf {name!r} must be one array; for a typed PRNG key "
      "store jax.random.key_data(key) and rebuild it with jax.random.wrap_key_data."
    )
  return jax.ShapeDtypeStruct(struct.shape, struct.dtype)


def _placed(structs: Any, shardings: Any) -> Any:
  return jax.tree.map(
    lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
    structs,
    shardings,
  )


def _path_of(tree: Any, subtree: Any) -> tuple[str | int, ...]:
  """The keys from ``tree``'s root to ``subtree``, one of its nodes (found by identity)."""
  first = jax.tree.leaves(subtree)[0]
  depth = len(jax.tree_util.tree_flatten_with_path(subtree)[0][0][0])
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if leaf is first:
      return tuple(key_name(key) for key in path[: len(path) - depth])
  raise ValueError("the master parameters are not part of the state")


def key_name(key: Any) -> str | int:
  """A pytree path entry as the dict key, attribute name or index it stands for.

  Example:
    >>> import jax
    >>> path, _ = jax.tree_util.tree_flatten_with_path({"layers": [0, 1]})[0][1]
    >>> [key_name(key) for key in path]
    ['layers', 1]
  """
  for attribute in ("key", "name", "idx"):
    if hasattr(key, attribute):
      return getattr(key, attribute)
  raise ValueError(f"cannot name the pytree path entry {key!r}")
