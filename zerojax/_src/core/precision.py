"""Mixed precision: which dtype each copy of the parameters and gradients uses.

A ``Precision`` policy names three dtypes, as PyTorch FSDP's
``MixedPrecisionPolicy`` and DeepSpeed's fp16/bf16 modes do:

* ``params``: the master copy that the optimizer updates (and its state);
* ``compute``: what the loss function sees; stage 3 gathers weights in it, and
  stages 1 and 2 keep their replicated working copy in it;
* ``reduce``: what gradients are reduce-scattered in.

It also says what to do with a step whose gradients are not finite: skip it on
every device (parameters and optimizer state stay bit-identical), and, for
fp16, back the dynamic loss scale off.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

_NAMED = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
  """fp16 dynamic loss scaling, with DeepSpeed's defaults.

  The loss is multiplied by the scale before differentiating, and the
  gradients divided by it. A step whose gradients overflow is skipped; after
  ``hysteresis`` overflows (consecutive or not, since the last growth) the
  scale is halved, never below ``minimum``. After ``growth_interval`` steps
  without overflow the scale doubles.

  Attributes:
    initial: the first scale.
    growth_interval: overflow-free steps before the scale doubles.
    hysteresis: overflows tolerated before the scale is halved.
    minimum: the smallest scale.
    factor: what the scale is multiplied or divided by.

  Example:
    >>> import zerojax
    >>> zerojax.DynamicLossScale().initial
    65536.0
  """

  initial: float = 2.0**16
  growth_interval: int = 1000
  hysteresis: int = 2
  minimum: float = 1.0
  factor: float = 2.0

  def __post_init__(self):
    if not (self.minimum > 0 and self.initial >= self.minimum and self.factor > 1):
      raise ValueError(
        f"{self} is not a usable loss scale: it needs 0 < minimum <= initial and factor > 1."
      )
    if self.growth_interval < 1 or self.hysteresis < 1:
      raise ValueError(f"{self}: growth_interval and hysteresis must be at least 1.")


class LossScaleState(NamedTuple):
  """Where the dynamic loss scale stands.

  Attributes:
    scale: the current scale (float32 scalar).
    good_steps: overflow-free steps since the last overflow or growth.
    hysteresis: overflows still tolerated before the scale is halved.

  Example:
    >>> import jax, jax.numpy as jnp, optax, zerojax
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = zerojax.zero1(optax.sgd(0.1), mesh=mesh, precision="fp16")
    >>> loss_scale = tx.init({"w": jnp.zeros((8, 128))}).loss_scale
    >>> float(loss_scale.scale), int(loss_scale.good_steps), int(loss_scale.hysteresis)
    (65536.0, 0, 2)
  """

  scale: jax.Array
  good_steps: jax.Array
  hysteresis: jax.Array


@dataclasses.dataclass(frozen=True)
class Precision:
  """A mixed-precision policy for a ZeRO-wrapped optimizer.

  Pass one (or one of the names ``"fp32"``, ``"bf16"``, ``"fp16"``) as
  ``zerojax.zero3(..., precision=...)``. A dtype left ``None`` keeps each
  leaf's own dtype, so ``Precision()`` changes nothing. Only floating-point
  leaves are ever cast.

  Attributes:
    params: dtype of the master parameters that the optimizer updates. Stage 3
      stores them (sharded); stages 1 and 2 keep them, sharded, in the
      optimizer state whenever ``compute`` differs, and store a replicated
      ``compute`` copy as the parameters.
    compute: dtype the loss function sees the parameters in (default: the
      master dtype).
    reduce: dtype gradients are reduce-scattered (summed over devices) in,
      and, with hybrid sharding, all-reduced across replicas in (default:
      the master dtype).
    loss_scale: ``None``; a ``DynamicLossScale``; or a number, for a static
      scale.
    skip_nonfinite: skip a step, on every device, whose gradients hold an inf
      or a NaN: parameters and optimizer state stay bit-identical, and the
      state counts skipped steps. Defaults to True with a loss scale.

  Example:
    >>> import jax.numpy as jnp, zerojax
    >>> policy = zerojax.Precision.named("bf16")
    >>> policy.compute, policy.compute_dtype(jnp.float32), policy.reduce_dtype(jnp.float32)
    (dtype(bfloat16), dtype(bfloat16), dtype('float32'))
  """

  params: Any = None
  compute: Any = None
  reduce: Any = None
  loss_scale: DynamicLossScale | float | None = None
  skip_nonfinite: bool | None = None

  def __post_init__(self):
    set_ = lambda name, value: object.__setattr__(self, name, value)
    for name in ("params", "compute", "reduce"):
      set_(name, _float_dtype(getattr(self, name), name))
    if self.skip_nonfinite is None:
      set_("skip_nonfinite", self.loss_scale is not None)
    if self.loss_scale is not None and not isinstance(self.loss_scale, DynamicLossScale):
      if not float(self.loss_scale) > 0:
        raise ValueError(f"a static loss_scale must be positive, got {self.loss_scale}.")
      set_("loss_scale", float(self.loss_scale))

  @classmethod
  def named(cls, name: str) -> Precision:
    """The usual policies: float32 master weights and reductions, and

    * ``"fp32"``: float32 compute;
    * ``"bf16"``: bfloat16 compute;
    * ``"fp16"``: float16 compute with ``DynamicLossScale()`` (and skipped
      overflow steps).
    """
    if name not in _NAMED:
      raise ValueError(f"unknown precision {name!r}; use one of {sorted(_NAMED)} or a Precision.")
    loss_scale = DynamicLossScale() if name == "fp16" else None
    return cls(params="fp32", compute=name, reduce="fp32", loss_scale=loss_scale)

  def master_dtype(self, dtype: Any) -> np.dtype:
    """The master (optimizer-side) dtype of a leaf of ``dtype``."""
    return _pick(self.params, dtype)

  def compute_dtype(self, dtype: Any) -> np.dtype:
    """The dtype the loss function sees a leaf of ``dtype`` in."""
    return _pick(self.compute, self.master_dtype(dtype))

  def reduce_dtype(self, dtype: Any) -> np.dtype:
    """The dtype a leaf of ``dtype``'s gradient is reduce-scattered in."""
    return _pick(self.reduce, self.master_dtype(dtype))


