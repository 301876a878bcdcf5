"""The training loop of examples/train_lm.py: build, resume, compile, train, evaluate, report.

``train`` reads top to bottom: the data, the model and the stage's step; the
state, fresh or from the latest checkpoint; one compilation; the loop (a
step, its loss logged, a checkpoint, a preemption check, a validation now and
then); and the report (memory per device next to stage 0's, a sample, the
metrics and the plot).
"""

from __future__ import annotations

import functools
import json
import math
import pathlib
import time
from typing import Any, NamedTuple

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
  # Evaluation and sampling run the layers in turn; with pipeline stages, as stages of one
  # micro-batch (the parameters stay where the step keeps them). The step's model runs the
  # flags' schedule. Both have the same parameters.
  model = lm_model.make_model(
    config.preset, config.seq_len, config.prefetch, config.pipeline and "gpipe"
  )
  stepped = lm_model.make_model(
    config.preset, config.seq_len, config.prefetch, config.pipeline, config.microbatches
  )
  loss = functools.partial(lm_model.loss_fn, model=model)
  example_losses = functools.partial(lm_model.example_losses, model=model)
  schedule = learning_rate_schedule(config, say)
  optimizer = stages.make_optimizer(schedule.lr, schedule.steps)
  step_loss = functools.partial(lm_model.loss_fn, model=stepped)
  setup = stages.make_setup(
    config.stage, mesh, optimizer, step_loss, config.microbatches, **zero_options(config)
  )
  initial = stages.place_on_model_axis(lm_model.init_params(model, config.seed), mesh)
  n_params = sum(x.size for x in jax.tree.leaves(initial))
  # What stage 0's step is compiled for at the end, for its memory: the step donates the
  # arrays a stage may store as they are.
  abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  replica = jax.tree.map(abstract, initial)
  # The optimizer state (with the fp32 master copy) first: placing may round to --precision.
  opt_state = setup.init(initial)
  params = setup.place(initial)
  checkpoints = open_checkpoints(config, setup.tx, initial)
  params, opt_state, first_step = resume(config, checkpoints, params, opt_state, say)
  if first_step > config.steps:  # e.g. a restart loop that runs once more after the last save
    return nothing_left(config, checkpoints, first_step, say)
  if checkpoints:
    check_nothing_in_the_way(config, checkpoints, first_step)
    if leader:
      schedule.record(config.checkpoint_dir)
  loss_log = report.start_loss_log(config.out, keep=config.resume) if leader else None

  platform = jax.devices()[0].platform
  say(report.describe(config, n_params, platform, batches.corpus))
  say(f"unigram baseline: validation loss {batches.unigram_loss:.3f} nats/byte")
  # Compiled ahead of time: the loop calls this one executable, which refuses
  # (rather than silently recompiles for) arguments of another shape or sharding.
  start = time.perf_counter()
  compiled = setup.step.lower(params, opt_state, *batches.train(0)).compile()
  compile_seconds = time.perf_counter() - start
  # On the parameters as stored: each device evaluates its windows, a layer opened at a time.
  evaluate = jax.jit(lambda params, x, y: setup.forward(example_losses)(params, x, y).mean())

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
    if config.stage:  # the baseline holds a whole replica of parameters and optimizer state
      stage0 = stage0_memory(mesh, optimizer, loss, replica, batches.train(0))
      memory = {"stage 0": stage0, **memory}
    say(report.format_memory(memory))
    # One continuation a device (the first is printed): sampling splits its rows like a batch.
    rows = math.prod(mesh.shape[axis] for axis in setup.tx.batch_axes) if setup.tx else 1
    sample = lm_model.sample(setup.forward, params, model, jax.random.key(config.seed), rows)
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
    report.write(config.out, metrics, with_plot=config.report)
  return metrics


def zero_options(config: configs.Config) -> dict[str, Any]:
  """The keyword arguments of ``zerojax.zero{stage}`` the flags set (none for stage 0)."""
  if not config.stage:
    return {}
  options: dict[str, Any] = dict(
    precision=config.precision,
    quantized_gradients=config.quantized_gradients,
    quantization_block_size=config.quantization_block_size,
    offload=config.offload,
  )
  if config.stage == 3:  # what only stage 3, which gathers weights, takes
    options.update(quantized_weights=config.quantized_weights, secondary_axis=config.secondary_axis)
  return options


class Schedule(NamedTuple):
  """The learning-rate schedule's peak rate and length (``stages.make_optimizer``'s)."""

  lr: float
  steps: int

  #: Where a run with checkpoints records its schedule, in ``--checkpoint-dir``.
  FILE = "schedule.json"

  def record(self, directory: pathlib.Path) -> None:
    """Writes the schedule into ``directory`` unless one is recorded there already."""
    path = directory / self.FILE
    if not path.exists():
      path.write_text(json.dumps(self._asdict()))


