"""Parameter shards inside ``shard_map``: ``Shard``, ``gather``, and the remat policies around them.

Inside ``zerojax.value_and_grad`` each parameter that the layout shards reaches
the loss function as a ``Shard``: this device's piece plus the static facts
``gather`` needs (which dimension, how much padding). ``gather`` turns it into
the full array:

* stage 3: an all-gather whose backward pass is a reduce-scatter, so the
  gradient comes back reduce-scattered, one layer at a time in a scan;
* stage 2: the parameter is already whole on every device, so the forward pass
  reads it as is, and a custom VJP reduce-scatters the cotangent into a
  shard-sized gradient "sink" during the backward pass.

Both cast on the way: the weight to the compute dtype before the all-gather
(so a bfloat16 policy moves half the bytes), the cotangent to the reduce dtype
before the reduce-scatter, and the result to the master dtype. With
quantization (``quantized_weights``, ``quantized_gradients``) the all-gather
moves block-quantized integers instead, and the reduce-scatter becomes an
all-to-all of quantized chunks summed in float32 (see ``quantized.py``). The
shards of one ``gather`` call are opened together, their collectives issued
side by side for XLA to combine (``group.py``), the way their ``Opening`` says (``opening.py``).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from zerojax._src.comm import hierarchical as hpz
from zerojax._src.comm import opening as opening_lib
from zerojax._src.comm import quantized as quantize
from zerojax._src.comm.group import Group, Transfer
from zerojax._src.sharding import stored as stored_lib

#: ``jax.checkpoint_name`` of every array ``gather`` returns.
GATHERED = "zerojax_gathered"


#: Primitives that only cast, move or re-lay out their operand: as cheap to
#: recompute as to read back, and on a gathered weight as large as the layer.
_LAYOUT = frozenset(
  {
    "bitcast_convert_type",
    "broadcast_in_dim",
    "convert_element_type",
    "copy",
    "copy_p",
    "expand_dims",
    "reduce_precision",
    "reshape",
    "rev",
    "slice",
    "squeeze",
    "transpose",
  }
)


def remat_policy(primitive, *_, **params) -> bool:
  """A ``jax.checkpoint`` policy that saves everything except gathered parameters.

  With it, a checkpointed layer re-gathers its weights in the backward pass
  instead of keeping every layer's gathered weights alive from the forward
  pass to the backward pass, which would hold the whole model on each device.
  Casts, transposes, reshapes and slices are not saved either, of any value:
  they are as cheap to recompute as to read back, and of a weight (a layer
  that computes with ``w.T`` or ``w.astype(jnp.bfloat16)``, the slice that
  removes stage 3's padding, the cast that reads stage 2's replicated copy)
  they would keep a copy of every layer alive until the backward pass.

  Example:
    >>> import jax, zerojax
    >>> body = jax.checkpoint(lambda h, w: h @ zerojax.gather(w), policy=zerojax.remat_policy)
  """
  return not (primitive.name in _LAYOUT or gathers(primitive, params))


def gathers(primitive, params) -> bool:
  """Whether an equation gathers a parameter or reads it (``gather`` or one of its collectives)."""
  name = primitive.name
  if name.startswith("all_gather"):
    return True
  if name == "custom_vjp_call" and _reads(params["call_jaxpr"]):
    return True
  return name == "name" and params.get("name") == GATHERED


def names_secondary(primitive, params) -> bool:
  """Whether this names an hpZ secondary partition, which every policy here saves."""
  return primitive.name == "name" and params.get("name") == hpz.SECONDARY


#: The policies of ``jax.checkpoint_policies`` that are policies themselves, not factories of one.
_NAMED_POLICIES = (
  "checkpoint_dots",
  "checkpoint_dots_with_no_batch_dims",
  "dots_saveable",
  "dots_with_no_batch_dims_saveable",
  "everything_saveable",
  "nothing_saveable",
)


def named_policy(policy: Callable[..., bool] | str | None) -> Callable[..., bool] | None:
  """``policy``, or the policy of ``jax.checkpoint_policies`` it names (``"dots_saveable"``).

  Raises:
    ValueError: if ``policy`` is a string that names no such policy.
  """
  if not isinstance(policy, str):
    return policy
  if policy in _NAMED_POLICIES:
    return getattr(jax.checkpoint_policies, policy)
  factory = callable(getattr(jax.checkpoint_policies, policy, None))
  close = difflib.get_close_matches(policy, _NAMED_POLICIES, n=1)
  raise ValueError(
    f"policy={policy!r} names no policy of jax.checkpoint_policies that takes no arguments"
    + (f"; did you mean {close[0]!r}?" if close else ".")
    + (
      f" jax.checkpoint_policies.{policy} makes a policy: pass what it returns, "
      f"policy=jax.checkpoint_policies.{policy}(...)."
      if factory
      else f" Name one of {_NAMED_POLICIES}, or pass a policy function."
    )
  )


def except_gathered(policy: Callable[..., bool] | str | None) -> Callable[..., bool]:
  """A ``jax.checkpoint`` policy: ``policy``'s choices, never saving a gathered parameter.

  Use it to pick what a checkpointed layer that calls ``zerojax.gather`` saves
  for the backward pass (``zerojax.scan`` takes ``policy=`` and does this
  itself). The gathered weights, the slices and casts that open them, are
  never saved, so the backward pass gathers the layer again instead of keeping
  every layer whole until then. ``None`` gives ``zerojax.remat_policy``, which
  saves everything else. Under hpZ (``secondary_axis``) the secondary
  partitions are saved whatever ``policy`` says, so that the backward pass
  gathers from them inside the node.

  Args:
    policy: a policy of ``jax.checkpoint_policies``, or its name
      (``"dots_saveable"``), or ``None``.

  Returns:
    The policy.

  Example:
    Matmul outputs saved, everything else recomputed, the layer gathered again:

    >>> import jax, zerojax
    >>> policy = zerojax.except_gathered(jax.checkpoint_policies.dots_saveable)
    >>> body = jax.checkpoint(lambda h, w: h @ zerojax.gather(w), policy=policy)
  """
  policy = named_policy(policy)
  if policy is None:
    return remat_policy

  def saved(primitive, *args, **params) -> bool:
    if names_secondary(primitive, params):
      return True
    return remat_policy(primitive, *args, **params) and policy(primitive, *args, **params)

  return saved


#: What the forward passes of ``gather``'s custom VJPs consist of.
_READS = frozenset({"pvary", "pcast", "convert_element_type", "bitcast_convert_type", "all_gather"})


def _reads(closed_jaxpr) -> bool:
  """Whether a custom VJP's forward pass reads a parameter: casts it, or gathers it."""
  names = [eqn.primitive.name for eqn in closed_jaxpr.jaxpr.eqns]
  return "all_gather" in names or all(name in _READS for name in names)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Shard:
  """This device's part of a parameter, as the loss function of ``value_and_grad`` sees it.

  Use ``zerojax.gather`` to turn it into the full parameter. Slicing by
  ``jax.lax.scan`` over stacked layers is fine: the sharded dimension is
  counted from the end.

  Attributes:
    value: the local array: a 1/N shard (stage 3) or the whole parameter
      (stage 2).
    sink: stage 2 only: a zero array of the shard's shape that receives the
      reduce-scattered gradient; ``None`` in stage 3.
    dim: the sharded dimension, counted from the end.
    size: the logical (unpadded) size of that dimension.
    axis_name: the data-parallel mesh axis, or tuple of axes.
    compute_dtype: the dtype ``gather`` returns (the precision policy's
      compute dtype); ``None`` keeps ``value``'s.
    reduce_dtype: the dtype the gradient is reduce-scattered in; ``None``
      keeps the gradient's.
    replica_axes: the other axes the batch is split over (hybrid sharding).
      The gradient is reduce-scattered over ``axis_name`` only and left
      varying over these, for ``value_and_grad`` to sum once per step.
    quantized_weights: stage 3: how the all-gather quantizes the weight
      (``None``: it moves the compute dtype).
    quantized_gradients: how the reduce-scatter quantizes the gradient
      (``None``: it moves the reduce dtype).
    secondary_axes: hpZ, stage 3: the intra-node data axes over which the
      backward pass gathers the weight again, from the secondary partition the
      forward pass kept; ``()`` without hpZ.
    packed_gathers: stage 3: whether the shards opened together move in one
      all-gather per dtype (``zerojax.zero3``'s ``packed_gathers``); ``None``:
      on GPUs where ``axis_name`` spans several axes of more than one device
      each.

  Example:
    >>> import jax, jax.numpy as jnp, optax, zerojax
    >>> tx = zerojax.zero3(optax.sgd(0.1), mesh=jax.make_mesh((jax.device_count(),), ("data",)))
    >>> def loss_fn(params, x):
    ...   print(type(params["w"]).__name__, params["w"].value.shape)
    ...   return jnp.mean(x @ zerojax.gather(params["w"]))
    >>> params = tx.shard({"w": jnp.ones((4, 1024))})
    >>> _ = zerojax.value_and_grad(loss_fn, tx)(params, jnp.ones((8, 4)))
    Shard (4, 128)
  """

  value: jax.Array
  sink: jax.Array | None
  dim: int = dataclasses.field(metadata=dict(static=True))
  size: int = dataclasses.field(metadata=dict(static=True))
  axis_name: str = dataclasses.field(metadata=dict(static=True))
  compute_dtype: Any = dataclasses.field(default=None, metadata=dict(static=True))
  reduce_dtype: Any = dataclasses.field(default=None, metadata=dict(static=True))
  replica_axes: tuple[str, ...] = dataclasses.field(default=(), metadata=dict(static=True))
  quantized_weights: quantize.Quantization | None = dataclasses.field(
    default=None, metadata=dict(static=True)
  )
  quantized_gradients: quantize.Quantization | None = dataclasses.field(
    default=None, metadata=dict(static=True)
  )
  secondary_axes: tuple[str, ...] = dataclasses.field(default=(), metadata=dict(static=True))
  packed_gathers: bool | None = dataclasses.field(default=None, metadata=dict(static=True))

  def __jax_array__(self):
    raise TypeError(
      "this is a zerojax parameter shard, not the parameter: call "
      "zerojax.gather(...) on it (or on the pytree that holds it) first."
    )


