"""The training loop of examples/train_lm.py: build, resume, compile, train, evaluate, report.

``train`` reads top to bottom: the data, the model and the stage's step; the
state, fresh or from the latest checkpoint; one compilation; the loop (a
step, its loss logged, a checkpoint, a preemption check, a validation now and
then); and the report (memory per device next to stage 0's, a sample, the
metrics and the plot).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax

from . import configs, report, stages
from . import data as lm_data
from . import model as lm_model


def train(config: configs.Config, mesh: jax.sharding.Mesh) -> dict[str, Any]:
  """Trains, evaluates and samples on ``mesh``; returns the metrics and writes them to ``out``."""
  leader = jax.process_index() == 0  # in a multi-process run, the one that prints and writes
  say = print if leader else lambda *_, **__: None
  batches = lm_data.Batches(config, mesh)
  model = lm_model.make_model(config.preset, config.seq_len, config.prefetch)
  loss = functools.partial(lm_model.loss_fn, model=model)
  optimizer = stages.make_optimizer(config.lr, config.steps)
  setup = stages.make_setup(
    config.stage, mesh, optimizer, loss, config.microbatches, **zero_options(config)
  )
  initial = stages.place_on_model_axis(lm_model.init_params(model, config.seed), mesh)
  n_params = sum(x.size for x in jax.tree.leaves(initial))
  # The optimizer state (with the fp32 master copy) first: placing may round to --precision.
  opt_state = setup.init(initial)
  params = setup.place(initial)
  loss_log = report.start_loss_log(config.out, keep=config.resume) if leader else None
  checkpoints = open_checkpoints(config, setup.tx, initial)
  params, opt_state, first_step = resume(config, checkpoints, params, opt_state, say)
  if first_step > config.steps:  # e.g. a restart loop that runs once more after the last save
    return nothing_left(config, checkpoints, first_step, say)

  platform = jax.devices()[0].platform
  say(report.describe(config, n_params, platform, batches.corpus))
  say(f"unigram baseline: validation loss {batches.unigram_loss:.3f} nats/byte")
  # Compiled ahead of time: the loop calls this one executable, which refuses
  # (rather than silently recompiles for) arguments of another shape or sharding.
  start = time.perf_counter()
  compiled = setup.step.lower(params, opt_state, *batches.train(0)).compile()
  compile_seconds = time.perf_counter() - start
  evaluate = jax.jit(lambda params, x, y: loss(setup.gather(params), x, y))

  history = report.History(first_step)
  progress = report.Progress(config, first_step, enabled=leader)
  for step in range(first_step, config.steps + 1):
    x, y = batches.train(step)
    start = time.perf_counter()
    params, opt_state, value = compiled(params, opt_state, x, y)
    history.record(float(value), time.perf_counter() - start, opt_state)
    if loss_log:
      report.log_loss(loss_log, step, history.train_loss[-1])
    # Every process, every step: True at the same step on all once any got SIGTERM.
    preempted = zerojax.distributed.preemption_requested(step)
    if checkpoints:
      save(checkpoints, mesh, step, params, opt_state, force=step == config.steps or preempted)
    if preempted:
      progress.close()
      exit_preempted(config, checkpoints, step, say)
    progress.step(step, report.progress(history, opt_state, tokens=x.size))
    if step % config.eval_every == 0 or step == config.steps:
      history.val_loss.append({"step": step, "loss": float(evaluate(params, *batches.validation))})
      progress.write(report.validation(history, batches.unigram_loss))
  progress.close()
  if checkpoints:
    checkpoints.close()  # waits for the last save
    say(f"checkpoints {checkpoints.all_steps()} in {config.checkpoint_dir}")

  memory = {f"stage {config.stage}": report.memory_stats(compiled, params, opt_state)}
  sample = None
  if config.report:
    full_params = setup.gather(params)
    if config.stage:  # the baseline holds a whole replica of parameters and optimizer state
      stage0 = stage0_memory(mesh, optimizer, loss, full_params, batches.train(0))
      memory = {"stage 0": stage0, **memory}
    say(report.format_memory(memory))
    sample = lm_model.sample(full_params, model, jax.random.key(config.seed))
    say(f"sample:\n{sample}")
  metrics = report.metrics(
    config,
    history,
    n_params=n_params,
    platform=platform,
    unigram_loss=batches.unigram_loss,
    skipped_steps=int(opt_state.skipped_steps) if config.stage else 0,
    compile_seconds=compile_seconds,
    memory=memory,
    sample=sample,
  )
  if leader:
    report.write(config.out, metrics)
  return metrics


def zero_options(config: configs.Config) -> dict[str, Any]:
  """The keyword arguments of ``zerojax.zero{stage}`` the flags set (none for stage 0)."""
  if not config.stage:
    return {}
  return dict(
    precision=config.precision,
    quantized_weights=config.quantized_weights,
    quantized_gradients=config.quantized_gradients,
    quantization_block_size=config.quantization_block_size,
    offload=config.offload,
    secondary_axis=config.secondary_axis,
  )


def open_checkpoints(
  config: configs.Config, tx: zerojax.ZeroTransformation | None, initial: Any
) -> zerojax.CheckpointManager | None:
  """The run's checkpoints (``None`` without ``--checkpoint-dir``)."""
  if not config.checkpoint_dir:
    return None
  spec = zerojax.train_state_spec(tx, initial, step=np.int32(0))
  return zerojax.CheckpointManager(
    config.checkpoint_dir, spec, max_to_keep=config.keep, save_interval_steps=config.save_every
  )


