"""The layout plan: for every leaf, which dimension is sharded over the data axis.

The plan is computed once, from shapes alone, and every other module reads it.
A leaf is either replicated over the data axis or sharded along exactly one
dimension. A sharded dimension that does not divide by the number of devices is
padded with zeros up to the next multiple, because tiled collectives and
``jax.device_put`` both need even shards.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

#: Leaves with fewer elements than this stay replicated by default: sharding
#: them saves almost nothing and costs one more collective each.
DEFAULT_MIN_SHARD_SIZE = 1024

LayoutRule = Callable[[tuple[Any, ...], jax.ShapeDtypeStruct], P | None]


class LeafLayout(NamedTuple):
  """Where one leaf lives.

  Attributes:
    shape: the logical shape, as the model and the inner optimizer see it.
    dtype: the leaf's dtype.
    dim: the data-sharded dimension counted from the end (``-1`` is the last
      dimension, so the meaning survives ``jax.lax.scan`` slicing off leading
      stacked-layer dimensions), or ``None`` if the leaf is replicated over the
      data axis.
    padded_size: the size of ``dim`` once padded to a multiple of the number of
      shards (equal to the logical size when no padding is needed).
    spec: the stored array's ``PartitionSpec`` entries, one per dimension, the
      data axis included; entries for other mesh axes are kept as given.

  Example:
    >>> import jax, jax.numpy as jnp, optax, zerojax
    >>> tx = zerojax.zero3(optax.sgd(0.1), mesh=jax.make_mesh((jax.device_count(),), ("data",)))
    >>> leaf = tx.layout({"w": jnp.ones((4, 1001))}).tree()["w"]
    >>> leaf.dim, leaf.padded_size, leaf.stored_shape, leaf.spec
    (-1, 1008, (4, 1008), (None, 'data'))
  """

  shape: tuple[int, ...]
  dtype: np.dtype
  dim: int | None
  padded_size: int
  spec: tuple[Any, ...]

  @property
  def padding(self) -> int:
    """How many zeros are appended along ``dim``."""
    return 0 if self.dim is None else self.padded_size - self.shape[self.dim]

  @property
  def stored_shape(self) -> tuple[int, ...]:
    """The shape of the stored (padded) array."""
    if self.dim is None:
      return self.shape
    shape = list(self.shape)
    shape[self.dim] = self.padded_size
    return tuple(shape)

  @property
  def partition_spec(self) -> P:
    """The stored array's ``PartitionSpec``."""
    return _trimmed(self.spec)

  def full_spec(self, axis_name: str) -> P:
    """The spec of the gathered array: the data axis removed, others kept."""
    return _trimmed(tuple(_without(entry, axis_name) for entry in self.spec))

  def pad(self, x: jax.Array) -> jax.Array:
    """Appends zeros along ``dim`` (a no-op when no padding is needed)."""
    if not self.padding:
      return x
    widths = [(0, 0)] * x.ndim
    widths[self.dim] = (0, self.padding)
    return jnp.pad(x, widths)

  def unpad(self, x: jax.Array) -> jax.Array:
    """Drops the padding along ``dim`` (a no-op when there is none)."""
    if not self.padding:
      return x
    return jax.lax.slice_in_dim(x, 0, self.shape[self.dim], axis=x.ndim + self.dim)


def _trimmed(entries: tuple[Any, ...]) -> P:
  """A ``PartitionSpec`` without trailing ``None`` s (``P()`` rather than ``P(None, None)``)."""
  while entries and entries[-1] is None:
    entries = entries[:-1]
  return P(*entries)


