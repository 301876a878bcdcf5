"""``ZeroState``: what a ZeRO-wrapped optimizer keeps between steps, and checks on it."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from zerojax._src.core import precision as precision_lib


class ZeroState(NamedTuple):
  """The state of a ZeRO-wrapped optimizer.

  Attributes:
    inner_state: the wrapped optimizer's state, every float leaf big enough to
      matter sharded over the data axis (and zero-padded along the sharded
      dimension where that dimension does not divide by the number of devices).
    master: stages 1 and 2 under a precision policy whose compute dtype
      differs from its master dtype: the master parameters, sharded like the
      gradients (the parameters themselves are the replicated compute-dtype
      copy). ``None`` otherwise.
    loss_scale: the ``zerojax.LossScaleState`` when the policy scales the loss,
      else ``None``.
    skipped_steps: how many updates were skipped because their gradients were
      not finite (int32 scalar).
    pre_clip_grad_norm: the global L2 norm of the gradients the last
      ``update`` received, before the wrapped optimizer (and any clipping in
      it) saw them (float32 scalar).

  Example:
    >>> import jax, jax.numpy as jnp, optax, zerojax
    >>> tx = zerojax.zero2(optax.adam(1e-3), mesh=jax.make_mesh((jax.device_count(),), ("data",)))
    >>> state = tx.init({"w": jnp.ones((4, 1024))})
    >>> state.inner_state[0].mu["w"].sharding.shard_shape((4, 1024)), int(state.skipped_steps)
    ((4, 128), 0)
  """

  inner_state: optax.OptState
  master: optax.Params | None = None
  loss_scale: precision_lib.LossScaleState | None = None
  skipped_steps: jax.Array | None = None
  pre_clip_grad_norm: jax.Array | None = None


def fresh_loss_scale_and_counters(policy: precision_lib.Precision) -> dict[str, Any]:
  """A fresh state's ``loss_scale``, ``skipped_steps`` and ``pre_clip_grad_norm`` fields.

  The ``ZeroState`` fields besides the wrapped optimizer's state and the master copy.
  """
  return dict(
    loss_scale=precision_lib.init_loss_scale(policy),
    skipped_steps=jnp.zeros((), jnp.int32),
    pre_clip_grad_norm=jnp.zeros((), jnp.float32),
  )


def check_policy(
  state: Any, *, master: bool | None = None, loss_scaled: bool | None = None
) -> None:
  """Raises unless ``state`` is a ``ZeroState`` with (or without) a master copy and loss scale.

  ``None`` leaves that part unchecked.
  """
  if not isinstance(state, ZeroState):
    raise ValueError(
      f"state is a {type(state).__name__}, not a ZeroState: pass the state "
      "that this transformation's init returned."
    )
  for what, expected, has in (
    ("master parameters", master, state.master is not None),
    ("a loss scale", loss_scaled, state.loss_scale is not None),
  ):
    if expected is not None and expected != has:
      raise ValueError(
        f"the optimizer state was made for another precision policy (it "
        f"{'has' if has else 'lacks'} {what}): pass the state that this "
        "transformation's init returned."
      )