def gather(tree: Any) -> Any:
  """Turns the parameter shards in ``tree`` into full arrays.

  Call it inside the loss function given to ``zerojax.value_and_grad``, as late
  as possible: inside a ``jax.lax.scan`` over stacked layers, gather the layer
  the body is about to use, so that only one layer is ever whole (or let
  ``zerojax.scan`` gather each layer for you, one layer ahead). Leaves that
  are already full arrays pass through, so the same model code runs at every
  stage and outside ``value_and_grad`` (for evaluation). Each shard of one
  call moves in an all-gather of its own, issued together (XLA may combine
  them), and its gradient in a reduce-scatter of its own.

  Args:
    tree: a pytree whose leaves are ``Shard`` s or arrays.

  Returns:
    The same pytree with every ``Shard`` replaced by the full parameter.

  Example:
    >>> import jax, jax.numpy as jnp, zerojax
    >>> zerojax.gather({"w": jnp.ones(3)})["w"]
    Array([1., 1., 1.], dtype=float32)
  """
  leaves, treedef = jax.tree.flatten(
    tree, is_leaf=lambda x: isinstance(x, Shard | stored_lib.Stored)
  )
  groups: dict[Any, list[int]] = {}
  for index, leaf in enumerate(leaves):
    if isinstance(leaf, stored_lib.Stored):
      raise stored_lib.used_as_array(leaf)
    if isinstance(leaf, Shard):
      groups.setdefault(_group_key(leaf), []).append(index)
  for indices in groups.values():
    for index, full in zip(indices, open_shards([leaves[i] for i in indices]), strict=True):
      leaves[index] = full
  return jax.tree.unflatten(treedef, leaves)


