"""Every layout one parameter tree implies under a transformation's settings, planned once."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._src.core import precision as precision_lib
from zerojax._src.core.state import ZeroState
from zerojax._src.sharding import layout as layout_lib
from zerojax._src.sharding import mesh as mesh_lib

if TYPE_CHECKING:
  from zerojax._src.core.settings import Settings


class Plans(NamedTuple):
  """Every layout that one parameter tree implies.

  Attributes:
    sharded: gradients and master parameters, what the optimizer state mirrors.
    params: the stored parameters: ``sharded`` in stage 3 (in the compute dtype
      with the master copy apart), else replicated in the compute dtype.
    state: the inner optimizer's state.
    master: a separate master copy (stages 1-2 under a lower compute dtype, and
      stage 3 too when it is offloaded), or ``None``.
    loss_scaled: whether the precision policy scales the loss.
  """

  sharded: layout_lib.Layout
  params: layout_lib.Layout
  state: layout_lib.Layout
  master: layout_lib.Layout | None
  loss_scaled: bool

  def to_logical(self, tree: Any) -> Any:
    """Unpads leaves given in stored shape; leaves already in logical shape pass."""
    return to_logical(self.sharded, tree)

  def as_stored(self, tree: Any) -> Any:
    """Each leaf in the stored parameters' shape: padded from its logical shape, or as it is if
    it has that shape already (placed parameters keep their padding: slicing it off and putting
    it back would split a dimension unevenly, which explicit mesh axes refuse)."""
    index = jax.tree.unflatten(self.params.treedef, range(len(self.params.leaves)))

    def stored(leaf: layout_lib.LeafLayout, i: int, x: Any) -> Any:
      if tuple(np.shape(x)) == leaf.stored_shape:
        return x
      return leaf.pad(_to_logical(self.sharded.leaves[i], x))

    return self.params.map(stored, index, tree)

  def to_master(self, tree: Any) -> Any:
    """Logical shape, master dtype."""
    return self.sharded.map(lambda leaf, x: _to_logical(leaf, x).astype(leaf.dtype), tree)

  def state_specs(self) -> ZeroState:
    """The ``PartitionSpec`` of every leaf of the ``ZeroState``."""
    scalar: Any = P()  # a spec where the state holds an array
    return ZeroState(
      inner_state=self.state.specs(),
      master=None if self.master is None else self.master.specs(),
      loss_scale=precision_lib.LossScaleState(scalar, scalar, scalar) if self.loss_scaled else None,
      skipped_steps=scalar,
      pre_clip_grad_norm=scalar,
    )


def to_logical(layout: layout_lib.Layout, tree: Any) -> Any:
  """``tree`` in ``layout``'s logical shapes: stored-shape leaves unpadded, others as they are."""
  return layout.map(_to_logical, tree)


def _to_logical(leaf: layout_lib.LeafLayout, x: Any) -> Any:
  shape = tuple(np.shape(x))
  if shape == leaf.shape:
    return x
  if shape == leaf.stored_shape:
    return leaf.unpad(x)
  raise ValueError(
    f"a leaf has shape {shape}, but this layout expects {leaf.shape} (or "
    f"{leaf.stored_shape} padded): these arrays are from another model or layout."
  )


#: The stored signature of each padded layout planned in this process, with the logical leaves
#: it was planned from: so that a transformation given another's stored parameters first
#: (``tx2.init(tx1.shard(params))``) plans from their logical shapes, not from the padding.
#: Two models may be stored with the same shapes ((16, 13) and (13, 16) as (16, 16)): the
#: placement tells which.
_PADDED: dict[tuple[Any, ...], list[tuple[list[jax.ShapeDtypeStruct], layout_lib.Layout]]] = {}


