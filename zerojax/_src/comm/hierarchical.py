"""hpZ, ZeRO++'s hierarchical partitioning: a second copy of each layer, inside a node.

With ``secondary_axis`` stage 3 stores every parameter split over all the data
axes (the primary partition), as without it, and opens a layer in two steps:

1. an all-gather over the data axes that are *not* secondary (across nodes),
   which leaves each device its secondary partition: 1/(devices per node) of
   the layer, in the compute dtype;
2. an all-gather of the secondary partitions over the secondary axes (inside
   the node): the whole layer.

The forward pass keeps the secondary partitions, and the backward pass
gathers the layer again from them with step 2 alone, so it never crosses a
node. The gradient is reduce-scattered over all the data axes at once, as
without hpZ: every weight arrives exactly as it would, and the same sum makes
the gradient, so the numbers are plain stage 3's (to the rounding of two
programs that XLA compiles apart).

The data axes are ordered with the secondary ones first in the parameters'
``PartitionSpec`` (``Settings.data_axes``): on a ``("node", "data")`` mesh,
with ``axis_name=("node", "data"), secondary_axis="data"`` and 4 devices a
node, a parameter is split as ``P(("data", "node"))``, so device ``(n, d)``
stores block ``2d + n`` of 8. Step 1 gathers blocks ``2d`` and ``2d + 1``,
one contiguous quarter of the layer, and step 2 lays the node's quarters side
by side: no gathered layer is reordered (with the node axis first, XLA:GPU
transposes every layer the intra-node step gathers; docs/compression.md).

What is saved for the backward pass is the remat policy's choice: the
secondary partitions carry the ``jax.ad_checkpoint.checkpoint_name``
``SECONDARY``, which ``zerojax.remat_policy`` and ``zerojax.except_gathered``
save (and ``zerojax.scan`` keeps them itself), so the backward pass re-runs
step 2 alone.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from zerojax._src.comm import primitives as comm
from zerojax._src.comm.group import Group
from zerojax._src.sharding import layout as layout_lib

#: ``jax.checkpoint_name`` of every secondary partition (what the backward pass gathers from).
SECONDARY = "zerojax_secondary"


def resolve(axis_name: Any, secondary_axis: Any, mesh: Any) -> tuple[str, ...]:
  """The secondary axes, as a tuple in ``axis_name``'s order, once checked (``()``: no hpZ).

  Only ``zerojax.zero3`` takes ``secondary_axis``: the other stages gather no weights.

  Raises:
    ValueError: if ``secondary_axis`` is not a proper part of ``axis_name``.
  """
  if secondary_axis is None:
    return ()
  example = "axis_name=('node', 'data'), secondary_axis='data'"
  data = layout_lib.axes(axis_name)
  secondary = layout_lib.axes(secondary_axis)
  if not secondary or len(set(secondary)) < len(secondary):
    raise ValueError(
      f"secondary_axis={secondary_axis!r} must name one or more distinct mesh axes, e.g. {example}."
    )
  outside = [name for name in secondary if name not in data]
  if outside:
    name = outside[0]
    what = (
      f"which is not one of axis_name {data}, the axes the parameters are split over"
      if name in mesh.axis_names
      else f"which the mesh does not have (its axes are {mesh.axis_names})"
    )
    raise ValueError(
      f"secondary_axis={secondary_axis!r} names {name!r}, {what}: the secondary copy is split "
      f"over the intra-node axes among the data axes, e.g. {example}."
    )
  if len(secondary) == len(data):
    raise ValueError(
      f"secondary_axis={secondary_axis!r} names every data axis {data}: its copy would be the "
      f"parameters' own split, and no gather would stay inside a node. Name the intra-node axes "
      f"only ({example}), or drop secondary_axis."
    )
  _warn_if_not_intra_node(secondary_axis, secondary, mesh, example)
  return tuple(name for name in data if name in secondary)


#: Axis names that say the axis crosses nodes (hosts, slices), which hpZ's secondary axis must not.
_CROSS_NODE_NAME = re.compile(r"(inter_?)?(node|host|slice|dcn|process)(es|s)?", re.IGNORECASE)


def _warn_if_not_intra_node(
  secondary_axis: Any, secondary: tuple[str, ...], mesh: Any, example: str
) -> None:
  """Warns if the secondary axes have one device, or cross processes (or are named so)."""
  sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
  size = math.prod(sizes[name] for name in secondary)
  shape = ", ".join(f"{name!r}: {n}" for name, n in sizes.items())
  if size == 1:
    warnings.warn(
      f"secondary_axis={secondary_axis!r} has 1 device (the mesh is {{{shape}}}): each "
      "device's secondary partition is then the whole layer, and the forward pass keeps every "
      "layer's for the backward pass, the whole model on every device, for no less traffic "
      f"across nodes. Name the intra-node axes, of more than one device ({example}), or drop "
      "secondary_axis.",
      UserWarning,
      stacklevel=6,
    )
    return
  # Each row: the devices of one secondary partition's group, which must share a node.
  groups = np.moveaxis(
    mesh.devices, [mesh.axis_names.index(name) for name in secondary], range(-len(secondary), 0)
  ).reshape(-1, size)
  spans = any(len({device.process_index for device in group}) > 1 for group in groups)
  # The mesh's own processes, not jax.process_count(): that starts the default backend, which
  # a process compiling for a TPU it does not have (deviceless) cannot.
  one_process = len({device.process_index for device in mesh.devices.flat}) == 1
  named = one_process and any(_CROSS_NODE_NAME.fullmatch(n) for n in secondary)
  if spans or named:
    why = "its devices are in more than one process" if spans else "its name says so"
    warnings.warn(
      f"secondary_axis={secondary_axis!r} looks like an axis across nodes ({why}): hpZ keeps "
      "its secondary copy over secondary_axis so that the backward pass gathers over the fast "
      "links inside a node; across nodes it gathers over the slow ones, twice. Name the "
      f"intra-node axes ({example}).",
      UserWarning,
      stacklevel=6,
    )


def ordered(data_axes: tuple[str, ...], secondary_axes: tuple[str, ...]) -> tuple[str, ...]:
  """The data axes in the order that splits a parameter: the secondary ones first.

  Example:
    >>> ordered(("node", "data"), ("data",)), ordered(("node", "data"), ())
    (('data', 'node'), ('node', 'data'))
  """
  return secondary_axes + cross_axes(data_axes, secondary_axes)


def cross_axes(data_axes: tuple[str, ...], secondary_axes: tuple[str, ...]) -> tuple[str, ...]:
  """The data axes that are not secondary: those that cross nodes, in ``data_axes``' order."""
  return tuple(name for name in data_axes if name not in secondary_axes)


