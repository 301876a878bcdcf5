"""Every layout one parameter tree implies under a transformation's settings, planned once."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from zerojax._src.core import checks
from zerojax._src.core import precision as precision_lib
from zerojax._src.core.state import ZeroState
from zerojax._src.sharding import layout as layout_lib
from zerojax._src.sharding import mesh as mesh_lib
from zerojax._src.sharding import stored as stored_lib

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

  def arrays(self, tree: Any, mesh: Any, what: str = "params") -> Any:
    """``tree`` as plain arrays of these plans: a ``Stored`` leaf in the stored layout (or the
    gradients') is its array; one stored in another layout (by another transformation) is
    laid out again on ``mesh`` through its logical value, as this one stores it.

    Raises:
      ValueError: for a leaf stored in another layout on another mesh than ``mesh`` (``what``
        names the tree in the message).
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=stored_lib.is_stored)

    def array(i: int, path: Any, x: Any) -> Any:
      if not stored_lib.is_stored(x):
        return x
      ours = self.params.leaves[i]
      if x.layout in (ours, self.sharded.leaves[i]):
        return x.value
      checks.stored_on_mesh(x.value, mesh, f"{what}{jax.tree_util.keystr(path)}")
      # Unpadding splits unevenly, which explicit axes refuse outside the global view.
      relaid = mesh_lib.global_view(
        mesh, lambda v: ours.pad(x.layout.unpad(v)), ours.partition_spec
      )
      return relaid(x.value) if mesh_lib.is_traced(x.value) else jax.jit(relaid)(x.value)

    return jax.tree.unflatten(treedef, [array(i, *leaf) for i, leaf in enumerate(leaves)])

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


class Planner:
  """Plans the trees a transformation sees, and remembers each plan.

  A tree holding ``zerojax.Stored`` leaves (stage 3's stored parameters, and
  the gradients and updates that mirror them) is planned from the logical
  shapes its leaves carry, and each leaf's layout is checked against the
  plan. A plain tree is logical, or has the stored (padded) shapes of a plan
  this transformation has made already: plans are remembered under the
  logical and the stored signature of each layout they hold.
  """

  def __init__(self, settings: Settings):
    self.settings = settings
    self._known: dict[Any, Plans] = {}

  def __call__(self, tree: Any) -> Plans:
    if stored_lib.wraps(tree):
      return self._of_stored(tree)
    key = layout_lib.signature(tree)
    if key not in self._known:
      plans = self.plan(tree)
      for layout in (plans.sharded, plans.params):
        for stored in (False, True):
          self._known.setdefault(layout.key(stored), plans)
      self._known[key] = plans
    return self._known[key]

  def _of_stored(self, tree: Any) -> Plans:
    """The plans of a tree with ``Stored`` leaves, made from their logical shapes."""
    return self(stored_lib.logical(tree))

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
