"""Per-device memory of model states and bytes moved per step, predicted before compiling."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from zerojax._src.comm import quantized as quantize
from zerojax._src.core import offload as offload_lib
from zerojax._src.core import precision as precision_lib
from zerojax._src.core import stages
from zerojax._src.core.plans import Planner
from zerojax._src.core.settings import Settings
from zerojax._src.core.state import fresh_loss_scale_and_counters
from zerojax._src.pipeline.stage import reduces_once
from zerojax._src.sharding import layout as layout_lib

STAGES = stages.NUMBERS


class MemoryEstimate(NamedTuple):
  """Bytes per device of the model states (activations and temporaries not included).

  The first four fields count device memory; ``host`` counts what ``offload``
  keeps in host memory for the device (a host of 8 devices holds 8 times that),
  ``secondary`` what hpZ holds during a step, and ``host_activations`` the
  activations a step offloads to host memory, as the caller gave them.

  Attributes:
    params: parameters.
    grads: gradients.
    optimizer_state: optimizer state (with fp32 master weights, if any), in
      device memory.
    total: the sum of the three: the device memory the model states take.
    host: optimizer state (and master weights) offloaded to host memory; 0
      without ``offload``.
    secondary: hpZ's secondary partitions, in device memory from each
      layer's forward gather to its backward gather (a temporary of the step,
      as activations are, so not in ``total``): every layer's 1/(devices per
      node), in the compute dtype; 0 without hpZ.
    host_activations: activations offloaded to host memory during a step
      (``save_and_offload_only_these_names``), from each layer's forward pass
      to its backward pass: ``num_layers`` x ``offloaded_activation_bytes``.
      A temporary of the step, so neither in ``total`` nor in ``host`` (the
      model states between steps); the host memory a device needs at the
      step's peak is ``host + host_activations``. 0 unless given.

  Example:
    >>> import zerojax
    >>> estimate = zerojax.estimate_memory(7.5e9, num_devices=64, stage=3)
    >>> [round(gigabytes / 1e9, 2) for gigabytes in estimate]
    [0.23, 0.23, 1.41, 1.88, 0.0, 0.0, 0.0]
    >>> offloaded = zerojax.estimate_memory(7.5e9, num_devices=64, stage=3, offload="optimizer")
    >>> round(offloaded.total / 1e9, 2), round(offloaded.host / 1e9, 2)
    (0.94, 0.94)
  """

  params: float
  grads: float
  optimizer_state: float
  total: float
  host: float = 0.0
  secondary: float = 0.0
  host_activations: float = 0.0


def _check(
  num_devices: int,
  stage: int,
  replicas: int = 1,
  tensor_parallel: int = 1,
  offload: str | None = None,
  pipeline_stages: int = 1,
) -> stages.Stage:
  """The ``Stage`` numbered ``stage``, once the counts (and ``offload``) are checked."""
  offload_lib.resolve(offload, None)
  if offload is not None and stage == 0:
    raise ValueError(
      f"offload={offload!r} is estimated for zerojax's stages 1 to 3, whose state it moves; "
      "pass stage=1, 2 or 3 (stage 0, plain data parallelism, is the baseline)."
    )
  for name, value in (
    ("num_devices", num_devices),
    ("replicas", replicas),
    ("tensor_parallel", tensor_parallel),
    ("pipeline_stages", pipeline_stages),
  ):
    if not hasattr(value, "__index__") or isinstance(value, bool) or value < 1:
      raise ValueError(f"{name} must be a whole number, at least 1, got {value!r}.")
  return stages.of(stage)


def _nodes(
  num_devices: int, stage: int, secondary_devices: int | None, pipeline_stages: int
) -> int:
  """hpZ's number of nodes (groups of ``secondary_devices``); 1 without hpZ.

  Raises:
    ValueError: for hpZ at a stage other than 3, in pipeline stages, or a
      group size that does not split the data axes into two or more groups.
  """
  if secondary_devices is None:
    return 1
  if pipeline_stages > 1:
    raise ValueError(
      "secondary_devices (hpZ) with pipeline_stages is not modelled: the estimator counts hpZ's "
      "secondary partitions over a flat data axis. Estimate one pipeline stage's data group "
      "(pipeline_stages=1, num_params divided by the stages) with secondary_devices."
    )
  if stage != 3:
    raise ValueError(
      f"secondary_devices (hpZ) is stage 3's secondary copy of the gathered weights; stage "
      f"{stage} gathers none. Pass stage=3, or drop secondary_devices."
    )
  if secondary_devices < 1 or num_devices % secondary_devices or num_devices == secondary_devices:
    raise ValueError(
      f"secondary_devices={secondary_devices} must divide num_devices={num_devices} (the data "
      "axes) into two or more nodes: it is the size of the intra-node data axes, e.g. "
      "num_devices=64, secondary_devices=8 for 8 nodes of 8."
    )
  return num_devices // secondary_devices


def _devices_per_node(
  num_devices: int, devices_per_node: int | None, secondary_devices: int | None
) -> int:
  """The devices of a node's data axes: ``devices_per_node``, else hpZ's, else 1 (one round).

  Raises:
    ValueError: for a count that is not whole, does not divide ``num_devices``,
      or differs from ``secondary_devices``.
  """
  if devices_per_node is None:
    return secondary_devices or 1
  if not hasattr(devices_per_node, "__index__") or isinstance(devices_per_node, bool):
    raise ValueError(f"devices_per_node must be a whole number, got {devices_per_node!r}.")
  if devices_per_node < 1 or num_devices % devices_per_node:
    raise ValueError(
      f"devices_per_node={devices_per_node} must divide num_devices={num_devices}: it is the "
      "size of the data axes inside a node (the last axis of axis_name, or hpZ's secondary "
      "axes), e.g. num_devices=64, devices_per_node=8 for 8 nodes of 8."
    )
  if secondary_devices is not None and devices_per_node != secondary_devices:
    raise ValueError(
      f"devices_per_node={devices_per_node} differs from secondary_devices={secondary_devices}: "
      "under hpZ the secondary axes are the node's, and qgZ's first round runs over them. "
      "Leave devices_per_node out."
    )
  return int(devices_per_node)


def _share(splits: bool, whole: float, split: float, num_devices: int) -> float:
  """Bytes per device: ``split / N`` if the stage splits this model state, else ``whole``."""
  return split / num_devices if splits else float(whole)


def _estimate(params, grads, state, host=0.0, secondary=0.0, activations=0.0) -> MemoryEstimate:
  return MemoryEstimate(params, grads, state, params + grads + state, host, secondary, activations)


def estimate_memory(
  num_params: float,
  *,
  num_devices: int,
  stage: int,
  replicas: int = 1,
  tensor_parallel: int = 1,
  param_bytes: float = 2,
  grad_bytes: float = 2,
  state_bytes: float = 12,
  master_bytes: float = 4,
  offload: str | None = None,
  pipeline_stages: int = 1,
  pipeline_reduce: str | None = None,
  secondary_devices: int | None = None,
  offloaded_activation_bytes: float = 0,
  num_layers: int = 1,
) -> MemoryEstimate:
  """Per-device bytes of parameters, gradients and optimizer state at a ZeRO stage.

  The defaults are the ZeRO paper's mixed-precision Adam: 2-byte parameters and
  gradients, and K = 12 bytes of state per parameter (fp32 master weights,
  momentum and variance). Stage 0 is plain data parallelism.

  With ``offload``, what ``zerojax.zero1/2/3(..., offload=...)`` keeps in host
  memory moves from ``optimizer_state`` to ``host``: ``"optimizer"`` moves
  the state but the master weights (K - 4 bytes per parameter by default),
  ``"optimizer+master"`` all of it. The master weights are part of K when the
  parameters are stored in fewer bytes than they (``param_bytes <
  master_bytes``); otherwise the parameters are the master weights and K is
  all optimizer state.

  On a multi-axis mesh, ``num_devices`` is the size of the data axes only:
  ``replicas`` (hybrid sharding) multiply the devices but not the bytes per
  device, and ``tensor_parallel`` divides every model state by its degree, as
  if every parameter were split over the tensor-parallel axis (layers that
  stay replicated over it, such as norms, cost more). The job then has
  ``replicas * num_devices * tensor_parallel`` devices.

  With ``pipeline_stages`` S above 1 (``zerojax.pipeline``), each device holds
  one stage's share of the model, Ψ / S, as if every parameter were in the
  pipelined layers; the job has S times the devices. Reducing once per step
  (``pipeline_reduce="step"``, stage 2's default) sums a stage's gradients at
  full size during the step, so ``grads`` is Ψ / S, as at stage 1; at stage 3
  the stage's gathered weights are held for the step too (in ``params``).
  ``"microbatch"`` (stage 3's default) keeps ZeRO's shares and reduces every
  micro-batch. Activations come on top: the schedule holds
  ``zerojax.pipeline_timetable(...).in_flight`` micro-batches of them.

  With ``secondary_devices`` (stage 3's hpZ, ``zerojax.zero3(...,
  secondary_axis=...)``, whose intra-node data axes have that size), the
  model states are those of stage 3, and ``secondary`` counts the secondary
  partitions a step holds: Ψ x ``param_bytes`` / ``secondary_devices``.

  Activations are not estimated (they depend on the model's code, the batch
  and the checkpoint policy), but those a layer's checkpoint policy offloads
  to host memory (``jax.checkpoint_policies.save_and_offload_only_these_names``)
  are host memory a step needs on top of ``host``: give the bytes one layer
  offloads on one device as ``offloaded_activation_bytes`` (the named
  activations of its share of the batch; for one ``[tokens, width]`` value,
  tokens per device x width x its dtype's bytes) and the layers as
  ``num_layers``, and ``host_activations`` is their product, what
  ``jax.lax.scan`` of the layer holds. Compiled, ``zerojax.scan`` holds about
  that: it hands the last layer's activations straight to the backward pass,
  which XLA:GPU keeps on the device (``num_layers - 1`` layers' in host
  memory) and XLA:TPU sends to host memory and back (docs/offload.md,
  "Activations to host memory").

  Args:
    num_params: Ψ, the number of parameters.
    num_devices: N, the size of the data-parallel axes.
    stage: 0, 1, 2 or 3.
    replicas: the size of the replica axes (hybrid sharding).
    tensor_parallel: the size of the tensor-parallel axes.
    param_bytes: bytes per parameter as stored for compute.
    grad_bytes: bytes per gradient element.
    state_bytes: K, optimizer-state bytes per parameter.
    master_bytes: bytes per parameter of the master weights.
    offload: ``None``, ``"optimizer"`` or ``"optimizer+master"``.
    pipeline_stages: S, the size of the pipeline's stage axis.
    pipeline_reduce: ``"step"``, ``"microbatch"`` or ``None`` (the stage's
      default), as ``zerojax.pipeline``'s ``reduce``.
    secondary_devices: stage 3's hpZ: the size of the intra-node data axes
      (devices per node), or ``None``.
    offloaded_activation_bytes: bytes of activations one layer's checkpoint
      policy offloads to host memory, per device; 0 for none.
    num_layers: how many layers offload ``offloaded_activation_bytes`` each.

  Returns:
    A ``MemoryEstimate`` in bytes.

  Raises:
    ValueError: for a stage or count out of range, an unknown ``offload``,
      offload at stage 0, ``"optimizer+master"`` without separate master
      weights, or ``secondary_devices`` at another stage or not dividing
      ``num_devices`` into nodes.

  Example (the ZeRO paper's Table I, Ψ = 7.5B, N = 64):
    >>> import zerojax
    >>> [round(zerojax.estimate_memory(7.5e9, num_devices=64, stage=s).total / 1e9, 2)
    ...  for s in (1, 2, 3)]
    [31.41, 16.64, 1.88]

  The same model on 2 replicas of 8-way data x 4-way tensor parallelism (64 devices):

    >>> round(zerojax.estimate_memory(
    ...   7.5e9, num_devices=8, replicas=2, tensor_parallel=4, stage=3).total / 1e9, 2)
    3.75

  A 7B model in fp32 with Adam (K = 8) on 8 devices at stage 2, its optimizer
  state in host memory: 4Ψ on the device, 8Ψ/N in host memory per device.

    >>> estimate = zerojax.estimate_memory(
    ...   7e9, num_devices=8, stage=2, param_bytes=4, grad_bytes=4, state_bytes=8,
    ...   offload="optimizer")
    >>> estimate.params / 1e9, estimate.optimizer_state / 1e9, estimate.host / 1e9
    (28.0, 0.0, 7.0)

  The 7.5B model in 4 pipeline stages of 16-way data parallelism (64 devices):
  stage 2, reducing once per step, holds a stage's whole gradient as stage 1
  does; stage 3 reduces every micro-batch, unless told to reduce once.

    >>> [round(zerojax.estimate_memory(
    ...   7.5e9, num_devices=16, stage=s, pipeline_stages=4).total / 1e9, 2) for s in (1, 2, 3)]
    [8.91, 8.91, 1.88]
    >>> round(zerojax.estimate_memory(7.5e9, num_devices=16, stage=3, pipeline_stages=4,
    ...   pipeline_reduce="step").total / 1e9, 2)
    9.14

  With hpZ on 8 nodes of 8 devices, each device also holds 1/8 of the bf16 weights during a step:

    >>> hpz = zerojax.estimate_memory(7.5e9, num_devices=64, stage=3, secondary_devices=8)
    >>> round(hpz.total / 1e9, 2), round(hpz.secondary / 1e9, 2)
    (1.88, 1.88)

  Its 56 layers each offloading one bf16 ``[2048, 16384]`` activation a device (2048 tokens
  a device, the up-projection's output) hold 3.76 GB of host memory per device in a step:

    >>> offloading = zerojax.estimate_memory(7.5e9, num_devices=64, stage=3,
    ...   offloaded_activation_bytes=2048 * 16384 * 2, num_layers=56)
    >>> round(offloading.total / 1e9, 2), round(offloading.host_activations / 1e9, 2)
    (1.88, 3.76)
  """
  stage_ = _check(num_devices, stage, replicas, tensor_parallel, offload, pipeline_stages)
  activations = _offloaded_activations(offloaded_activation_bytes, num_layers)
  nodes = _nodes(num_devices, stage, secondary_devices, pipeline_stages)
  once = reduces_once(pipeline_reduce, stage_.splits_params)
  num_params = num_params / (tensor_parallel * pipeline_stages)
  share = lambda splits, size: _share(splits, size, size, num_devices)
  master = master_bytes if param_bytes < master_bytes else 0
  moved = offload_lib.Offload(offload)
  moved.check_master(bool(master))
  host_bytes = moved.host_bytes(state_bytes, master)
  whole = pipeline_stages > 1 and once  # opened once, reduced once
  gathered = num_params * param_bytes if whole and stage_.splits_params else 0.0
  return _estimate(
    share(stage_.splits_params, num_params * param_bytes) + gathered,
    share(stage_.splits_grads and not whole, num_params * grad_bytes),
    share(stage_.splits_state, num_params * (state_bytes - host_bytes)),
    share(stage_.splits_state, num_params * host_bytes),
    num_params * param_bytes * nodes / num_devices if nodes > 1 else 0.0,
    activations,
  )


def _offloaded_activations(per_layer: float, num_layers: int) -> float:
  """``num_layers`` x ``per_layer`` bytes, once both are checked."""
  if isinstance(per_layer, bool) or not isinstance(per_layer, int | float) or per_layer < 0:
    raise ValueError(
      f"offloaded_activation_bytes must be a number of bytes, at least 0, got {per_layer!r}: "
      "the bytes one layer's checkpoint policy offloads to host memory on one device."
    )
  if not hasattr(num_layers, "__index__") or isinstance(num_layers, bool) or num_layers < 1:
    raise ValueError(f"num_layers must be a whole number, at least 1, got {num_layers!r}.")
  return float(per_layer * num_layers)


def estimate_tree_memory(
  params: Any,
  optimizer: optax.GradientTransformation,
  *,
  num_devices: int,
  stage: int,
  min_shard_size: int = layout_lib.DEFAULT_MIN_SHARD_SIZE,
  precision: precision_lib.Precision | str | None = None,
  offload: str | None = None,
) -> MemoryEstimate:
  """Per-device bytes of a real parameter tree and optax optimizer at a ZeRO stage.

  Nothing is allocated: the trees are planned by the same code that
  ``zerojax.zero1`` etc. use, so the estimate matches what ``tx.shard`` and
  ``tx.init`` place, byte for byte: leaves split, padded or kept replicated as
  the layout plan has them, parameters in their stored dtype, the optimizer
  state from ``jax.eval_shape(optimizer.init, ...)`` plus the master copy that
  stages 1 and 2 keep under a mixed-precision policy, and gradients in the
  master dtype (as ``zerojax.value_and_grad`` returns them). With ``offload``,
  the offloaded state (and master copy) is counted in ``host``, and stage 3
  under ``"optimizer+master"`` stores its parameters in the compute dtype.

  Args:
    params: the parameters, as arrays or ``jax.ShapeDtypeStruct`` s.
    optimizer: the optax optimizer that zerojax would wrap.
    num_devices: N, the size of the data-parallel axis.
    stage: 0, 1, 2 or 3 (0: plain data parallelism, the same policy).
    min_shard_size: as for ``zerojax.zero1`` etc.
    precision: as for ``zerojax.zero1`` etc.
    offload: as for ``zerojax.zero1`` etc.

  Returns:
    A ``MemoryEstimate`` in bytes.

  Example:
    >>> import jax, jax.numpy as jnp, optax, zerojax
    >>> params = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
    >>> zerojax.estimate_tree_memory(params, optax.adam(1e-3), num_devices=8, stage=3).total
    2097164.0
    >>> zerojax.estimate_tree_memory(
    ...   params, optax.adam(1e-3), num_devices=8, stage=1, precision="bf16"
    ... ).params
    2097152.0

  Offloaded, stage 3's optimizer state (two fp32 moments) is in host memory:

    >>> estimate = zerojax.estimate_tree_memory(
    ...   params, optax.adam(1e-3), num_devices=8, stage=3, offload="optimizer")
    >>> estimate.total, estimate.host
    (1048584.0, 1048580.0)
  """
  stage_ = _check(num_devices, stage, offload=offload)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
  settings = Settings(
    inner=optax.with_extra_args_support(optimizer),
    stage=stage_,
    mesh=jax.sharding.AbstractMesh((num_devices,), ("data",)),
    min_shard_size=min_shard_size,
    precision=precision_lib.resolve(precision),
    offload=offload_lib.Offload(offload),
  )
  planner = Planner(settings)
  plans = planner.plan(abstract)
  offloaded = settings.offload.fields
  device, host = [], []
  for name, layout in (("inner_state", plans.state), ("master", plans.master)):
    if layout is not None:
      (host if name in offloaded else device).append(_bytes(layout, num_devices))
  if stage_.splits_state:
    counters = jax.eval_shape(lambda: fresh_loss_scale_and_counters(settings.precision))
    device.append(_bytes(planner.split(counters), num_devices))
  share = lambda splits, counts: _share(splits, counts[0], counts[1], num_devices)
  summed = lambda counts: tuple(map(sum, zip((0, 0), *counts, strict=True)))
  return _estimate(
    share(stage_.splits_params, _bytes(plans.params, num_devices)),
    share(stage_.splits_grads, _bytes(plans.sharded, num_devices)),
    share(stage_.splits_state, summed(device)),
    share(stage_.splits_state, summed(host)),
  )


def _bytes(layout: layout_lib.Layout, num_devices: int) -> tuple[int, int]:
  """(bytes of the whole tree; N times the bytes per device once the tree is split).

  Once split, a sharded leaf costs its padded size over N per device, and a leaf
  the plan keeps whole costs its full size on every device.
  """
  whole = split = 0
  for leaf in layout.leaves:
    size = int(np.prod(leaf.shape)) * leaf.dtype.itemsize
    whole += size
    if leaf.dim is None:
      split += size * num_devices
    else:
      split += int(np.prod(leaf.stored_shape)) * leaf.dtype.itemsize
  return whole, split


class CommunicationEstimate(NamedTuple):
  """Bytes per device per step that a ZeRO stage's collectives gather or reduce.

  Counted as ``zerojax.diagnostics.count_collectives`` counts a compiled step: each
  collective by the full array it works on (an all-gather's result, a
  reduce-scatter's, all-to-all's or all-reduce's operand). That is the ZeRO
  paper's accounting, in which stages 1 and 2 move 2Ψ per step and stage 3
  3Ψ; an all-reduce counts once here (on a ring it moves twice its operand).

  Attributes:
    weight_gathers: all-gathers of parameters: stage 3's before each use
      (forward, and again in backward under remat), or stages 1 and 2's of the
      updated parameters after the optimizer step.
    gradient_reductions: the gradient reduce-scatters over the data axes
      (all-to-alls of quantized chunks with ``quantized_gradients``), or plain
      data parallelism's all-reduce. Quantized over nodes (ZeRO++'s
      hierarchical qgZ), only the second round: the all-to-all across nodes
      of each node's sums, 1/(devices per node) of the gradients.
    replica_reductions: hybrid sharding's all-reduce of the gradient shard
      across replicas.
    total: the sum.
    secondary_gathers: hpZ: the all-gathers inside the node, over the
      secondary axes, of the secondary partitions into whole weights (forward,
      and backward under remat); ``weight_gathers`` then holds only the
      all-gathers across nodes, which leave each device its secondary
      partition. 0 without hpZ.
    inner_reductions: hierarchical qgZ's first round: the all-to-all inside
      the node, over its data axes, of each device's whole quantized
      gradient, which the receivers sum in float32 before the second round
      sends the sums across nodes. 0 without quantized gradients over nodes
      (``devices_per_node`` or ``secondary_devices``).

  Example:
    Stage 1 gathers the updated bf16 parameters as often as it reduces bf16 gradients:

    >>> import zerojax
    >>> estimate = zerojax.estimate_communication(7.5e9, num_devices=64, stage=1)
    >>> {name: gigabytes / 1e9 for name, gigabytes in estimate._asdict().items() if gigabytes}
    {'weight_gathers': 15.0, 'gradient_reductions': 15.0, 'total': 30.0}
  """

  weight_gathers: float
  gradient_reductions: float
  replica_reductions: float
  total: float
  secondary_gathers: float = 0.0
  inner_reductions: float = 0.0

  @property
  def inside_nodes(self) -> float:
    """What moves over the data axes inside a node only: ``secondary_gathers + inner_reductions``.

    The rest, ``total - inside_nodes``, is what spans the nodes: collectives
    over the axes across nodes, and those in one round over every data axis.
    """
    return self.secondary_gathers + self.inner_reductions


class _Link(NamedTuple):
  """Bytes per device of one collective over every data axis, by the axes each round spans.

  Attributes:
    inside: over the data axes inside a node only.
    across: over the axes across nodes; a collective in one round spans every
      data axis, and counts here whole.
  """

  inside: float
  across: float


def _over_data_axes(
  num_elements: float,
  num_devices: int,
  devices_per_node: int,
  moved: Callable[[float], float],
  moved_inside: Callable[[float], float] | None = None,
) -> _Link:
  """A collective over all ``num_devices`` data devices, in one round or, over nodes, two.

  Two rounds where the data axes are two or more nodes of more than one
  device each (``quantized.hierarchy``): the round inside the node works on
  the whole array (``moved_inside``, by default ``moved``, of
  ``num_elements``), the one across nodes on the node's 1/``devices_per_node``
  of it. Which round comes first does not change the bytes: qgZ reduces
  inside first and hpZ gathers across first. Otherwise one round over every
  axis, all of it across. ``moved(n)`` is the bytes of a collective of ``n``
  elements (codes and scales, if quantized).
  """
  if 1 < devices_per_node < num_devices:
    inside = (moved_inside or moved)(num_elements)
    return _Link(inside, moved(num_elements / devices_per_node))
  return _Link(0.0, moved(num_elements))


def _payload(
  quantization: quantize.Quantization | None, element_bytes: float
) -> Callable[[float], float]:
  """``n -> bytes`` of a collective of ``n`` elements: quantized, or ``element_bytes`` each."""
  if quantization is None:
    return lambda num_elements: float(num_elements * element_bytes)
  return lambda num_elements: float(quantization.moved_bytes(num_elements))  # pyright: ignore[reportArgumentType] (Ψ / D need not be whole)


def estimate_communication(
  num_params: float,
  *,
  num_devices: int,
  stage: int,
  quantized_weights: str | None = None,
  quantized_gradients: str | None = None,
  quantization_block_size: int = quantize.DEFAULT_BLOCK_SIZE,
  replicas: int = 1,
  param_bytes: float = 2,
  grad_bytes: float = 2,
  regather: bool = True,
  pipeline_stages: int = 1,
  microbatches: int = 1,
  pipeline_reduce: str | None = None,
  secondary_devices: int | None = None,
  devices_per_node: int | None = None,
) -> CommunicationEstimate:
  """Bytes per device per step that ``zerojax.value_and_grad`` and ``tx.update`` move.

  What the explicit path's collectives move, for Ψ parameters:

  * stage 0 (plain data parallelism): one all-reduce of the gradients,
    Ψ x ``grad_bytes``;
  * stages 1 and 2: the gradient reduce-scatter, Ψ x ``grad_bytes``, and the
    all-gather of the updated parameters in ``tx.update``, Ψ x
    ``param_bytes`` (never quantized);
  * stage 3: a weight all-gather of Ψ x ``param_bytes`` per pass, two passes
    with ``regather`` (a layer under ``jax.checkpoint(...,
    policy=zerojax.remat_policy)`` gathers again in backward), one without;
    and the gradient reduce-scatter, Ψ x ``grad_bytes``;
  * with ``replicas`` above 1 (hybrid sharding), stages 1 to 3 also
    all-reduce the shard across replicas: Ψ / N x ``grad_bytes``; with
    ``quantized_gradients``, a quantized all-to-all and all-gather of the
    shard instead, twice ``moved_bytes(Ψ / N)``;
  * with ``quantized_gradients`` on nodes (``devices_per_node`` = D, or
    ``secondary_devices``), the reduction takes ZeRO++'s two rounds
    (``zerojax/_src/comm/quantized.py``): an all-to-all inside the node of
    the whole gradient, ``moved_bytes(Ψ)`` (``inner_reductions``), then an
    all-to-all across nodes of the node's sums, ``moved_bytes(Ψ / D)``
    (``gradient_reductions``), both with their scales; unquantized, one
    reduce-scatter over every data axis, as XLA places it;
  * stage 3 with hpZ (``secondary_devices`` = D, the size of the intra-node
    data axes): the weight all-gathers cross nodes once, in the forward pass,
    and each leaves a device its secondary partition, Ψ / D x ``param_bytes``
    (quantized, ``moved_bytes(Ψ / D)``): that is ``weight_gathers``. Inside
    the node (``secondary_gathers``) the secondary partitions are gathered
    into whole weights once per pass, Ψ x ``param_bytes`` each, never
    quantized. The gradients' reduce-scatter is stage 3's.

  ``count_collectives_by_axes`` splits a compiled step the same way, on a
  ``("node", "data")`` mesh: what spans ``("node", "data")`` is the
  collectives in one round (``weight_gathers`` without hpZ,
  ``gradient_reductions`` unquantized); what runs over ``("node",)`` is
  hpZ's ``weight_gathers`` and qgZ's ``gradient_reductions``; what runs
  over ``("data",)`` is ``inside_nodes``, hpZ's ``secondary_gathers`` and
  qgZ's ``inner_reductions``. One data axis (``devices_per_node`` and
  ``secondary_devices`` left out) is one round.

  With ``pipeline_stages`` S above 1 (``zerojax.pipeline`` with
  ``microbatches`` M), a device moves its stage's share, Ψ / S, once per step
  where the stage reduces once per step (``pipeline_reduce``, see
  ``estimate_memory``); reducing per micro-batch, stages 2 and 3
  reduce-scatter in each of the M + S - 1 backward slots of the schedule (a
  stage runs the slots of the bubble too, masked) and stage 3 gathers in each
  forward and backward slot.

  Quantized, a collective moves ``Quantization.moved_bytes(Ψ)``: Ψ x bits / 8
  of codes and 4 bytes of scale per block (the padding of a last partial
  block not counted). Over a data axis of one device nothing moves.

  Args:
    num_params: Ψ, the number of parameters.
    num_devices: N, the size of the data-parallel axes.
    stage: 0, 1, 2 or 3.
    quantized_weights: stage 3 only: ``"int8"``, ``"int4"`` or ``None``, as
      for ``zerojax.zero3``.
    quantized_gradients: stages 1 to 3: ``"int8"``, ``"int4"`` or ``None``.
    quantization_block_size: elements per scale.
    replicas: the size of the replica axes (hybrid sharding).
    param_bytes: bytes per parameter as gathered (the compute dtype's).
    grad_bytes: bytes per gradient element as reduced (the reduce dtype's).
    regather: stage 3: whether the backward pass gathers the weights again
      (remat with ``zerojax.remat_policy``).
    pipeline_stages: S, the size of the pipeline's stage axis.
    microbatches: M, the pipeline's micro-batches.
    pipeline_reduce: as for ``estimate_memory``.
    secondary_devices: stage 3's hpZ: the size of the intra-node data axes
      (devices per node), or ``None``.
    devices_per_node: D, the size of the data axes inside a node, where the
      data axes span nodes: the last axis of ``axis_name`` (or hpZ's
      secondary axes, whose size ``secondary_devices`` gives already);
      ``None`` for one data axis.

  Returns:
    A ``CommunicationEstimate`` in bytes.

  Example (Ψ = 7.5B, N = 64, bf16 weights and gradients):
    >>> import zerojax
    >>> plain = zerojax.estimate_communication(7.5e9, num_devices=64, stage=3)
    >>> int8 = zerojax.estimate_communication(
    ...   7.5e9, num_devices=64, stage=3, quantized_weights="int8", quantized_gradients="int8"
    ... )
    >>> round(plain.total / 1e9, 2), round(int8.total / 1e9, 2)
    (45.0, 22.85)

  On 4 replicas, each also all-reduces its 1/64 of the gradients with the others:

    >>> hybrid = zerojax.estimate_communication(7.5e9, num_devices=64, replicas=4, stage=3)
    >>> hybrid.replica_reductions
    234375000.0

  In 4 pipeline stages with 8 micro-batches, stage 3 (per micro-batch) against once per step:

    >>> per_microbatch = zerojax.estimate_communication(
    ...   7.5e9, num_devices=16, stage=3, pipeline_stages=4, microbatches=8)
    >>> once = zerojax.estimate_communication(
    ...   7.5e9, num_devices=16, stage=3, pipeline_stages=4, microbatches=8, pipeline_reduce="step")
    >>> round(per_microbatch.total / 1e9, 2), round(once.total / 1e9, 2)
    (123.75, 7.5)

  With hpZ on 8 nodes of 8 devices, the weights cross nodes once per step, 1/8 of them each time:

    >>> hpz = zerojax.estimate_communication(7.5e9, num_devices=64, stage=3, secondary_devices=8)
    >>> [round(gigabytes / 1e9, 2) for gigabytes in hpz]
    [1.88, 15.0, 0.0, 46.88, 30.0, 0.0]

  int8 qgZ on those 8 nodes sums the gradients inside each node first, so only the node's
  sums, 1/8 of the int8 gradients, cross the nodes. With hpZ and qwZ too, the collectives
  that span the nodes move 1.9 GB a device per step, against zero3's 45 GB:

    >>> qgz = zerojax.estimate_communication(
    ...   7.5e9, num_devices=64, stage=3, quantized_gradients="int8", devices_per_node=8)
    >>> round(qgz.inner_reductions / 1e9, 2), round(qgz.gradient_reductions / 1e9, 2)
    (7.62, 0.95)
    >>> zero_plus_plus = zerojax.estimate_communication(
    ...   7.5e9, num_devices=64, stage=3, secondary_devices=8,
    ...   quantized_weights="int8", quantized_gradients="int8")
    >>> [round(gigabytes / 1e9, 2) for gigabytes in zero_plus_plus]
    [0.95, 0.95, 0.0, 39.52, 30.0, 7.62]
    >>> round((zero_plus_plus.total - zero_plus_plus.inside_nodes) / 1e9, 2)
    1.9
  """
  stage_ = _check(num_devices, stage, replicas, pipeline_stages=pipeline_stages)
  nodes = _nodes(num_devices, stage, secondary_devices, pipeline_stages)
  per_node = _devices_per_node(num_devices, devices_per_node, secondary_devices)
  if microbatches < 1:
    raise ValueError(f"microbatches must be at least 1, got {microbatches}.")
  num_params = num_params / pipeline_stages
  weights = quantize.resolve("quantized_weights", quantized_weights, quantization_block_size)
  gradients = quantize.resolve("quantized_gradients", quantized_gradients, quantization_block_size)
  quantize.check_stage(stage, quantized_weights)
  if gradients is not None and not stage_.splits_state:
    raise ValueError(
      "quantized_gradients quantizes the gradient reduce-scatters of stages 1 to 3; plain "
      "data parallelism (stage 0) all-reduces with XLA's collectives, which zerojax does not "
      "quantize. Pass stage=1, 2 or 3."
    )
  if not stage_.splits_state:
    all_reduced = float(num_params * grad_bytes) if replicas * num_devices > 1 else 0.0
    return _communication(0.0, all_reduced, 0.0)

  passes = 2 if stage_.splits_params and regather else 1
  reductions = 1
  if pipeline_stages > 1:
    slots = microbatches + pipeline_stages - 1  # of each kind, bubble included
    once = reduces_once(pipeline_reduce, stage_.splits_params)
    passes = 1 if once or not stage_.splits_params else 2 * slots
    reductions = 1 if once or not stage_.splits_grads else slots
  shard = num_params / num_devices
  if replicas == 1:
    across = 0.0
  elif gradients is None:
    across = shard * grad_bytes
  else:
    across = 2 * gradients.moved_bytes(shard)  # pyright: ignore[reportArgumentType] (Ψ/N)
  if num_devices == 1:  # over a data axis of one device nothing moves
    return _communication(0.0, 0.0, across)
  weight_payload = _payload(weights, param_bytes)
  if nodes == 1:  # one round over every data axis, each pass (over nodes in two: pass per_node)
    gather = _over_data_axes(num_params, num_devices, 1, weight_payload)
    weight_gathers, inside = passes * gather.across, passes * gather.inside
  else:  # hpZ: across nodes in the forward pass only, inside the node every pass, unquantized
    gather = _over_data_axes(
      num_params, num_devices, per_node, weight_payload, _payload(None, param_bytes)
    )
    weight_gathers, inside = gather.across, passes * gather.inside
  # zerojax's quantized reduce-scatter runs in rounds over nodes (quantized.hierarchy); the
  # unquantized one in one, over every data axis.
  reduction = _over_data_axes(
    num_params, num_devices, per_node if gradients else 1, _payload(gradients, grad_bytes)
  )
  return _communication(
    weight_gathers,
    reductions * reduction.across,
    across,
    inside,
    reductions * reduction.inside,
  )


def _communication(weights, gradients, replicas, secondary=0.0, inner=0.0) -> CommunicationEstimate:
  total = weights + gradients + replicas + secondary + inner
  return CommunicationEstimate(weights, gradients, replicas, total, secondary, inner)