def secondaries(group: Group, values: Sequence[jax.Array]) -> list[jax.Array]:
  """Step 1: each shard's secondary partition (gathered across nodes), in the compute dtype.

  With ``group.weights`` the shards move quantized (qwZ) and arrive
  dequantized: the secondary partition holds exactly what a one-step gather
  would have made of them. No derivative rule: ``gather`` gives one.
  """
  cross = cross_axes(layout_lib.axes(group.axis_name), group.secondary_axes)
  return [
    comm.all_gather(value, layout_lib.entry(cross), t.axis, t.compute, group.weights)
    for t, value in zip(group.transfers, values, strict=True)
  ]


def fulls(group: Group, kept: Sequence[jax.Array]) -> list[jax.Array]:
  """Step 2: the full weights from the secondary partitions, gathered inside the node.

  The group's data axes start with its secondary axes (``ordered``), so the
  node's secondary partitions, laid side by side, are the (padded) layer.
  Narrow dtypes move as their bits (``comm.as_bits``). Padding sliced off; no
  derivative rule.
  """
  secondary = layout_lib.entry(group.secondary_axes)
  result = []
  for transfer, value in zip(group.transfers, kept, strict=True):
    bits = comm.as_bits(value) if value.dtype.itemsize < 4 else value
    full = jax.lax.all_gather(bits, secondary, axis=transfer.axis, tiled=True)
    full = comm.from_bits(full, value.dtype) if full.dtype != value.dtype else full
    result.append(jax.lax.slice_in_dim(full, 0, transfer.size, axis=transfer.axis))
  return result