class Layout(NamedTuple):
  """The plan for a whole pytree: its structure and a ``LeafLayout`` per leaf.

  Layouts are hashable and compare by value, so they can key caches and be
  closed over by jitted functions without causing recompilation.

  Example:
    >>> import jax, jax.numpy as jnp, optax, zerojax
    >>> tx = zerojax.zero3(optax.sgd(0.1), mesh=jax.make_mesh((jax.device_count(),), ("data",)))
    >>> tx.layout({"w": jnp.ones((4, 1001)), "b": jnp.ones(4)}).specs()
    {'b': P(), 'w': P(None, 'data')}
  """

  treedef: jax.tree_util.PyTreeDef
  leaves: tuple[LeafLayout, ...]

  def tree(self) -> Any:
    """The pytree of ``LeafLayout`` s."""
    return jax.tree.unflatten(self.treedef, self.leaves)

  def map(self, fn: Callable[..., Any], *trees: Any) -> Any:
    """Maps ``fn(leaf_layout, *leaves)`` over trees of this structure."""
    flat = [self._flatten(tree) for tree in trees]
    return jax.tree.unflatten(
      self.treedef, [fn(leaf, *xs) for leaf, *xs in zip(self.leaves, *flat, strict=True)]
    )

  def _flatten(self, tree: Any) -> list[Any]:
    leaves, treedef = jax.tree.flatten(tree)
    if treedef != self.treedef:
      raise ValueError(
        "pytree structure does not match the layout: expected "
        f"{self.treedef}, got {treedef}. Pass the params (or state) that "
        "this transformation was initialised with."
      )
    return leaves

  def pad(self, tree: Any) -> Any:
    return self.map(LeafLayout.pad, tree)

  def unpad(self, tree: Any) -> Any:
    return self.map(LeafLayout.unpad, tree)

  def with_dtypes(self, dtype_of: Callable[[np.dtype], np.dtype]) -> Layout:
    """This layout with each leaf's dtype replaced by ``dtype_of(dtype)``."""
    leaves = tuple(leaf._replace(dtype=np.dtype(dtype_of(leaf.dtype))) for leaf in self.leaves)
    return self._replace(leaves=leaves)

  def specs(self) -> Any:
    """The stored arrays' ``PartitionSpec`` s."""
    return self.map(lambda leaf: leaf.partition_spec)

  def shardings(self, mesh: jax.sharding.Mesh) -> Any:
    """The stored arrays' ``NamedSharding`` s on ``mesh``."""
    return self.map(lambda leaf: NamedSharding(mesh, leaf.partition_spec))

  def stored_shapes(self, mesh: jax.sharding.Mesh | None = None) -> Any:
    """``jax.ShapeDtypeStruct`` s of the stored arrays (with shardings if a mesh is given)."""

    def struct(leaf):
      sharding = None if mesh is None else NamedSharding(mesh, leaf.partition_spec)
      return jax.ShapeDtypeStruct(leaf.stored_shape, leaf.dtype, sharding=sharding)

    return self.map(struct)

  def key(self, stored: bool) -> tuple[Any, ...]:
    """A hashable signature of the logical or stored shapes of this tree."""
    shapes = tuple(
      (leaf.stored_shape if stored else leaf.shape, leaf.dtype) for leaf in self.leaves
    )
    return (self.treedef, shapes)


def signature(tree: Any) -> tuple[Any, ...]:
  """The signature ``Layout.key`` would give a tree with these shapes."""
  leaves, treedef = jax.tree.flatten(tree)
  return (treedef, tuple((tuple(np.shape(x)), _dtype_of(x)) for x in leaves))


def default_shard_dim(shape: tuple[int, ...], num_shards: int, free_dims=None) -> int | None:
  """The dimension the default rule shards, counted from the end.

  The leading dimension of a leaf with two or more dimensions is never chosen:
  it is the layer dimension of stacked (scanned) weights, and a scan body must
  see a whole layer's shard. Among the other dimensions, one that divides by
  ``num_shards`` is preferred (no padding), and among those the most major
  (first); if none divides, the largest is padded.

  Args:
    shape: the leaf's logical shape.
    num_shards: the size of the data axis.
    free_dims: dimensions (non-negative) not already taken by other mesh axes;
      all of them by default.

  Returns:
    A negative dimension index, or ``None`` for a scalar.

  Example:
    >>> import zerojax
    >>> zerojax.default_shard_dim((12, 1024, 512), num_shards=8)  # never the layer dimension
    -2
  """
  ndim = len(shape)
  candidates = [d for d in range(1 if ndim >= 2 else 0, ndim)]
  if free_dims is not None:
    candidates = [d for d in candidates if d in free_dims]
  if not candidates:
    return None
  divisible = [d for d in candidates if shape[d] % num_shards == 0]
  # The most major divisible dimension: its shards are contiguous blocks, which
  # collectives move several times faster than strided ones (measured on
  # XLA:CPU: a reduce-scatter over dim 0 of a 1024x1024 block is ~10x faster
  # than over dim 1), and inside a scan body dim 1 of a stacked leaf is dim 0.
  # With no divisible dimension, pad the largest: the least padding relative
  # to the leaf.
  best = divisible[0] if divisible else max(candidates, key=lambda d: (shape[d], d))
  return best - ndim


