"""The optimizer step of a ZeRO-wrapped optimizer: ``init`` and ``update`` in the global view.

The wrapped optimizer runs on global ``jax.Array`` s constrained to the plan, so
XLA partitions its elementwise math over the data axes and inserts the small
all-reduces that norms need: ``clip_by_global_norm``, LAMB, Adafactor or Muon
compute exactly what they compute unwrapped.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.core import Tracer
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._src.comm import primitives as comm
from zerojax._src.core import checks
from zerojax._src.core import precision as precision_lib
from zerojax._src.core.plans import Planner, Plans, to_logical
from zerojax._src.core.settings import Settings
from zerojax._src.core.state import ZeroState, check_policy, fresh_loss_scale_and_counters
from zerojax._src.sharding import mesh as mesh_lib
from zerojax._src.sharding import stored as stored_lib
from zerojax._src.sharding.layout import Layout, LeafLayout


class ShardedOptimizer:
  """The object behind a ``ZeroTransformation``: its ``init`` and ``update`` are these methods.

  It holds the settings (immutable), the plans of the trees it has seen and
  the jitted functions: caches, which make copies of it pointless, so it is
  its own copy and deep copy.
  """

  def __init__(self, settings: Settings):
    self.settings = settings
    self.plans = Planner(settings)
    self._init = jax.jit(self._init_impl, static_argnames="plans")
    self._update = jax.jit(self._update_impl, static_argnames="plans")

  def __copy__(self) -> ShardedOptimizer:
    return self

  def __deepcopy__(self, memo: dict[int, Any]) -> ShardedOptimizer:
    return self

  def init(self, params: optax.Params) -> ZeroState:
    plans = self.plans(params)
    params = plans.arrays(params, self.settings.mesh)
    if plans.master is not None:
      checks.full_precision(params, plans.sharded)
    if not mesh_lib.is_traced(params):
      checks.same_model_on_every_process(params)
    with mesh_lib.set_mesh_unless_traced(self.settings.mesh, params):
      return self._init(params, plans=plans)

  def update(self, updates, state, params=None, **extra_args):
    plans = self.plans(updates if params is None else params)
    # Updates come back as the parameters are, so that optax.apply_updates sees two trees of
    # one structure: Stored leaves where the parameters have them, and, without the parameters,
    # wherever stage 3 stores them (gradients of jax.grad are plain arrays).
    if params is None:
      wrapped = stored_lib.wraps(updates) or self.settings.stage.splits_params
    else:
      wrapped = stored_lib.wraps(params)
    updates, params = (
      plans.arrays(updates, self.settings.mesh, "updates"),
      plans.arrays(params, self.settings.mesh),
    )
    updates = _onto_mesh(self.settings, plans.sharded, updates)
    check_policy(state, master=plans.master is not None, loss_scaled=plans.loss_scaled)
    checks.shapes(state.inner_state, plans.state, "optimizer state")
    checks.in_device_memory(state, self.settings)
    for what, tree in (("updates", updates), ("opt_state", state), ("params", params)):
      checks.on_mesh(tree, self.settings.mesh, what, "place them with this transformation")
    if plans.master is not None and params is None:
      raise ValueError(
        "this transformation keeps master parameters apart from the (lower-"
        "precision) parameters, so update needs them: call "
        "tx.update(grads, state, params)."
      )
    with mesh_lib.set_mesh_unless_traced(self.settings.mesh, updates, state, params, extra_args):
      new_updates, new_state = self._update(updates, state, params, extra_args, plans=plans)
    return (stored_lib.wrap(plans.params, new_updates) if wrapped else new_updates), new_state

  def gather(self, params: optax.Params) -> optax.Params:
    plans, mesh = self.plans(params), self.settings.mesh
    checks.stored_on_mesh(stored_lib.unwrap(params), mesh)
    params = plans.arrays(params, self.settings.mesh)
    with mesh_lib.set_mesh_unless_traced(mesh, params):
      return _gather(
        params,
        mesh=mesh,
        data_axes=self.settings.data_axes,
        stored=plans.params,
        logical=plans.sharded,
      )

  def fresh_state(self, params: Any, plans: Plans) -> ZeroState:
    """The state ``init`` makes of ``params`` (full precision, logical or stored), as global
    arrays: the caller places it (``state_specs``) and offloads it."""
    settings = self.settings
    master = plans.to_master(params)
    return ZeroState(
      inner_state=plans.state.pad(settings.inner.init(master)),
      master=None if plans.master is None else plans.master.pad(master),
      **fresh_loss_scale_and_counters(settings.precision),
    )

  def _init_impl(self, params, plans: Plans):
    settings = self.settings
    init = lambda params: self.fresh_state(params, plans)
    state = mesh_lib.global_view(settings.mesh, init, plans.state_specs())(params)
    return settings.offload.store(state)

  def _update_impl(self, updates, state, params, extra_args, plans: Plans):
    settings = self.settings
    # Offloaded state is brought to device memory once per step, here, and
    # written back at the end: the inner optimizer never computes in host memory.
    state = settings.offload.fetch(state)

    def update(grads, state, params):
      # Logical shapes sharded like the stored ones: unevenly where padded,
      # which jit allows for intermediates.
      grads = mesh_lib.constrain(settings.mesh, plans.to_master(grads), plans.sharded.specs())
      master = _master(settings.mesh, plans, state, params)
      inner_state = plans.state.unpad(state.inner_state)
      new_updates, new_inner = settings.inner.update(grads, inner_state, master, **extra_args)
      finite = precision_lib.all_finite(grads)
      keep = finite if settings.precision.skip_nonfinite else jnp.asarray(True)
      new_inner = precision_lib.select(keep, new_inner, inner_state)
      new_updates = jax.tree.map(lambda u: _update_or_no_op(keep, u), new_updates)
      new_master = None
      if plans.master is not None:
        # The master copy takes the sum that stored parameters which are the
        # master copy take in optax.apply_updates, padded shape included, so
        # that keeping it apart (stage 3 under offload="optimizer+master")
        # leaves XLA nothing to fuse, and round, differently.
        new_master = optax.apply_updates(state.master, plans.master.pad(new_updates))
        new_updates = _difference(settings.mesh, plans, plans.master.unpad(new_master), params)
        new_updates = jax.tree.map(lambda u: _update_or_no_op(keep, u), new_updates)
      new_state = ZeroState(
        inner_state=plans.state.pad(new_inner),
        master=new_master,
        loss_scale=precision_lib.adjust_loss_scale(settings.precision, state.loss_scale, finite),
        skipped_steps=state.skipped_steps + (~keep).astype(jnp.int32),
        pre_clip_grad_norm=optax.tree.norm(grads).astype(jnp.float32),
      )
      return plans.params.pad(new_updates), new_state

    out_specs = (plans.params.specs(), plans.state_specs())
    new_updates, new_state = mesh_lib.global_view(settings.mesh, update, out_specs)(
      updates, state, params
    )
    return new_updates, settings.offload.store(new_state)


@functools.partial(jax.jit, static_argnames=("mesh", "data_axes", "stored", "logical"))
def _gather(params, *, mesh: Mesh, data_axes: tuple[str, ...], stored: Layout, logical: Layout):
  """Whole parameters, in ``logical`` layout, from parameters stored in ``stored`` layout.

  One program per layout, whatever the inner optimizer: transformations over one model share it.
  """
  specs = stored.map(lambda leaf: leaf.full_spec(data_axes))
  # An offloaded master copy (tx.master_params) is gathered from device memory.
  params = jax.device_put(params, jax.memory.Space.Device)
  return mesh_lib.global_view(mesh, functools.partial(to_logical, logical), specs)(params)


def _onto_mesh(settings: Settings, layout: Layout, updates: Any) -> Any:
  """``updates`` placed where the update can take them, whatever ``jax.grad`` gave.

  The update splits a gradient given in its logical shape as its stored one is split, unevenly
  where that is padded ((30, 100) over 8 devices, say): jit allows that for intermediates, not
  for its arguments. So a leaf that is not on the mesh (a numpy array, an array on one device)
  is replicated on it; and inside a trace (``jax.jit(tx.update)``), where the compiler would
  choose the argument's split from that uneven one, which JAX cannot express, a padded leaf in
  its logical shape is constrained whole over the data axes first.
  """
  unplaced = lambda x: not (isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding))
  replicated = NamedSharding(settings.mesh, P())

  def placed(leaf: LeafLayout, x: Any) -> Any:
    if not isinstance(x, Tracer):
      return jax.device_put(x, replicated) if unplaced(x) else x
    if leaf.padding and tuple(x.shape) == leaf.shape:
      return mesh_lib.constrain(settings.mesh, x, leaf.full_spec(settings.data_axes))
    return x

  return layout.map(placed, updates)


def _master(mesh: Mesh, plans: Plans, state: ZeroState, params: Any) -> Any:
  """The master parameters the inner optimizer sees (``None`` if ``update`` got no params)."""
  if plans.master is not None:
    master = plans.master.unpad(state.master)
  elif params is not None:
    master = plans.to_master(params)
  else:
    return None
  return mesh_lib.constrain(mesh, master, plans.sharded.specs())


def _update_or_no_op(keep: jax.Array, update: jax.Array) -> jax.Array:
  """``update``, or, for a skipped step, one that leaves every parameter bit-identical.

  That is -0.0 for floats: ``x + -0.0 == x`` for every ``x``, -0.0 included
  (``-0.0 + 0.0`` would be +0.0).
  """
  no_op = -0.0 if jnp.issubdtype(update.dtype, jnp.floating) else 0
  return jnp.where(keep, update, jnp.asarray(no_op, update.dtype))


def _difference(mesh: Mesh, plans: Plans, new_master: Any, params: Any) -> Any:
  """Updates that take the compute-dtype ``params`` to ``new_master`` rounded to the compute dtype.

  They are computed in the master dtype, where the difference of two
  compute-dtype values is exact, so that ``optax.apply_updates`` (which adds in
  the wider dtype, then casts back) lands on the rounded master exactly. The
  rounding comes before the replication, so the all-gather moves compute-dtype
  bytes.
  """
  # Pinning the master's sharding, and moving the rounded values as bits, keep
  # the compiler from replicating the master first and rounding afterwards.
  new_master = mesh_lib.constrain(mesh, new_master, plans.sharded.specs())
  bits = plans.params.map(lambda leaf, x: comm.as_bits(x.astype(leaf.dtype)), new_master)
  bits = mesh_lib.constrain(mesh, bits, plans.params.specs())
  return plans.params.map(
    lambda leaf, new, old, wide: (
      comm.from_bits(new, leaf.dtype).astype(wide.dtype) - old.astype(wide.dtype)
    ),
    bits,
    plans.to_logical(params),  # stage 3's stored shards are padded
    new_master,
  )