class Planner:
  """Plans the trees a transformation sees, and remembers each plan.

  Plans are keyed by the logical and the stored signature of each tree, so
  that stored (padded) parameters find the plan made from their full shapes.
  Stored parameters seen first in another container (Flax NNX's
  ``nnx.Optimizer`` passes ``nnx.as_pure`` values of the ``nnx.Param`` s it
  was initialised with), or first from another transformation, are planned
  from the logical leaves they were stored from.
  """

  def __init__(self, settings: Settings):
    self.settings = settings
    self._known: dict[Any, Plans] = {}
    self._padded: dict[Any, tuple[list[jax.ShapeDtypeStruct], layout_lib.Layout]] = {}

  def __call__(self, tree: Any) -> Plans:
    key = layout_lib.signature(tree)
    if key in self._known:
      return self._known[key]
    # Stored parameters in another container, or another transformation's, seen first.
    found = self._padded.get(key[1])
    if found is not None and _placed_as_stored(tree, found[1]) is False:
      found = None  # a model of its own, whose logical shapes are the padded ones
    if found is None and key in _PADDED:
      placed = [_placed_as_stored(tree, layout) for _, layout in _PADDED[key]]
      if None in placed:
        raise _ambiguous_error(tree, _PADDED[key][0][1])
      found = next((entry for entry, p in zip(_PADDED[key], placed, strict=True) if p), None)
    if found is not None:
      logical, layout = found
      own = self(jax.tree.unflatten(key[0], logical))
      if key not in self._known:
        raise _other_layout_error(layout, own)
      return self._known[key]
    plans = self.plan(tree)
    structs = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in jax.tree.leaves(tree)]
    for layout in (plans.sharded, plans.params):
      stored = layout.key(True)
      if stored != layout.key(False):
        self._padded.setdefault(stored[1], (structs, layout))
        entries = _PADDED.setdefault(stored, [])
        if (structs, layout) not in entries:
          entries.append((structs, layout))
      for key_ in (layout.key(False), stored):
        self._known.setdefault(key_, plans)
    self._known[key] = plans
    return plans

  def plan(self, params: Any) -> Plans:
    """Plans every layout that the parameter tree ``params`` implies."""
    settings = self.settings
    precision = settings.precision
    sharded = self.split(params, rule=settings.layout).with_dtypes(precision.master_dtype)
    stored, master = settings.stage.stored(
      sharded,
      precision.compute_dtype,
      settings.data_axes,
      master_apart=settings.offload.moves_master,
    )
    settings.offload.check_master(master is not None)
    logical = sharded.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
    state = self.split(jax.eval_shape(settings.inner.init, logical), like=sharded)
    return Plans(sharded, stored, state, master, precision.loss_scale is not None)

  def split(self, tree: Any, **options: Any) -> layout_lib.Layout:
    """``layout.plan`` of ``tree`` over the data axes of these settings."""
    settings = self.settings
    return layout_lib.plan(
      tree,
      axis_name=settings.data_axes,
      num_shards=settings.num_shards,
      min_shard_size=settings.min_shard_size,
      axis_sizes=dict(settings.mesh.shape),
      replica_axes=settings.replica_axes,
      **options,
    )


def _placed_as_stored(tree: Any, layout: layout_lib.Layout) -> bool | None:
  """Whether ``tree``, shaped like ``layout``'s stored arrays, is placed like them too.

  A padded leaf sharded over the data axes along its padded dimension is
  stored; a numpy array, an array on one device or one placed otherwise is a
  model whose logical shapes happen to be padded ones. Inside ``jax.jit`` under
  a mesh of ``Auto`` axes placements are not part of the types: ``None``.
  """
  verdicts = {_sharded_like(x, leaf) for leaf, x in _padded_leaves(tree, layout)}
  return False if False in verdicts else True if True in verdicts else None


def _padded_leaves(tree: Any, layout: layout_lib.Layout) -> list[tuple[Any, Any]]:
  """``(leaf layout, leaf)`` of every leaf of ``tree`` that ``layout`` pads."""
  pairs = zip(layout.leaves, jax.tree.leaves(tree), strict=True)
  return [(leaf, x) for leaf, x in pairs if leaf.padding]


def _ambiguous_error(tree: Any, layout: layout_lib.Layout) -> ValueError:
  leaf, x = _padded_leaves(tree, layout)[0]
  return ValueError(
    f"these parameters have the padded shapes another zerojax transformation stores (a leaf "
    f"of shape {np.shape(x)} is stored for a logical {leaf.shape}), and inside jax.jit under "
    "a mesh of Auto axes their placement cannot say whether they are padded. Give this "
    "transformation the parameters in their logical shapes the first time (other_tx.gather("
    "params)), or call its init or shard outside jax.jit first."
  )


def _sharded_like(x: Any, leaf: layout_lib.LeafLayout) -> bool | None:
  """Whether ``x`` is split along ``leaf``'s padded dimension as stored; ``None``: unknown."""
  if isinstance(x, Tracer):
    if not mesh_lib.is_explicit(jax.typeof(x).sharding.mesh):
      return None
  elif not (isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding)):
    return False
  assert leaf.dim is not None  # a padded leaf
  return layout_lib.placement(x, np.ndim(x))[leaf.dim] == leaf.spec[leaf.dim]


def _other_layout_error(other: layout_lib.Layout, own: Plans) -> ValueError:
  theirs, ours = next(
    (_describe(a), _describe(b))
    for a, b in zip(other.leaves, own.params.leaves, strict=True)
    if _describe(a) != _describe(b)
  )
  return ValueError(
    "these parameters are stored (padded) by another zerojax transformation, in a layout "
    f"this one does not use (a leaf stored as {theirs}, which this transformation stores as "
    f"{ours}): give it the parameters in their logical shapes, other_tx.gather(params)."
  )


def _describe(leaf: layout_lib.LeafLayout) -> str:
  return f"{leaf.dtype}{list(leaf.stored_shape)}"