def plan(
  tree: Any,
  *,
  axis_name: str,
  num_shards: int,
  shard: bool = True,
  rule: LayoutRule | Any | None = None,
  min_shard_size: int = DEFAULT_MIN_SHARD_SIZE,
  like: Layout | None = None,
) -> Layout:
  """Plans the layout of a pytree of arrays or ``jax.ShapeDtypeStruct`` s.

  Args:
    tree: the pytree, in logical shapes.
    axis_name: the data-parallel mesh axis.
    num_shards: that axis's size.
    shard: if False, every leaf is replicated over the data axis (stage 1 and 2
      parameters); other mesh axes in the leaves' shardings are still kept.
    rule: per-leaf override: either a callable ``(path, leaf) -> PartitionSpec |
      None`` or a pytree (a prefix of ``tree``) of ``PartitionSpec`` or
      ``None``. A spec names the dimension sharded over ``axis_name`` (``P()``
      keeps the leaf replicated); ``None`` falls back to the default rule.
    min_shard_size: leaves with fewer elements stay replicated by default.
    like: a layout whose leaves' dimensions are reused for leaves of this tree
      with the same shape whose path ends with theirs (so ``mu`` and ``nu`` of
      Adam are sharded exactly like the parameters they mirror).

  Returns:
    The ``Layout``.

  Raises:
    ValueError: for a leaf that is not an array, or an override that does not
      fit its leaf.
  """
  paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  overrides = _overrides(rule, tree, treedef, paths_and_leaves)
  mirrors = _mirrors(like)
  leaves = []
  for (path, leaf), override in zip(paths_and_leaves, overrides, strict=True):
    leaves.append(
      _plan_leaf(
        path,
        leaf,
        override,
        axis_name=axis_name,
        num_shards=num_shards,
        shard=shard,
        min_shard_size=min_shard_size,
        mirrors=mirrors,
      )
    )
  return Layout(treedef, tuple(leaves))