def learning_rate_schedule(config: configs.Config, say) -> Schedule:
  """The flags' schedule; under ``--resume``, the one the checkpoints were trained with.

  A resumed run keeps the schedule it started with, so that its steps get the
  learning rates of an uninterrupted run: a larger ``--steps`` trains on at the
  schedule's final rate, a smaller one stops early.

  Raises:
    configs.FlagsError: if ``--lr`` is not the rate the checkpoints were trained with.
  """
  ours = Schedule(config.lr, config.steps)
  path = config.checkpoint_dir and config.checkpoint_dir / Schedule.FILE
  if not (config.resume and path.exists()):
    return ours
  recorded = Schedule(**json.loads(path.read_text()))
  if recorded.lr != config.lr:
    raise configs.FlagsError(
      f"--lr {config.lr:g}, but the checkpoints in {config.checkpoint_dir} were trained with "
      f"--lr {recorded.lr:g}: resume with --lr {recorded.lr:g} (the learning-rate schedule "
      "belongs to the checkpoints), or start a new run in another --checkpoint-dir"
    )
  if recorded.steps != config.steps:
    final = recorded.lr / stages.FINAL_LR_DIVISOR
    past = f", and stays at its final {final:g} past it" if config.steps > recorded.steps else ""
    say(
      f"--steps {config.steps}: the learning rate follows the schedule these checkpoints "
      f"started with (warmup and cosine decay over --steps {recorded.steps}){past}"
    )
  return recorded


def open_checkpoints(
  config: configs.Config, tx: zerojax.ZeroTransformation | None, initial: Any
) -> zerojax.CheckpointManager | None:
  """The run's checkpoints (``None`` without ``--checkpoint-dir``).

  Raises:
    configs.FlagsError: if the directory holds checkpoints and ``--resume`` is
      not given (the run would fail at its first save over them).
  """
  if not config.checkpoint_dir:
    return None
  spec = zerojax.train_state_spec(tx, initial, step=np.int32(0))
  checkpoints = zerojax.CheckpointManager(
    config.checkpoint_dir, spec, max_to_keep=config.keep, save_interval_steps=config.save_every
  )
  if checkpoints.all_steps() and not config.resume:
    checkpoints.close()
    raise configs.FlagsError(
      f"--checkpoint-dir {config.checkpoint_dir} holds the checkpoints "
      f"{checkpoints.all_steps()} of an earlier run: pass --resume to continue it, or another "
      "--checkpoint-dir to start over (or delete these)"
    )
  return checkpoints


def check_nothing_in_the_way(config: configs.Config, checkpoints, first_step: int) -> None:
  """Raises ``configs.FlagsError`` if something that is not a checkpoint has the name of one
  this run would save (steps ``first_step`` to ``--steps``), before any training."""
  saved = set(checkpoints.all_steps())
  for step in range(first_step, config.steps + 1):
    path = config.checkpoint_dir / str(step)
    if path.exists() and step not in saved:
      checkpoints.close()
      raise configs.FlagsError(
        f"--checkpoint-dir {config.checkpoint_dir}: {path} is in the way of this run's "
        f"checkpoint of step {step} (it is not a checkpoint): move it out of "
        f"{config.checkpoint_dir}, or pass another --checkpoint-dir"
      )


def resume(config: configs.Config, checkpoints, params, opt_state, say) -> tuple[Any, Any, int]:
  """With ``--resume``, the latest checkpoint's parameters and optimizer state and the step after.

  Otherwise, or without a checkpoint yet, ``params`` and ``opt_state`` and step 1.

  Raises:
    configs.FlagsError: if the checkpoints do not fit the flags (another
      ``--model`` or ``--precision``), or none can be read.
  """
  if not config.resume or checkpoints.latest_step() is None:
    return params, opt_state, 1
  try:
    state = checkpoints.restore()
  except ValueError as error:
    checkpoints.close()
    raise configs.FlagsError(f"--resume from {config.checkpoint_dir}: {error}") from None
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
    f"nothing to do, and {config.out} is left as it is; raise --steps to train further (at the "
    "schedule's final learning rate)."
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


def stage0_memory(mesh, optimizer, loss, params: Any, batch) -> dict[str, int]:
  """Per-device memory of the stage-0 step, which holds a whole replica of everything.

  ``params`` are abstract (``jax.ShapeDtypeStruct`` s), placed as stage 0 keeps them.
  """
  setup = stages.make_setup(0, mesh, optimizer, loss)
  replicated = NamedSharding(mesh, P())  # where an abstract leaf (a step count) says nothing
  opt_state = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding or replicated),
    jax.eval_shape(setup.init, params),
  )
  compiled = setup.step.lower(params, opt_state, *batch).compile()
  return report.memory_stats(compiled, params, opt_state)
