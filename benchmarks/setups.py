"""The ways the benchmarks train the model: plain JAX's and zerojax's, each one a ``Setup``.

Replicated data parallelism and GSPMD FSDP in plain JAX, and zerojax's stages
on the explicit path (``zerojax.value_and_grad``) and the drop-in path (plain
``jax.value_and_grad``). A setup holds its jitted step and the arguments it
takes; built from ``model.abstract_params`` and ``model.abstract_batch``, its
arguments are ``jax.ShapeDtypeStruct`` s with their shardings, which compile
(``Setup.compile``) but do not run. Nothing here picks a platform:
``use_devices`` fakes CPU devices only on a machine without accelerators.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from model import AXIS, ModelConfig, init_params, make_loss

import zerojax

#: zerojax's stages by number.
ZERO = {1: zerojax.zero1, 2: zerojax.zero2, 3: zerojax.zero3}


def use_devices(count: int | None = None) -> list[jax.Device]:
  """The first ``count`` devices of the platform JAX picks (all of them with ``None``).

  Call it before anything touches a device. On a machine without accelerators,
  JAX's CPU backend fakes ``count`` devices (``zerojax.distributed.use_cpu_devices``,
  which changes only the CPU platform); on GPUs or TPUs ``count`` takes that
  many accelerators. Nothing here picks or forces a platform.

  Raises:
    ValueError: if the platform has fewer than ``count`` devices.
  """
  if count is not None:
    zerojax.distributed.use_cpu_devices(count)
  devices = jax.devices()
  if count is not None and len(devices) < count:
    raise ValueError(
      f"--devices {count}, but {devices[0].platform} has {len(devices)}: pass --devices "
      f"{len(devices)} or fewer."
    )
  return devices[:count]


def flat_mesh(devices: list[jax.Device]) -> jax.sharding.Mesh:
  """A mesh of one ``Auto`` axis, ``data``, over ``devices``."""
  return jax.make_mesh((len(devices),), (AXIS,), axis_types=(AxisType.Auto,), devices=devices)


@dataclasses.dataclass
class Setup:
  """One way of training the model: its jitted step and the arguments it takes.

  Attributes:
    name: what the tables call it.
    jitted: ``(params, state, tokens, targets) -> (params, state, loss)``, jitted.
    batch: the ``(tokens, targets)`` it trains on.
    params: the current parameters (``jax.ShapeDtypeStruct`` s in an abstract setup).
    state: the current optimizer state (likewise).
    compiled: ``jitted`` compiled for the arguments, once ``compile`` ran.
    loss: the last step's loss.
  """

  name: str
  jitted: Any
  batch: tuple[Any, Any]
  params: Any
  state: Any
  compiled: jax.stages.Compiled | None = None
  loss: float = float("nan")

  def compile(self) -> jax.stages.Compiled:
    """Compiles the step for its arguments (arrays or ``jax.ShapeDtypeStruct`` s), once."""
    if self.compiled is None:
      self.compiled = self.jitted.lower(self.params, self.state, *self.batch).compile()
    return self.compiled

  def profile(self) -> zerojax.diagnostics.StepProfile:
    """``zerojax.diagnostics.profile`` of the step (compiled already: nothing compiles again)."""
    return zerojax.diagnostics.profile(self.jitted, self.params, self.state, *self.batch)


def is_abstract(tree: Any) -> bool:
  """Whether ``tree`` holds ``jax.ShapeDtypeStruct`` s rather than arrays."""
  return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def _evaluated(fn: Callable[[Any], Any], tree: Any) -> Any:
  """``fn(tree)``, or its ``jax.ShapeDtypeStruct`` s when ``tree`` is abstract (nothing runs)."""
  return jax.eval_shape(fn, tree) if is_abstract(tree) else fn(tree)


def _placed(tree: Any, shardings: Any) -> Any:
  """``tree`` put on ``shardings`` (arrays), or described with them (``ShapeDtypeStruct`` s)."""
  if not is_abstract(tree):
    return jax.device_put(tree, shardings)
  return jax.tree.map(
    lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree, shardings
  )


def fsdp_spec(
  shape: tuple[int, ...],
  num_shards: int,
  min_size: int = zerojax.DEFAULT_MIN_SHARD_SIZE,
  axes: Any = AXIS,
) -> P:
  """Shards over ``axes`` (``data``) the dimension zerojax's default layout picks, or replicates.

  The dimension is ``zerojax.default_shard_dim``'s: never the leading
  (layer) dimension of a stacked weight, which the scan slices, and among the
  others the most major that divides by ``num_shards``. So GSPMD FSDP places
  every leaf as zerojax stage 3 does. Leaves smaller than ``min_size`` stay
  replicated, and so does a leaf no dimension of which divides (zerojax
  would pad it; a ``NamedSharding`` cannot).
  """
  dim = zerojax.default_shard_dim(shape, num_shards)
  if dim is None or int(np.prod(shape)) < min_size or shape[dim] % num_shards:
    return P()
  spec = [None] * len(shape)
  spec[dim] = axes
  return P(*spec)


def plain_setup(
  name, loss, opt, params, batch, spec_of: Callable[[tuple[int, ...]], P], batch_axes: Any = AXIS
) -> Setup:
  """A plain-JAX step (``jax.value_and_grad`` + ``opt``), every leaf placed by ``spec_of(shape)``.

  The batch's first dimension is split over ``batch_axes`` (a mesh axis or
  tuple of axes: ``data``); parameters and optimizer state are donated.
  """

  def step(params, state, tokens, targets):
    value, grads = jax.value_and_grad(loss)(params, tokens, targets)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  mesh = batch[0].sharding.mesh
  sharding_of = lambda x: NamedSharding(mesh, spec_of(x.shape))
  params_sharding = jax.tree.map(sharding_of, params)
  params = _placed(params, params_sharding)
  state = _evaluated(opt.init, params)
  state_sharding = jax.tree.map(sharding_of, state)
  state = _placed(state, state_sharding)
  batch_sharding = NamedSharding(mesh, P(batch_axes))
  jitted = jax.jit(
    step,
    in_shardings=(params_sharding, state_sharding, batch_sharding, batch_sharding),
    out_shardings=(params_sharding, state_sharding, NamedSharding(mesh, P())),
    donate_argnums=(0, 1),
  )
  return Setup(name, jitted, batch, params, state)


def zero_setup(name, tx, grad_fn, params, batch) -> Setup:
  """A step of ``grad_fn`` + the zerojax ``tx``, parameters placed with ``tx.shard``."""

  def step(params, state, tokens, targets):
    value, grads = grad_fn(params, tokens, targets)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  param_shardings, state_shardings = tx.param_shardings(params), tx.state_shardings(params)
  # The state first, from the full parameters: under a precision policy with a master copy,
  # placing them rounds to the compute dtype.
  state = _placed(_evaluated(tx.init, params), state_shardings)
  placed = _placed(_evaluated(tx.shard, params), param_shardings)
  jitted = jax.jit(
    step,
    out_shardings=(param_shardings, state_shardings, NamedSharding(tx.mesh, P())),
    donate_argnums=(0, 1),
  )
  return Setup(name, jitted, batch, placed, state)


def replicated_dp(config: ModelConfig, params, batch) -> Setup:
  """Parameters and Adam state on every device; GSPMD all-reduces the gradients."""
  mesh = batch[0].sharding.mesh
  loss = make_loss(config, NamedSharding(mesh, P(AXIS)), stack="gather")
  return plain_setup("replicated DP", loss, optax.adam(1e-3), params, batch, lambda _: P())


def gspmd_fsdp(config: ModelConfig, params, batch, *, constrain_activations=True) -> Setup:
  """Parameters and Adam state sharded with ``NamedSharding``; GSPMD does the rest."""
  mesh = batch[0].sharding.mesh
  activations = NamedSharding(mesh, P(AXIS)) if constrain_activations else None
  name = "GSPMD FSDP" if constrain_activations else "GSPMD FSDP, no act. constraint"
  loss = make_loss(config, activations, stack="gather")
  spec_of = lambda shape: fsdp_spec(shape, mesh.shape[AXIS])
  return plain_setup(name, loss, optax.adam(1e-3), params, batch, spec_of)


def zero_explicit(config: ModelConfig, params, batch, *, stage: int, stack="scan", **options):
  """``zerojax.value_and_grad``, the layers run as ``stack`` says (see ``model.STACKS``).

  ``options`` go to ``zerojax.zero{stage}`` (``quantized_weights``,
  ``replica_axis``, ...). The setup is named ``zero{stage} explicit``, with the
  stack after a comma unless it is ``zerojax.scan``'s default.
  """
  tx = ZERO[stage](optax.adam(1e-3), mesh=batch[0].sharding.mesh, axis_name=AXIS, **options)
  grad_fn = zerojax.value_and_grad(make_loss(config, stack=stack), tx)
  name = f"zero{stage} explicit" + ("" if stack == "scan" else f", {stack}")
  return zero_setup(name, tx, grad_fn, params, batch)


def zero_dropin(config: ModelConfig, params, batch, *, stage: int, **options) -> Setup:
  """Plain ``jax.value_and_grad``; only the optimizer is wrapped."""
  mesh = batch[0].sharding.mesh
  tx = ZERO[stage](optax.adam(1e-3), mesh=mesh, axis_name=AXIS, **options)
  loss = make_loss(config, NamedSharding(mesh, P(AXIS)), stack="gather")
  return zero_setup(f"zero{stage} drop-in", tx, dropin_grad(tx, loss), params, batch)


def dropin_grad(tx: Any, loss: Callable[..., Any]) -> Callable[..., Any]:
  """Plain ``jax.value_and_grad`` of ``loss`` on the parameters as arrays the model can use
  (``tx.unpad``: stage 3 stores each leaf as a ``zerojax.Stored``)."""
  return lambda params, *batch: jax.value_and_grad(loss)(tx.unpad(params), *batch)


def build_setups(config: ModelConfig, batch, builders: tuple[Callable, ...]) -> list[Setup]:
  """The setups of ``builders`` (``(config, params, batch) -> Setup``), compiled, same start each.

  Each starts from ``init_params(config, key(0))`` on the mesh of ``batch``.
  """
  setups = []
  for build in builders:
    setups.append(build(config, init_params(config, jax.random.key(0)), batch))
    setups[-1].compile()
    print(f"compiled {setups[-1].name}", flush=True)
  return setups