def _pick(policy_dtype: np.dtype | None, dtype: Any) -> np.dtype:
  dtype = np.dtype(dtype)
  if policy_dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    return dtype
  return policy_dtype


def resolve(precision: Precision | str | None) -> Precision:
  """The policy a factory argument names (``None``: ``Precision()``, which casts nothing)."""
  if precision is None:
    return Precision()
  if isinstance(precision, str):
    return Precision.named(precision)
  if not isinstance(precision, Precision):
    raise ValueError(
      f"precision must be a zerojax.Precision or one of {sorted(_NAMED)}, got {precision!r}."
    )
  return precision


def _float_dtype(dtype: Any, what: str) -> np.dtype | None:
  if dtype is None:
    return None
  dtype = np.dtype(_NAMED.get(dtype, dtype)) if isinstance(dtype, str) else np.dtype(dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"precision {what} dtype must be a float dtype, got {dtype}.")
  return dtype


def init_loss_scale(policy: Precision) -> LossScaleState | None:
  """The loss-scale state a fresh optimizer state starts with."""
  if policy.loss_scale is None:
    return None
  config = policy.loss_scale
  static = not isinstance(config, DynamicLossScale)
  return LossScaleState(
    scale=jnp.asarray(config if static else config.initial, jnp.float32),
    good_steps=jnp.zeros((), jnp.int32),
    hysteresis=jnp.asarray(1 if static else config.hysteresis, jnp.int32),
  )


def adjust_loss_scale(
  policy: Precision, state: LossScaleState | None, finite: jax.Array
) -> LossScaleState | None:
  """The next loss-scale state after a step whose gradients were (not) ``finite``."""
  config = policy.loss_scale
  if state is None or not isinstance(config, DynamicLossScale):
    return state
  back_off = jnp.logical_and(~finite, state.hysteresis <= 1)
  good_steps = jnp.where(finite, state.good_steps + 1, 0)
  grow = good_steps >= config.growth_interval
  scale = jnp.where(back_off, jnp.maximum(state.scale / config.factor, config.minimum), state.scale)
  scale = jnp.where(grow, scale * config.factor, scale)
  hysteresis = jnp.where(finite, state.hysteresis, jnp.maximum(state.hysteresis - 1, 1))
  hysteresis = jnp.where(grow, config.hysteresis, hysteresis)
  return LossScaleState(scale, jnp.where(grow, 0, good_steps), hysteresis.astype(jnp.int32))


def all_finite(tree: Any) -> jax.Array:
  """Whether every element of every floating-point leaf is finite (one boolean)."""
  checks = [
    jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)
  ]
  return jnp.all(jnp.stack(checks)) if checks else jnp.asarray(True)


def select(keep_new: jax.Array, new: Any, old: Any) -> Any:
  """``new`` where ``keep_new``, else ``old``, leaf by leaf (bit-exact either way)."""
  return jax.tree.map(lambda n, o: jnp.where(keep_new, n, o), new, old)