def resume(config: configs.Config, checkpoints, params, opt_state, say) -> tuple[Any, Any, int]:
  """With ``--resume``, the latest checkpoint's parameters and optimizer state and the step after.

  Otherwise, or without a checkpoint yet, ``params`` and ``opt_state`` and step 1.
  """
  if not config.resume or checkpoints.latest_step() is None:
    return params, opt_state, 1
  state = checkpoints.restore()
  step = int(state["step"])
  # The checkpoint may come from another device count (a host lost for good): say where it went.
  mesh = ", ".join(f"{name}={size}" for name, size in config.mesh_shape.items())
  say(
    f"resumed from step {step} in {config.checkpoint_dir} onto mesh {mesh} ({config.devices} "
    f"devices in {jax.process_count()} process(es), {config.microbatches} micro-batch(es))"
  )
  return state["params"], state["opt_state"], step + 1


def nothing_left(config: configs.Config, checkpoints, first_step: int, say) -> dict[str, Any]:
  """Closes the checkpoints of a run whose every step is trained, and says so."""
  checkpoints.close()
  say(
    f"all --steps {config.steps} are trained (the latest checkpoint is step {first_step - 1}): "
    f"nothing to do, and {config.out} is left as it is; raise --steps to train further."
  )
  return {"first_step": first_step, "train_loss": [], "val_loss": []}


def save(checkpoints, mesh, step: int, params: Any, opt_state: Any, *, force: bool) -> None:
  """Saves step ``step`` if it is due (every ``--save-every`` steps) or ``force``d."""
  state = {"params": params, "opt_state": opt_state, "step": np.int32(step)}
  state["step"] = jax.device_put(state["step"], NamedSharding(mesh, P()))
  checkpoints.save(step, state, force=force)


def exit_preempted(config: configs.Config, checkpoints, step: int, say) -> None:
  """After a preemption notice: waits for the save, says so, and exits "restart me" (75)."""
  if checkpoints:
    checkpoints.close()  # waits for the save
  saved = f"saved it to {config.checkpoint_dir}" if checkpoints else "no --checkpoint-dir"
  status = zerojax.distributed.PREEMPTED_EXIT_CODE
  say(f"preempted: stopped after step {step} ({saved}); exiting with status {status}")
  raise SystemExit(status)


def stage0_memory(mesh, optimizer, loss, full_params: Any, batch) -> dict[str, int]:
  """Per-device memory of the stage-0 step, which holds a whole replica of everything."""
  setup = stages.make_setup(0, mesh, optimizer, loss)
  params = stages.place_on_model_axis(full_params, mesh)
  opt_state = setup.init(params)
  compiled = setup.step.lower(params, opt_state, *batch).compile()
  return report.memory_stats(compiled, params, opt_state)