def _plan_leaf(path, leaf, override, *, axis_name, num_shards, shard, min_shard_size, mirrors):
  if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
    raise ValueError(
      f"leaf at {jax.tree_util.keystr(path)} is {type(leaf).__name__}, not an "
      "array; zerojax shards pytrees of arrays only. Convert it with "
      "jnp.asarray, or keep it out of the params/optimizer state."
    )
  shape = tuple(int(s) for s in leaf.shape)
  dtype = np.dtype(leaf.dtype)
  base = _base_spec(leaf, len(shape), axis_name)
  dim = None
  if override is not None:
    dim, base = _dim_from_spec(override, shape, axis_name, path)
    if not shard:
      dim = None
  elif shard and _is_shardable(dtype) and math.prod(shape) >= min_shard_size:
    free = [d for d in range(len(shape)) if base[d] is None]
    dim = _mirrored_dim(mirrors, path, shape)
    if dim is None or base[dim] is not None:
      dim = default_shard_dim(shape, num_shards, free)
  spec = list(base)
  padded_size = 0
  if dim is not None:
    size = shape[dim]
    padded_size = -(-size // num_shards) * num_shards
    spec[dim] = axis_name if base[dim] is None else (base[dim], axis_name)
  return LeafLayout(shape, dtype, dim, padded_size, tuple(spec))


def _is_shardable(dtype: np.dtype) -> bool:
  # Integer and boolean leaves (step counters, masks) pass through replicated.
  return jnp.issubdtype(dtype, jnp.inexact)


def _base_spec(leaf, ndim: int, axis_name: str) -> tuple[Any, ...]:
  """Entries of the leaf's current sharding for mesh axes other than the data axis."""
  sharding = getattr(leaf, "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None:
    return (None,) * ndim
  entries = tuple(spec) + (None,) * (ndim - len(spec))
  return tuple(_without(entry, axis_name) for entry in entries)


def _without(entry: Any, axis_name: str) -> Any:
  if entry == axis_name:
    return None
  if isinstance(entry, tuple):
    rest = tuple(e for e in entry if e != axis_name)
    return rest[0] if len(rest) == 1 else (rest or None)
  return entry


def _dim_from_spec(spec: P, shape, axis_name: str, path) -> tuple[int | None, tuple[Any, ...]]:
  """Reads an override ``PartitionSpec``: which dim the data axis is on, and the rest."""
  where = jax.tree_util.keystr(path)
  if not isinstance(spec, P):
    raise ValueError(
      f"layout override for {where} is {spec!r}; give a PartitionSpec such as "
      f"P(None, {axis_name!r}) to shard dim 1, P() to replicate, or None for the default."
    )
  if len(spec) > len(shape):
    raise ValueError(
      f"layout override {spec} for {where} has {len(spec)} entries but the leaf has shape {shape}."
    )
  entries = tuple(spec) + (None,) * (len(shape) - len(spec))
  dims = [
    d for d, e in enumerate(entries) if e == axis_name or (isinstance(e, tuple) and axis_name in e)
  ]
  if len(dims) > 1:
    raise ValueError(f"layout override {spec} for {where} names {axis_name!r} more than once.")
  base = tuple(_without(e, axis_name) for e in entries)
  return (dims[0] - len(shape) if dims else None), base


def _overrides(rule, tree, treedef, paths_and_leaves) -> list[Any]:
  if rule is None:
    return [None] * len(paths_and_leaves)
  if callable(rule) and not isinstance(rule, P):
    return [
      rule(path, jax.ShapeDtypeStruct(np.shape(leaf), _dtype_of(leaf)))
      for path, leaf in paths_and_leaves
    ]
  is_spec = lambda x: x is None or isinstance(x, P)
  try:
    full = jax.tree.map(
      lambda spec, subtree: jax.tree.map(lambda _: spec, subtree), rule, tree, is_leaf=is_spec
    )
  except ValueError as error:
    raise ValueError(
      "layout overrides must be a pytree of PartitionSpec/None whose structure "
      f"is a prefix of the params: {error}"
    ) from None
  return jax.tree.leaves(full, is_leaf=is_spec) if treedef.num_leaves else []


def _mirrors(like: Layout | None) -> list[tuple[tuple[Any, ...], tuple[int, ...], int]]:
  """(path, shape, dim) of every sharded leaf of ``like``, longest paths first."""
  if like is None:
    return []
  flat, _ = jax.tree_util.tree_flatten_with_path(
    like.tree(), is_leaf=lambda x: isinstance(x, LeafLayout)
  )
  found = [(tuple(path), leaf.shape, leaf.dim) for path, leaf in flat if leaf.dim is not None]
  return sorted(found, key=lambda item: -len(item[0]))


def _mirrored_dim(mirrors, path, shape) -> int | None:
  """The dim of the mirrored leaf whose path ``path`` ends with, if any."""
  path = tuple(path)
  for mirror_path, mirror_shape, dim in mirrors:
    if mirror_shape == shape and path[len(path) - len(mirror_path) :] == mirror_path:
      return dim
  return None


def _dtype_of(x: Any) -> np.dtype | str:
  # Not an array: the type's name keeps signatures hashable; ``plan`` then raises.
  return np.dtype(x.dtype) if hasattr(x, "dtype") else type(x).__name__


def replicated(layout: Layout, axis_name: str) -> Layout:
  """The same layout with every leaf replicated over the data axis (stage 1-2 params)."""
  return Layout(
    layout.treedef,
    tuple(
      leaf._replace(dim=None, padded_size=0, spec=tuple(_without(e, axis_name) for e in leaf.spec))
      for leaf in layout.leaves
    ),
  )