def open_shards(shards: list[Shard]) -> list[jax.Array]:
  """The full parameters of ``shards``, which share a group (see ``_group_key``).

  Stage 3 gathers them, one all-gather each, issued together; stage 2 reads
  its replicated copies. Either way their gradients are reduce-scattered
  together.
  """
  group = group_of(shards)
  sinks = [shard.sink for shard in shards if shard.sink is not None]
  opening = opening_lib.of(group, reads=bool(sinks))
  fulls = opening_lib.open_layer(opening, group, [shard.value for shard in shards], sinks)
  return [checkpoint_name(full, GATHERED) for full in fulls]


def group_of(shards: list[Shard]) -> Group:
  """The static ``Group`` that opens ``shards`` together."""
  first = shards[0]
  return Group(
    tuple(map(_transfer, shards)),
    first.axis_name,
    first.replica_axes,
    first.quantized_weights,
    first.quantized_gradients,
    first.secondary_axes,
    first.packed_gathers,
  )


def _group_key(shard: Shard) -> tuple[Any, ...]:
  """What shards must share to be opened together: kind, axes and quantization."""
  return (
    shard.sink is None,
    shard.axis_name,
    shard.replica_axes,
    shard.quantized_weights,
    shard.quantized_gradients,
    shard.secondary_axes,
    shard.packed_gathers,
  )


def _transfer(shard: Shard) -> Transfer:
  value = shard.value
  compute = jnp.dtype(shard.compute_dtype or value.dtype)
  if shard.sink is None:
    shard_shape, grad = value.shape, value.dtype
  else:  # stage 2: the replicated copy is already in the compute dtype
    shard_shape, grad = shard.sink.shape, shard.sink.dtype
  return Transfer(
    axis=value.ndim + shard.dim,
    size=shard.size,
    shard_shape=tuple(shard_shape),
    compute=compute,
    reduce=jnp.dtype(shard.reduce_dtype or compute),
    grad=jnp.dtype(grad),
  )
