"""How each stage stores, initialises and trains the parameters: ZeRO 1-3, or 0 for plain DP.

``make_setup`` is the one place that tells the stages apart: stages 1 to 3
wrap the optimizer with ``zerojax.zero1/2/3`` and take gradients with
``zerojax.value_and_grad``; stage 0 replicates everything and uses plain
``jax.value_and_grad``. Both give a jitted step of the same signature.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax

from . import model as lm_model


class Setup(NamedTuple):
  """How one stage stores, initialises, trains and reads the parameters.

  Attributes:
    place: full parameters -> parameters as the stage stores them.
    init: full-precision parameters -> optimizer state.
    step: the jitted ``(params, opt_state, x, y) -> (params, opt_state, loss)``,
      which donates the parameters and the optimizer state.
    forward: ``fn(params, *batch) -> per-example outputs`` -> the same on
      stored parameters, each device on its slice of the batch, never
      gathering the model (``zerojax.forward``; stage 0 calls ``fn``).
    tx: the zerojax transformation (``None`` for stage 0).
  """

  place: Callable[[Any], Any]
  init: Callable[[Any], Any]
  step: jax.stages.Wrapped
  forward: Callable[[Callable], Callable]
  tx: zerojax.ZeroTransformation | None


#: The peak learning rate over the one at the end of the schedule (and after it).
FINAL_LR_DIVISOR = 10


def make_optimizer(lr: float, steps: int) -> optax.GradientTransformation:
  """Global-norm clipping and AdamW with linear warmup and cosine decay over ``steps``."""
  warmup = max(1, steps // 20)
  schedule = optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=lr,
    warmup_steps=warmup,
    decay_steps=max(steps, warmup + 1),  # optax needs some decay after the warmup
    end_value=lr / FINAL_LR_DIVISOR,
  )
  return optax.chain(
    optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.95, weight_decay=0.01)
  )


def make_setup(
  stage: int,
  mesh: jax.sharding.Mesh,
  optimizer: optax.GradientTransformation,
  loss: Callable,
  microbatches: int = 1,
  **options: Any,
) -> Setup:
  """The ``Setup`` of ``stage``: ZeRO 1-3 through zerojax, or 0 for replicated data parallelism.

  The parameters ``place`` and ``init`` take are full, and placed on the mesh's
  tensor-parallel axis if it has one (``place_on_model_axis``). ``options``
  (``precision``, ``quantized_weights``, ...) go to ``zerojax.zero{stage}``.
  """
  if stage == 0:
    plain_grad_fn = jax.value_and_grad(loss)
    grad_fn = lambda params, x, y, opt_state: plain_grad_fn(params, x, y)
    tx = None
    place = lambda params: params
    init, forward = jax.jit(optimizer.init), lambda fn: fn
  else:
    tx = (zerojax.zero1, zerojax.zero2, zerojax.zero3)[stage - 1](
      optimizer,
      mesh=mesh,
      axis_name=tuple(axis for axis in ("node", "data") if axis in mesh.axis_names),
      replica_axis="replica" if "replica" in mesh.axis_names else None,
      **options,
    )
    # With pipeline stages, the pipeline splits the batch into the micro-batches.
    accumulated = 1 if "stage" in mesh.axis_names else microbatches
    grad_fn = zerojax.value_and_grad(loss, tx, microbatches=accumulated)
    place, init = tx.shard, tx.init
    forward = lambda fn: zerojax.forward(fn, tx)

  def step(params, opt_state, x, y):
    # The optimizer state carries the fp16 loss scale (and is ignored by stage 0).
    value, grads = grad_fn(params, x, y, opt_state=opt_state)
    updates, opt_state = (tx or optimizer).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return Setup(place, init, jax.jit(step, donate_argnums=(0, 1)), forward, tx)


def place_on_model_axis(params: Any, mesh: jax.sharding.Mesh) -> Any:
  """``params`` on ``mesh``: Megatron-style over ``model`` if the mesh has it, else replicated;
  the stacked layers split over ``stage`` (a stage's layers each) if it has that."""
  if "model" in mesh.axis_names:
    specs = lm_model.tensor_parallel_specs(params)
  else:
    specs = jax.tree.map(lambda _: P(), params)
  if "stage" in mesh.axis_names:
    specs = lm_model.pipeline_specs(specs)
  shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
  return jax.device_put(params, shardings)
