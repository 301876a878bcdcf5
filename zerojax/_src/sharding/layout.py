"""The layout plan: for every leaf, which dimension is sharded over the data axes.

The plan is computed once, from shapes and the leaves' own placements, and
every other module reads it. A leaf is either replicated over the data axes or
sharded along exactly one dimension, on its own or jointly with mesh axes the
user already placed it on (tensor parallelism). A sharded dimension that does
not divide by the number of shards is padded with zeros up to the next
multiple, because tiled collectives and ``jax.device_put`` both need even
shards.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._src.sharding import stored as stored_lib

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

  def full_spec(self, axis_name: str | tuple[str, ...]) -> P:
    """The spec of the gathered array: the data axes removed, others kept."""
    return _trimmed(tuple(_without(entry, axis_name) for entry in self.spec))

  def pad(self, x: jax.Array) -> jax.Array:
    """Appends zeros along ``dim`` (a no-op when no padding is needed)."""
    if self.dim is None or not self.padding:
      return x
    return pad_to(x, self.dim, self.padded_size)

  def unpad(self, x: jax.Array) -> jax.Array:
    """Drops the padding along ``dim`` (a no-op when there is none)."""
    if self.dim is None or not self.padding:
      return x
    return jax.lax.slice_in_dim(x, 0, self.shape[self.dim], axis=x.ndim + self.dim)


def pad_to(x: jax.Array, axis: int, size: int) -> jax.Array:
  """``x`` with zeros appended along ``axis`` (negative counts from the end) up to ``size``.

  Example:
    >>> import jax.numpy as jnp
    >>> pad_to(jnp.ones((2, 3)), -1, 4).tolist()
    [[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]]
  """
  axis = axis % x.ndim
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


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

  treedef: jax.tree_util.PyTreeDef  # pyright: ignore[reportInvalidTypeForm] (a variable in jax)
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
    # A stage-3 parameter's Stored node stands for its array here: the layout is the node's.
    leaves, treedef = jax.tree.flatten(stored_lib.unwrap(tree))
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


def default_shard_dim(
  shape: tuple[int, ...],
  num_shards: int,
  free_dims: Any = None,
  taken: dict[int, int] | None = None,
) -> int | None:
  """The dimension the default rule shards, counted from the end.

  The leading dimension of a leaf with two or more dimensions is never chosen:
  it is the layer dimension of stacked (scanned) weights, and a scan body must
  see a whole layer's shard. When another mesh axis splits that leading
  dimension (pipeline stages: ``(stages, layers, ...)``), the next one is the
  stage's layer dimension and is not chosen either, for three or more
  dimensions. Among the other dimensions, one that divides by
  ``num_shards`` is preferred (no padding), and among those the most major
  (first). A dimension other mesh axes already split (``taken``) is shared
  only when no free one divides: the data axes then split it jointly, and it
  must divide by ``num_shards`` times those axes' size. If nothing divides,
  the largest free dimension is padded (a taken one if none is free). A
  dimension of size 1 is never chosen: padded, each device would store as much
  as the whole leaf.

  Args:
    shape: the leaf's logical shape.
    num_shards: the number of data shards (the data axes' size).
    free_dims: dimensions (non-negative) that may be chosen; all by default.
    taken: for dimensions that other mesh axes split, how many ways.

  Returns:
    A negative dimension index, or ``None`` (replicate) when no dimension can be split.

  Example:
    >>> import zerojax
    >>> zerojax.default_shard_dim((16, 512, 512), 8)  # stacked layers: never dim 0
    -2
    >>> zerojax.default_shard_dim((16, 512), 8, taken={1: 2})  # joins a tensor-parallel axis
    -1
    >>> zerojax.default_shard_dim((2, 8, 512, 512), 8, taken={0: 2})  # pipeline stages' layers
    -2
    >>> print(zerojax.default_shard_dim((4096, 1), 8))  # a Dense(1) kernel stays replicated
    None
  """
  ndim = len(shape)
  taken = taken or {}
  stacked = 2 if ndim >= 3 and 0 in taken else 1 if ndim >= 2 else 0  # leading layer dims
  candidates = [d for d in range(stacked, ndim) if shape[d] > 1]
  if free_dims is not None:
    candidates = [d for d in candidates if d in free_dims]
  free = [d for d in candidates if d not in taken]
  joint = [d for d in candidates if d in taken]
  # The most major dimension that divides: its shards are contiguous blocks,
  # which collectives move several times faster than strided ones (measured on
  # XLA:CPU: a reduce-scatter over dim 0 of a 1024x1024 block is ~10x faster
  # than over dim 1), and inside a scan body dim 1 of a stacked leaf is dim 0.
  # With no divisible dimension, pad the largest: the least padding relative
  # to the leaf.
  for group in (free, joint):
    divisible = [d for d in group if shape[d] % (num_shards * taken.get(d, 1)) == 0]
    if divisible:
      return divisible[0] - ndim
  for group in (free, joint):
    if group:
      return max(group, key=lambda d: (shape[d], d)) - ndim
  return None


def plan(
  tree: Any,
  *,
  axis_name: str | tuple[str, ...],
  num_shards: int,
  shard: bool = True,
  rule: LayoutRule | Any | None = None,
  min_shard_size: int = DEFAULT_MIN_SHARD_SIZE,
  like: Layout | None = None,
  axis_sizes: dict[str, int] | None = None,
  replica_axes: tuple[str, ...] = (),
) -> Layout:
  """Plans the layout of a pytree of arrays or ``jax.ShapeDtypeStruct`` s.

  Mesh axes that a leaf's own sharding already names (tensor parallelism) are
  kept; the data axes are added on another dimension, or jointly on one of
  those when no other divides (see ``default_shard_dim``).

  Args:
    tree: the pytree, in logical shapes.
    axis_name: the data-parallel mesh axis, or axes sharded over jointly.
    num_shards: the number of data shards (the data axes' size).
    shard: if False, every leaf is replicated over the data axes (stage 1 and
      2 parameters); other mesh axes in the leaves' shardings are still kept.
    rule: per-leaf override: either a callable ``(path, leaf) -> PartitionSpec |
      None`` or a pytree (a prefix of ``tree``) of ``PartitionSpec`` or
      ``None``. A spec names the dimension sharded over ``axis_name`` (``P()``
      keeps the leaf replicated) and may name other mesh axes, which it then
      sets for the leaf; ``None`` falls back to the default rule.
    min_shard_size: leaves with fewer elements stay replicated by default.
    like: a layout whose leaves' specs are reused for leaves of this tree with
      the same shape whose path ends with theirs (so ``mu`` and ``nu`` of Adam
      are sharded exactly like the parameters they mirror).
    axis_sizes: the sizes of the mesh's other axes, for the padding of a
      dimension the data axes share with them; missing axes count as 1.
    replica_axes: axes everything is replicated over (hybrid sharding): a leaf
      placed on one of them is an error.

  Returns:
    The ``Layout``.

  Raises:
    ValueError: for a leaf that is not an array, an override that does not fit
      its leaf, or a leaf placed on a replica axis or with the data axes on a
      dimension the plan cannot keep.
  """
  paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  overrides = _overrides(rule, tree, treedef, paths_and_leaves)
  mirrors = _mirrors(like)
  context = _Context(
    data_axes=axes(axis_name),
    replica_axes=tuple(replica_axes),
    num_shards=num_shards,
    axis_sizes=dict(axis_sizes or {}),
    shard=shard,
    min_shard_size=min_shard_size,
  )
  leaves = [
    _plan_leaf(path, leaf, override, context, mirrors)
    for (path, leaf), override in zip(paths_and_leaves, overrides, strict=True)
  ]
  return Layout(treedef, tuple(leaves))


def axes(axis_name: str | tuple[str, ...]) -> tuple[str, ...]:
  """``axis_name`` as a tuple of mesh axis names.

  Example:
    >>> axes("data"), axes(("x", "y"))
    (('data',), ('x', 'y'))
  """
  return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def entry(names: tuple[str, ...]) -> Any:
  """A ``PartitionSpec`` entry for ``names``: the name itself when there is one, else the tuple."""
  return names[0] if len(names) == 1 else names


class _Context(NamedTuple):
  """What every leaf of one plan is planned with."""

  data_axes: tuple[str, ...]
  replica_axes: tuple[str, ...]
  num_shards: int
  axis_sizes: dict[str, int]
  shard: bool
  min_shard_size: int


def check_arrays(tree: Any) -> None:
  """Raises unless every leaf of ``tree`` is an array (or has a shape and a dtype).

  Raises:
    ValueError: naming the first leaf that is not (a Python float, a string).
  """
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    _check_array(jax.tree_util.keystr(path), leaf)


def _check_array(where: str, leaf: Any) -> None:
  if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
    raise ValueError(
      f"leaf at {where} is {type(leaf).__name__}, not an array; zerojax shards pytrees "
      "of arrays only. Convert it with jnp.asarray, or keep it out of the "
      "params/optimizer state."
    )


def _plan_leaf(path, leaf, override, context: _Context, mirrors) -> LeafLayout:
  where = jax.tree_util.keystr(path)
  _check_array(where, leaf)
  shape = tuple(int(s) for s in leaf.shape)
  dtype = _canonical(leaf.dtype)
  placed = placement(leaf, len(shape))
  _check_replica_axes(placed, context.replica_axes, where)
  base = tuple(_without(e, context.data_axes) for e in placed)
  placed_dim = _data_dim(placed, context.data_axes, where)
  dim = None
  if override is not None:
    dim, base = _dim_from_spec(override, shape, context.data_axes, path)
    _check_replica_axes(base, context.replica_axes, where)
    if not context.shard:
      dim = None
  elif (mirrored := _mirrored(mirrors, path, shape)) is not None and not any(placed):
    # Optimizer state, created from shapes, has no placement: it takes the
    # placement of the parameter it mirrors.
    dim = mirrored.dim if context.shard else None
    base = tuple(_without(e, context.data_axes) for e in mirrored.spec)
  else:
    if context.shard and _is_shardable(dtype) and math.prod(shape) >= context.min_shard_size:
      taken = {d: _size(e, context.axis_sizes) for d, e in enumerate(base) if e is not None}
      dim = default_shard_dim(shape, context.num_shards, taken=taken)
    if placed_dim is not None and placed_dim != dim:
      raise ValueError(
        f"leaf {where} is placed with the data axes {context.data_axes} on dimension "
        f"{len(shape) + placed_dim} of shape {shape}, but the layout shards "
        f"{'no dimension' if dim is None else f'dimension {len(shape) + dim}'} over them. "
        "Place it without the data axes (zerojax adds them), or choose the dimension "
        "with layout=..."
      )
  spec = list(base)
  padded_size = 0
  if dim is not None:
    multiple = context.num_shards * _size(base[dim], context.axis_sizes)
    padded_size = -(-shape[dim] // multiple) * multiple
    spec[dim] = _joined(base[dim], context.data_axes)
  return LeafLayout(shape, dtype, dim, padded_size, tuple(spec))


def _is_shardable(dtype: np.dtype) -> bool:
  # Integer and boolean leaves (step counters, masks) pass through replicated.
  return jnp.issubdtype(dtype, jnp.inexact)


def placement(leaf, ndim: int) -> tuple[Any, ...]:
  """The leaf's current ``PartitionSpec`` entries, one per dimension (all ``None`` if unplaced).

  A tracer (``tx.shard`` under ``jax.eval_shape`` or ``jax.jit``) has its
  placement in its type, under explicit axes.
  """
  tracer = isinstance(leaf, Tracer)
  sharding = jax.typeof(leaf).sharding if tracer else getattr(leaf, "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None:
    return (None,) * ndim
  return tuple(spec) + (None,) * (ndim - len(spec))


def _names(entry: Any) -> tuple[str, ...]:
  """The mesh axes a ``PartitionSpec`` entry names."""
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _size(entry: Any, axis_sizes: dict[str, int]) -> int:
  """How many ways the axes of a ``PartitionSpec`` entry split a dimension."""
  return math.prod(axis_sizes.get(name, 1) for name in _names(entry))


def _joined(base: Any, data_axes: tuple[str, ...]) -> Any:
  """The entry of a dimension split by ``base``'s axes (major) and the data axes (minor)."""
  return entry(_names(base) + data_axes)


def _without(entry_: Any, data_axes: str | tuple[str, ...]) -> Any:
  """A ``PartitionSpec`` entry with the data axes removed."""
  rest = tuple(name for name in _names(entry_) if name not in axes(data_axes))
  return entry(rest) if rest else None


def _data_dim(entries: tuple[Any, ...], data_axes: tuple[str, ...], where: str) -> int | None:
  """The dimension (negative) whose entry names the data axes, or None."""
  dims = [d for d, e in enumerate(entries) if set(_names(e)) & set(data_axes)]
  if len(dims) > 1:
    raise ValueError(
      f"{where} is placed with the data axes {data_axes} on {len(dims)} dimensions; zerojax "
      "shards a leaf over them along one dimension. Place it without the data axes."
    )
  return dims[0] - len(entries) if dims else None


def _check_replica_axes(entries: tuple[Any, ...], replica_axes: tuple[str, ...], where) -> None:
  named = sorted({name for e in entries for name in _names(e)} & set(replica_axes))
  if named:
    raise ValueError(
      f"leaf {where} is placed on the replica axes {named}; everything is replicated "
      "over replica axes (only the batch is split over them). Place it without them."
    )


def _dim_from_spec(spec: P, shape, data_axes: tuple[str, ...], path) -> tuple[int | None, tuple]:
  """Reads an override ``PartitionSpec``: which dim the data axes are on, and the rest."""
  where = jax.tree_util.keystr(path)
  name = entry(data_axes)
  if not isinstance(spec, P):
    raise ValueError(
      f"layout override for {where} is {spec!r}; give a PartitionSpec such as "
      f"P(None, {name!r}) to shard dim 1, P() to replicate, or None for the default."
    )
  if len(spec) > len(shape):
    raise ValueError(
      f"layout override {spec} for {where} has {len(spec)} entries but the leaf has shape {shape}."
    )
  entries = tuple(spec) + (None,) * (len(shape) - len(spec))
  for e in entries:
    named = set(_names(e)) & set(data_axes)
    if named and tuple(n for n in _names(e) if n in data_axes) != data_axes:
      raise ValueError(
        f"layout override {spec} for {where} names {sorted(named)} but not as {data_axes}: "
        f"name all the data axes together, in that order ({name!r})."
      )
  dims = [d for d, e in enumerate(entries) if set(_names(e)) & set(data_axes)]
  if len(dims) > 1:
    raise ValueError(f"layout override {spec} for {where} names {name!r} more than once.")
  base = tuple(_without(e, data_axes) for e in entries)
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


def _mirrors(like: Layout | None) -> list[tuple[tuple[Any, ...], tuple[int, ...], LeafLayout]]:
  """(path, shape, leaf) of every leaf of ``like`` split over any axis, longest paths first."""
  if like is None:
    return []
  flat, _ = jax.tree_util.tree_flatten_with_path(
    like.tree(), is_leaf=lambda x: isinstance(x, LeafLayout)
  )
  found = [(tuple(path), leaf.shape, leaf) for path, leaf in flat if any(leaf.spec)]
  return sorted(found, key=lambda item: -len(item[0]))


def _mirrored(mirrors, path, shape) -> LeafLayout | None:
  """The sharded leaf of ``like`` whose path ``path`` ends with, of the same shape."""
  path = tuple(path)
  for mirror_path, mirror_shape, leaf in mirrors:
    if mirror_shape == shape and path[len(path) - len(mirror_path) :] == mirror_path:
      return leaf
  return None


def _dtype_of(x: Any) -> np.dtype | str:
  # Not an array: the type's name keeps signatures hashable; ``plan`` then raises.
  return _canonical(x.dtype) if hasattr(x, "dtype") else type(x).__name__


def _canonical(dtype: Any) -> np.dtype:
  """The dtype JAX gives an array of ``dtype``: float64 numpy parameters are placed as float32
  unless 64-bit mode is on, and plan as the arrays they become."""
  return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


def replicated(layout: Layout, axis_name: str | tuple[str, ...]) -> Layout:
  """The same layout with every leaf replicated over the data axes (stage 1-2 params)."""
  return Layout(
    layout.treedef,
    tuple(
      leaf._replace(dim=None, padded_size=0, spec=tuple(_without(e, axis_name) for e in leaf.spec))
      for leaf in layout.leaves
    ),
  )
