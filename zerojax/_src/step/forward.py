"""``forward``: a model's forward pass per device, on stored parameters, never gathering the model.

``zerojax.value_and_grad`` without the VJP: the same ``jax.shard_map`` over the
batch axes, each device on its slice of the batch, stage 3's parameters as
``zerojax.Shard`` s that ``zerojax.gather`` and ``zerojax.scan`` open where the
model uses them (one layer at a time in a scan), and no gradient to reduce.
For evaluating (logits, per-example losses, metrics) and sampling (a KV cache
is one more batch argument, split like the batch) a model no device holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zerojax._src.comm import ordering
from zerojax._src.core import transformation as zero_lib
from zerojax._src.step import value_and_grad as grad_lib


def forward(fn: Callable[..., Any], tx: zero_lib.ZeroTransformation) -> Callable[..., Any]:
  """``fn(params, *batch)`` run per device on its slice of the batch, on stored parameters.

  The returned ``f(params, *batch)`` splits every leaf of every ``batch``
  argument along its leading dimension over the batch axes, as
  ``zerojax.value_and_grad`` does, and calls ``fn`` once per device on its
  slice. Inside, stage 3's parameters are ``zerojax.Shard`` s: open them with
  ``zerojax.gather`` or ``zerojax.scan`` where the model uses them, and only
  the layer in use is ever whole (stages 1 and 2 give the replicated arrays).
  Parameters arrive in the precision policy's compute dtype. Every leaf ``fn``
  returns must have a leading batch axis, of the device's rows: the devices'
  results are laid side by side along it, as the batch was split (logits,
  per-example losses, a KV cache). What ``fn`` carries through a loop and fills
  from the batch (a KV cache) comes in as a batch argument too.

  The results are split over the batch axes as the batch was. On explicit
  axes (``jax.make_mesh``'s default) they are typed so, and JAX indexes them
  across the split only when told where the result goes:
  ``out.at[0].get(out_sharding=jax.NamedSharding(tx.mesh, jax.P()))``, or
  ``np.asarray(out)[0]`` on the host.

  Args:
    fn: ``fn(params, *batch)`` returning a pytree of per-example arrays.
    tx: the ``ZeroTransformation`` that stores the parameters.

  Returns:
    ``f(params, *batch)`` returning ``fn``'s outputs for the whole batch.

  Example:
    >>> import jax, jax.numpy as jnp, optax, zerojax
    >>> tx = zerojax.zero3(optax.sgd(0.1), mesh=jax.make_mesh((jax.device_count(),), ("data",)))
    >>> params = tx.shard({"w": jnp.eye(64)})
    >>> logits = lambda params, x: x @ zerojax.gather(params)["w"]
    >>> x = jnp.arange(8 * 64.0).reshape(8, 64)
    >>> bool(jnp.all(jax.jit(zerojax.forward(logits, tx))(params, x) == x))
    True
  """
  try:
    optimizer = zero_lib.unwrap(tx)
  except ValueError as error:
    raise ValueError(f"forward needs the zerojax transformation: {error}") from None
  return _Forward(fn, optimizer)


class _Forward:
  """The function ``forward`` returns: one data-parallel forward program."""

  def __init__(self, fn: Callable[..., Any], optimizer: Any):
    self.fn = fn
    self.optimizer = optimizer
    self.settings = optimizer.settings

  def __call__(self, params: Any, *batch: Any) -> Any:
    if not jax.tree.leaves(batch):
      raise ValueError(
        "zerojax.forward's function was called with no batch arguments: forward runs fn on "
        "each device's slice of a batch and lays the results side by side, so without one "
        "every device's result would be stacked. Pass the batch (inputs, a KV cache) after "
        "the parameters, or compute what needs no batch on tx.gather(params)."
      )
    settings = self.settings
    plans, params, batch, (param_specs, batch_specs) = grad_lib.placed(
      self.optimizer, params, batch
    )

    def per_device(params, *batch):
      opened = grad_lib.per_leaf_route(
        plans.sharded, settings, lambda route, leaf, p: route.for_forward(leaf, p, settings), params
      )
      rows = jnp.shape(jax.tree.leaves(batch)[0])[0]  # every batch leaf has as many
      return _per_example(
        self.fn(opened, *batch), rows, settings.num_shards * settings.num_replicas
      )

    try:
      return jax.shard_map(
        ordering.ordered(settings.mesh, per_device),
        mesh=settings.mesh,
        in_specs=(param_specs, *batch_specs),
        out_specs=P(settings.batch_axes),
        axis_names=set(settings.batch_axes),
      )(params, *batch)
    except TypeError as error:
      # JAX finds it only once fn is traced: a loop's carry that fn made (the same on every
      # device) comes out of the loop body varying over the batch axes.
      line = next((x for x in str(error).splitlines() if _CARRY_MISMATCH in x), None)
      if line is None:
        raise
      jax_says = line.strip().rstrip(".")
      raise ValueError(
        "zerojax.forward's fn carries a value it made itself through a loop (jax.lax.scan, "
        "jax.lax.fori_loop, zerojax.scan) and fills it from the batch: the value starts the "
        "same on every device and comes out of the loop each device's own, which JAX refuses "
        f"({jax_says}). To sample, pass a KV cache as a batch argument, f(params, tokens, "
        "cache, ...), split over the devices like the batch, and return it; a carry that is "
        "not per example starts as jax.lax.pcast(value, tx.batch_axes, to='varying')."
      ) from error


#: What JAX says of a loop's carry whose manual axes (varying or not) change in the loop body.
_CARRY_MISMATCH = "so the manual axis types do not match"


def _per_example(out: Any, rows: int, devices: int) -> Any:
  """``out``, checked to have a leading axis of the device's ``rows`` in every leaf.

  The devices' results are laid side by side along it, so a leaf without it (a
  gathered parameter) would come back once per device.
  """
  for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
    where, shape = jax.tree_util.keystr(path) or "its output", tuple(jnp.shape(leaf))
    if not shape:
      raise ValueError(
        f"zerojax.forward's fn returned a scalar at {where}: each device runs fn on its slice "
        "of the batch, and the results are laid side by side along the batch axis. Return "
        "per-example values (the per-example losses, say: jnp.mean of them outside forward is "
        "the loss on the whole batch)."
      )
    if shape[0] != rows:
      raise ValueError(
        f"zerojax.forward's fn returned {where} of shape {shape} on each device, where the "
        f"batch has {rows} rows (of {rows * devices}, split over {devices} devices): the "
        "devices' results are laid side by side along the leading axis, so a value that is "
        f"not per example would come back {devices} times over. Return per-example values, "
        "a leading axis of the device's rows in every leaf; gather parameters outside forward "
        "with tx.gather(params)."
      )
  return out
