"""How a layer's shards become full weights, and where their gradients go: one ``Opening`` each.

Three ways exist, each a strategy with the same three steps, which both
``zerojax.gather`` (through ``open``, which gives them their derivative) and
``zerojax.scan``'s layer loop (which schedules them itself, one layer ahead)
run:

* ``GATHER`` (stage 3): all-gather the shards; their gradients are the
  reduce-scatter of the cotangents, into the shards themselves;
* ``READ`` (stage 2): the replicated copies as they are; the cotangents are
  reduce-scattered into shard-sized sinks;
* ``HIERARCHICAL`` (stage 3 with hpZ): keep the secondary partitions
  (gathered across nodes), then gather inside the node from them; the
  gradients go to the shards, reduced over all the data axes, as ``GATHER``'s.

Quantization and dtypes are the ``Group``'s, the same for every way. A new
way of opening a layer is one more ``Opening`` here.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
from jax.ad_checkpoint import checkpoint_name

from zerojax._src.comm import hierarchical as hpz
from zerojax._src.comm.group import Group


@dataclasses.dataclass(frozen=True)
class Opening:
  """One way of opening a layer's shards (static, hashable).

  Attributes:
    name: what it is called in errors and reprs.
    reads: whether the gradients go to sinks (stage 2) rather than to the
      shards' values.
    keeps: whether the forward pass keeps something per shard (``kept``).
  """

  name: str
  reads: bool = False
  keeps: bool = False

  def kept(self, group: Group, values: Sequence[jax.Array]) -> list[jax.Array]:
    """What the forward pass keeps for the backward pass to open the layer from; none here."""
    del group, values
    return []

  def opened(
    self, group: Group, values: Sequence[jax.Array], kept: Sequence[jax.Array]
  ) -> list[jax.Array]:
    """The layer's full weights, padding sliced off; no derivative rule."""
    del kept
    return group.read(values) if self.reads else group.all_gather(values)

  def reduced(self, group: Group, cotangents: Sequence[jax.Array]) -> list[jax.Array]:
    """The gradient shards of the full weights' ``cotangents``."""
    return group.reduce_scatter(cotangents)


@dataclasses.dataclass(frozen=True)
class _Hierarchical(Opening):
  def kept(self, group: Group, values: Sequence[jax.Array]) -> list[jax.Array]:
    return hpz.secondaries(group, values)

  def opened(
    self, group: Group, values: Sequence[jax.Array], kept: Sequence[jax.Array]
  ) -> list[jax.Array]:
    del values
    return hpz.fulls(group, kept)


GATHER = Opening("gather")
READ = Opening("read", reads=True)
HIERARCHICAL = _Hierarchical("hierarchical", keeps=True)


def of(group: Group, reads: bool) -> Opening:
  """The ``Opening`` of a group: hpZ's under secondary axes, else a read or a gather."""
  if group.secondary_axes:
    return HIERARCHICAL
  return READ if reads else GATHER


def open_layer(
  opening: Opening, group: Group, values: Sequence[jax.Array], sinks: Sequence[jax.Array]
) -> list[jax.Array]:
  """The full weights of ``values`` (this device's shards, or stage 2's copies), differentiable.

  Their derivative rule reduce-scatters the cotangents (``opening.reduced``)
  into ``sinks`` when the opening reads, else into ``values``. What the
  forward pass keeps (hpZ's secondary partitions) is computed without a
  derivative and named ``hpz.SECONDARY``, for remat policies to save.
  """
  frozen = [jax.lax.stop_gradient(value) for value in values]
  kept = [checkpoint_name(k, hpz.SECONDARY) for k in opening.kept(group, frozen)]
  return list(_open(opening, group, tuple(values), tuple(kept), tuple(sinks)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _open(opening: Opening, group: Group, values, kept, sinks):
  del sinks
  return tuple(opening.opened(group, values, kept))


def _open_fwd(opening, group, values, kept, sinks):
  return _open(opening, group, values, kept, sinks), None


def _open_bwd(opening, group, residuals, cotangents):
  del residuals
  grads = tuple(opening.reduced(group, cotangents))
  # None: zero cotangents of the inputs' own types. Explicit zeros would lack
  # their varying axes (the stage axis, inside zerojax.pipeline's stages).
  nothing = tuple(None for _ in cotangents)
  kept = nothing if opening.keeps else ()
  return (nothing, kept, grads) if opening.reads else (grads, kept, ())


_open.defvjp(_open_fwd, _open_bwd)
