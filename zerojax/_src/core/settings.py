"""The settings of a ZeRO-wrapped optimizer: one immutable value, checked once.

``zerojax.zero1/2/3`` turn their keyword arguments into a ``Settings``; every
other part of zerojax reads them from there, under the names the factories
take, so that there is one name per concept.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import optax
from jax.sharding import Mesh

from zerojax._src.comm import hierarchical as hpz
from zerojax._src.comm import quantized as quantize
from zerojax._src.core import offload as offload_lib
from zerojax._src.core import precision as precision_lib
from zerojax._src.core import stages
from zerojax._src.sharding import layout as layout_lib
from zerojax._src.sharding import mesh as mesh_lib


@dataclasses.dataclass(frozen=True, eq=False)
class Settings:
  """What a ``zerojax.zero1/2/3`` call was given, resolved.

  Compared by identity: two transformations built by two calls are different
  transformations, as two ``optax.adam(...)`` calls are.

  Attributes:
    inner: the wrapped transformation (with extra-args support).
    stage: the ZeRO stage's behaviour (``stage.number`` is 1, 2 or 3).
    mesh: the device mesh (a ``jax.sharding.AbstractMesh`` for estimates).
    axis_name: the data-parallel mesh axis (or tuple of axes), as given.
    replica_axis: the replica axis (or tuple of axes), or ``None``.
    layout: the per-leaf override of which dimension is sharded, as given.
    min_shard_size: leaves with fewer elements stay replicated by default.
    precision: the ``zerojax.Precision`` policy.
    quantized_weights: the ``zerojax.Quantization`` of stage 3's weight
      all-gathers, or ``None``.
    quantized_gradients: that of the gradient reductions, or ``None``.
    offload: what lives in host memory between steps (``zerojax/_src/core/offload.py``).
    secondary_axis: hpZ's intra-node data axis (or tuple of axes), or ``None``.
    packed_gathers: whether stage 3 gathers a layer's shards in one
      collective per dtype; ``None``: on GPUs where the data axes cross nodes.
  """

  inner: optax.GradientTransformationExtraArgs
  stage: stages.Stage
  mesh: Any
  axis_name: str | tuple[str, ...] = "data"
  replica_axis: str | tuple[str, ...] | None = None
  layout: Any = None
  min_shard_size: int = layout_lib.DEFAULT_MIN_SHARD_SIZE
  precision: precision_lib.Precision = dataclasses.field(default_factory=precision_lib.Precision)
  quantized_weights: quantize.Quantization | None = None
  quantized_gradients: quantize.Quantization | None = None
  offload: offload_lib.Offload = dataclasses.field(default_factory=offload_lib.Offload)
  secondary_axis: str | tuple[str, ...] | None = None
  packed_gathers: bool | None = None

  @property
  def data_axes(self) -> tuple[str, ...]:
    """The axes the parameters are split over jointly, in their order in a spec's entry.

    ``axis_name``'s order, but under hpZ the secondary axes come first (see
    ``comm/hierarchical.py``): each device's secondary partition is then a contiguous block.
    """
    return hpz.ordered(layout_lib.axes(self.axis_name), self.secondary_axes)

  @property
  def replica_axes(self) -> tuple[str, ...]:
    return layout_lib.axes(self.replica_axis or ())

  @property
  def secondary_axes(self) -> tuple[str, ...]:
    """hpZ's secondary axes in ``axis_name``'s order; ``()`` without hpZ."""
    named = layout_lib.axes(self.secondary_axis or ())
    return tuple(name for name in layout_lib.axes(self.axis_name) if name in named)

  @property
  def batch_axes(self) -> tuple[str, ...]:
    """The replica axes, then ``axis_name``'s, as given (the batch is split in that order)."""
    return self.replica_axes + layout_lib.axes(self.axis_name)

  @property
  def num_shards(self) -> int:
    return math.prod(self.mesh.shape[name] for name in self.data_axes)

  @property
  def num_replicas(self) -> int:
    return math.prod(self.mesh.shape[name] for name in self.replica_axes)

  def __copy__(self) -> Settings:
    return self

  def __deepcopy__(self, memo: dict[int, Any]) -> Settings:
    # Immutable: a copy could only be an equal value, and two settings compare
    # by identity, so the value itself is its own deep copy (as for a tuple of
    # immutable things). The mesh's devices cannot be copied anyway.
    return self


def resolve(
  stage: int,
  inner: Any,
  *,
  mesh: Mesh | None,
  axis_name: str | tuple[str, ...],
  replica_axis: str | tuple[str, ...] | None,
  layout: Any,
  min_shard_size: int,
  precision: precision_lib.Precision | str | None,
  quantized_weights: str | None = None,
  quantized_gradients: str | None,
  quantization_block_size: int,
  offload: str | None = None,
  secondary_axis: str | tuple[str, ...] | None = None,
  packed_gathers: bool | None = None,
) -> Settings:
  """Checks a factory's arguments and resolves them into ``Settings``.

  Raises:
    ValueError: saying which argument is wrong and how to fix it.
  """
  if not hasattr(inner, "init") or not hasattr(inner, "update"):
    raise ValueError(
      f"zero{stage} wraps an optax.GradientTransformation, got {type(inner).__name__}; "
      "pass e.g. optax.adamw(1e-3)."
    )
  if (
    isinstance(min_shard_size, bool)
    or not hasattr(min_shard_size, "__index__")
    or min_shard_size.__index__() < 0
  ):
    raise ValueError(
      "min_shard_size must be an int, 0 or more (the fewest elements a leaf needs to be "
      f"split), got {min_shard_size!r}; e.g. min_shard_size={layout_lib.DEFAULT_MIN_SHARD_SIZE}."
    )
  if packed_gathers is not None and not isinstance(packed_gathers, bool):
    raise ValueError(
      "packed_gathers must be True, False or None (on GPUs, packed where axis_name crosses "
      f"nodes), got {packed_gathers!r}; e.g. packed_gathers=False for one all-gather per weight."
    )
  mesh = mesh_lib.resolve_mesh(mesh, axis_name, replica_axis)
  hpz.resolve(axis_name, secondary_axis, mesh)
  return Settings(
    inner=optax.with_extra_args_support(inner),
    stage=stages.of(stage),
    mesh=mesh,
    axis_name=axis_name,
    replica_axis=replica_axis,
    layout=layout,
    min_shard_size=min_shard_size,
    precision=precision_lib.resolve(precision),
    quantized_weights=quantize.resolve(
      "quantized_weights", quantized_weights, quantization_block_size
    ),
    quantized_gradients=quantize.resolve(
      "quantized_gradients", quantized_gradients, quantization_block_size
    ),
    offload=offload_lib.resolve(offload, mesh),
    secondary_axis=secondary_axis,
    packed_gathers=packed_gathers,
  )
