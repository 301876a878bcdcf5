"""Trains a character-level GPT on the Python standard library with ZeRO stage 0, 1, 2 or 3.

The model (examples/lm_model.py) is a byte-level transformer whose scanned
layers gather one layer at a time; the data (examples/lm_data.py) is the
running interpreter's standard library, no download. Gradients come from
``zerojax.value_and_grad``, which runs the loss once per device on its slice of
the batch. Stage 0 is the baseline: replicated parameters and optimizer state,
plain ``jax.value_and_grad`` under ``jax.jit``. At the end the script prints the
compiled train step's per-device memory next to stage 0's, writes
``metrics.json`` and ``loss.png`` to ``--out``, and prints a sample. Every
step's training loss is appended to ``--out``/``losses.jsonl`` as it is computed
(a line ``{"step": 5, "loss": 2.31...}``; with ``--resume`` the file is
continued, so it records every attempt of a restarted run, re-done steps
included).

On CPU the script asks XLA for ``--devices`` host devices (8 by default), so the
sharding is real. Usage::

  python examples/train_lm.py                                 # small model, ZeRO-3
  python examples/train_lm.py --stage 0                       # replicated baseline
  python examples/train_lm.py --model tiny --steps 20 --stage 2
  python examples/train_lm.py --model medium --devices 8      # on 8 accelerators
  python examples/train_lm.py --mesh replica=2,data=4         # hybrid sharding (HSDP)
  python examples/train_lm.py --mesh data=4,model=2           # with tensor parallelism
  python examples/train_lm.py --quantized-weights int8 --quantized-gradients int8  # ZeRO++
  python examples/train_lm.py --checkpoint-dir ckpt --resume  # save every 100 steps; resume
  python -m zerojax.launch -n 2 --devices-per-process 4 examples/train_lm.py  # 2 processes
  python -m zerojax.launch -n 2 --devices-per-process 4 --max-restarts 3 \
    examples/train_lm.py --checkpoint-dir ckpt --resume      # restarted after failures

``--mesh`` lays the devices out over named axes: ``data`` (ZeRO shards over it),
``replica`` (everything replicated, the batch split: hybrid sharding) and
``model`` (the attention and MLP weights placed Megatron-style, see
``lm_model.tensor_parallel_specs``). With ``--checkpoint-dir`` the training
state (parameters, optimizer state with its master copy and loss scale, step)
is saved as sharded arrays every ``--save-every`` steps and at the end, keeping
the last ``--keep``; ``--resume`` continues from the latest one that can be
read, on any device count, mesh or stage. Batches are a function of the seed and
the step number, so a resumed run trains on exactly the batches an
uninterrupted run would.

Preemption: on SIGTERM (a preempted VM, SLURM's ``--signal``, the launcher
being stopped) every process finishes its step, all stop after the same step
(``zerojax.preemption_requested``), save it (with ``--checkpoint-dir``) and exit
with status ``zerojax.PREEMPTED_EXIT_CODE`` (75), which ``python -m
zerojax.launch`` answers with a restart. Under ``--resume`` the restarted run
continues from exactly that step.

Multi-process (one process per host or GPU): ``--coordinator``,
``--num-processes`` and ``--process-id`` (or the variables ``python -m
zerojax.launch`` sets, or ``--detect-cluster`` under SLURM, Open MPI or a
Cloud TPU pod slice) join the processes with ``zerojax.initialize``; each
process then loads only its rows of every batch. Process 0 alone prints and
writes files.

From Python, ``main(["--model", "tiny", "--steps", "20"])`` returns the metrics
(or raises ``SystemExit(75)`` when preempted).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

import zerojax

try:  # run as a script (python examples/train_lm.py) or imported from the package
  import lm_data
  import lm_model
  import lm_report
except ImportError:
  from examples import lm_data, lm_model, lm_report

EVAL_BATCHES = 4  # validation windows per evaluation, in units of --batch-size
MESH_AXES = ("replica", "data", "model")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  """Parses the flags; those left unset take the ``--model`` preset's value."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=3)
  parser.add_argument("--model", choices=tuple(lm_model.PRESETS), default="small")
  parser.add_argument("--steps", type=int, help="train steps (default: the preset's)")
  parser.add_argument("--batch-size", type=int, help="global batch, a multiple of --devices")
  parser.add_argument("--seq-len", type=int, help="context length in bytes")
  parser.add_argument("--lr", type=float, help="peak learning rate")
  parser.add_argument(
    "--devices",
    type=int,
    help="data-parallel devices: forced on CPU (default 8); in a multi-process run, all of "
    "the job's (the default)",
  )
  parser.add_argument(
    "--mesh",
    type=parse_mesh,
    help="named axes and sizes, e.g. replica=2,data=4 (hybrid sharding) or data=4,model=2 "
    "(tensor parallelism); the default is data=--devices",
  )
  parser.add_argument("--coordinator", help="host:port of process 0, for a multi-process run")
  parser.add_argument("--num-processes", type=int, help="processes in a multi-process run")
  parser.add_argument("--process-id", type=int, help="this process's index in the run")
  parser.add_argument(
    "--detect-cluster",
    action="store_true",
    help="find the processes from SLURM, Open MPI or a Cloud TPU pod slice",
  )
  parser.add_argument(
    "--precision",
    choices=("fp32", "bf16", "fp16"),
    default="fp32",
    help="compute dtype; master weights, optimizer state and gradient reductions stay fp32, "
    "and fp16 adds dynamic loss scaling (stages 1-3)",
  )
  for what, stages in (("weights", "stage 3"), ("gradients", "stages 1-3")):
    parser.add_argument(
      f"--quantized-{what}",
      choices=("int8", "int4"),
      help=f"move the {what[:-1]} {'all-gathers' if what == 'weights' else 'reductions'} as "
      f"block-quantized integers, as ZeRO++ does ({stages})",
    )
  parser.add_argument(
    "--quantization-block-size",
    type=int,
    default=256,
    help="elements per scale of the quantized weights and gradients",
  )
  parser.add_argument(
    "--microbatches",
    type=int,
    default=1,
    help="micro-batches accumulated per step, per device (stages 1-3)",
  )
  parser.add_argument("--checkpoint-dir", type=pathlib.Path, help="save checkpoints here")
  parser.add_argument("--save-every", type=int, default=100, help="steps between checkpoints")
  parser.add_argument("--keep", type=int, default=3, help="checkpoints to keep")
  parser.add_argument(
    "--resume", action="store_true", help="continue from the latest checkpoint, if there is one"
  )
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--eval-every", type=int, default=100, help="steps between validations")
  parser.add_argument(
    "--report",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="end with the per-device memory table (compiling the stage-0 step too) and a sample; "
    "--no-report skips both, e.g. for a long run where only the checkpoints matter",
  )
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("out"))
  args = parser.parse_args(argv)
  preset = lm_model.PRESETS[args.model]
  for name in ("steps", "batch_size", "seq_len", "lr"):
    if getattr(args, name) is None:
      setattr(args, name, getattr(preset, name))
  if args.stage == 0 and (
    args.precision != "fp32" or args.microbatches != 1 or args.quantized_gradients
  ):
    parser.error(
      "--precision, --microbatches and --quantized-gradients apply to stages 1-3 (zerojax)"
    )
  if args.stage != 3 and args.quantized_weights:
    parser.error("--quantized-weights applies to stage 3, the one that gathers weights")
  if args.stage == 0 and args.mesh and set(args.mesh) != {"data"}:
    parser.error("--stage 0 is plain data parallelism over --devices; --mesh is for stages 1-3")
  if args.stage == 0 and args.checkpoint_dir:
    parser.error("--checkpoint-dir applies to stages 1-3 (zerojax)")
  if args.resume and not args.checkpoint_dir:
    parser.error("--resume needs --checkpoint-dir")
  if args.mesh and args.devices and args.devices != math.prod(args.mesh.values()):
    parser.error(f"--devices {args.devices} but --mesh has {math.prod(args.mesh.values())}")
  return args


def parse_mesh(text: str) -> dict[str, int]:
  """``"replica=2,data=4"`` -> ``{"replica": 2, "data": 4}``, in mesh order.

  Example:
    >>> parse_mesh("data=4,model=2")
    {'data': 4, 'model': 2}
  """
  try:
    sizes = {name: int(size) for name, size in (part.split("=") for part in text.split(","))}
  except ValueError:
    raise argparse.ArgumentTypeError(
      f"{text!r} is not axis=size,...; e.g. data=4,model=2"
    ) from None
  unknown = [name for name in sizes if name not in MESH_AXES]
  if unknown or "data" not in sizes or min(sizes.values()) < 1:
    raise argparse.ArgumentTypeError(
      f"--mesh {text!r}: name axes among {MESH_AXES}, data among them, each of size >= 1"
    )
  return {name: sizes[name] for name in MESH_AXES if name in sizes}


def request_host_devices(count: int) -> None:
  """Asks XLA for ``count`` CPU devices, unless ``XLA_FLAGS`` already sets a number.

  XLA reads the flag when JAX first initialises its backends, so this must run
  before anything touches a device. It only affects the CPU platform, so it is
  harmless on accelerators.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


# ------------------------------------------------------------------------ training


class Setup(NamedTuple):
  """How one stage stores, initialises, trains and reads the parameters.

  Attributes:
    place: full parameters -> parameters as the stage stores them.
    init: full-precision parameters -> optimizer state.
    step: the jitted ``(params, opt_state, x, y) -> (params, opt_state, loss)``,
      which donates the parameters and the optimizer state.
    gather: stored parameters -> full, replicated parameters (also usable
      inside ``jax.jit``).
    tx: the zerojax transformation (``None`` for stage 0).
  """

  place: Callable[[Any], Any]
  init: Callable[[Any], Any]
  step: jax.stages.Wrapped
  gather: Callable[[Any], Any]
  tx: zerojax.ZeroTransformation | None


def make_optimizer(lr: float, steps: int) -> optax.GradientTransformation:
  """Global-norm clipping and AdamW with linear warmup and cosine decay."""
  schedule = optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=lr,
    warmup_steps=max(1, steps // 20),
    decay_steps=steps,
    end_value=lr / 10,
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
    init, gather = jax.jit(optimizer.init), lambda params: params
  else:
    tx = (zerojax.zero1, zerojax.zero2, zerojax.zero3)[stage - 1](
      optimizer,
      mesh=mesh,
      axis_name="data",
      replica_axis="replica" if "replica" in mesh.axis_names else None,
      **options,
    )
    grad_fn = zerojax.value_and_grad(loss, tx, microbatches=microbatches)
    # Jitted here so that repeated calls (every evaluation) reuse one compilation.
    place, init, gather = tx.shard, tx.init, jax.jit(tx.gather)

  def step(params, opt_state, x, y):
    # The optimizer state carries the fp16 loss scale (and is ignored by stage 0).
    value, grads = grad_fn(params, x, y, opt_state=opt_state)
    updates, opt_state = (tx or optimizer).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return Setup(place, init, jax.jit(step, donate_argnums=(0, 1)), gather, tx)


def place_on_model_axis(params: Any, mesh: jax.sharding.Mesh) -> Any:
  """``params`` on ``mesh``: Megatron-style over ``model`` if the mesh has it, else replicated."""
  if "model" in mesh.axis_names:
    specs = lm_model.tensor_parallel_specs(params)
  else:
    specs = jax.tree.map(lambda _: P(), params)
  shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
  return jax.device_put(params, shardings)


def _quantization(quantized: dict[str, str | None]) -> str:
  """`` with int8 weights, int8 gradients`` on the wire, or nothing."""
  parts = [f"{bits} {name.split('_')[1]}" for name, bits in quantized.items() if bits]
  return f" with {', '.join(parts)} on the wire" if parts else ""


def _count(n: int, one: str, many: str) -> str:
  return f"{n} {one if n == 1 else many}"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the script with the flags in ``argv`` (default: the command line); returns the metrics."""
  args = parse_args(argv)
  # First, before anything touches a device; False (and nothing done) for one process.
  multi_process = zerojax.initialize(
    args.coordinator, args.num_processes, args.process_id, detect_cluster=args.detect_cluster
  )
  if multi_process:
    args.devices = args.devices or jax.device_count()
    if args.devices != jax.device_count():
      raise ValueError(
        f"--devices {args.devices}, but the {jax.process_count()} processes have "
        f"{jax.device_count()} devices: a multi-process mesh spans them all; drop --devices."
      )
  else:
    args.devices = args.devices or (math.prod(args.mesh.values()) if args.mesh else 8)
    request_host_devices(args.devices)
  if jax.device_count() < args.devices:
    raise ValueError(
      f"--devices {args.devices} but JAX has {jax.device_count()} devices (it was initialised "
      "before this script could ask for more): pass a smaller --devices, or set "
      f"XLA_FLAGS=--xla_force_host_platform_device_count={args.devices}."
    )
  sizes = args.mesh or {"data": args.devices}
  if math.prod(sizes.values()) != args.devices:
    raise ValueError(f"--mesh {sizes} has {math.prod(sizes.values())} devices, not {args.devices}")
  batch_devices = sizes.get("replica", 1) * sizes["data"]
  if args.batch_size % (batch_devices * args.microbatches):
    raise ValueError(
      f"--batch-size {args.batch_size} must be a multiple of the {batch_devices} devices the "
      f"batch is split over (replica x data) times --microbatches {args.microbatches}"
    )
  # With a tensor-parallel axis, the compiler partitions the layers' plain jnp
  # math (Auto axes); explicit axes would ask every sharded contraction for its
  # output's sharding. Otherwise jax.make_mesh's default, Explicit.
  axis_type = jax.sharding.AxisType.Auto if "model" in sizes else jax.sharding.AxisType.Explicit
  mesh = jax.make_mesh(
    tuple(sizes.values()),
    tuple(sizes),
    axis_types=(axis_type,) * len(sizes),
    devices=jax.devices()[: args.devices],
  )
  with jax.set_mesh(mesh):
    return train(args, mesh)


def train(args: argparse.Namespace, mesh: jax.sharding.Mesh) -> dict[str, Any]:
  """Trains, evaluates and samples on ``mesh``; returns the metrics and writes them to ``--out``."""
  preset = lm_model.PRESETS[args.model]
  leader = jax.process_index() == 0  # in a multi-process run, the one that prints and writes
  say = print if leader else lambda *_, **__: None

  batch_axes = tuple(a for a in ("replica", "data") if a in mesh.axis_names)
  batch = functools.partial(lm_data.global_batch, seq_len=args.seq_len, mesh=mesh, axes=batch_axes)
  corpus = lm_data.load_corpus()
  baseline = lm_data.unigram_loss(corpus.train, corpus.val)
  val_starts = lm_data.validation_starts(corpus, EVAL_BATCHES * args.batch_size, args.seq_len)
  val_batch = batch(corpus.val, val_starts, check_processes=True)

  def train_batch(step):
    starts = lm_data.train_starts(corpus, args.seed, step, args.batch_size, args.seq_len)
    return batch(corpus.train, starts)

  model = lm_model.make_model(preset, args.seq_len)
  loss = functools.partial(lm_model.loss_fn, model=model)
  optimizer = make_optimizer(args.lr, args.steps)
  quantized = dict(
    quantized_weights=args.quantized_weights, quantized_gradients=args.quantized_gradients
  )
  options = {}
  if args.stage:
    options = dict(precision=args.precision, **quantized)
    options["quantization_block_size"] = args.quantization_block_size
  setup = make_setup(args.stage, mesh, optimizer, loss, args.microbatches, **options)
  platform = jax.devices()[0].platform
  initial = place_on_model_axis(lm_model.init_params(model, args.seed), mesh)
  n_params = sum(x.size for x in jax.tree.leaves(initial))
  # The optimizer state (with the fp32 master copy) first: placing may round to --precision.
  opt_state = setup.init(initial)
  params = setup.place(initial)
  loss_log = args.out / "losses.jsonl"  # appended to every step: a killed run keeps its lines
  if leader:
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.resume:
      loss_log.unlink(missing_ok=True)
  checkpoints, first_step = None, 1
  if args.checkpoint_dir:
    spec = zerojax.train_state_spec(setup.tx, initial, step=np.int32(0))
    checkpoints = zerojax.CheckpointManager(
      args.checkpoint_dir, spec, max_to_keep=args.keep, save_interval_steps=args.save_every
    )
    if args.resume and checkpoints.latest_step() is not None:
      state = checkpoints.restore()
      params, opt_state, first_step = state["params"], state["opt_state"], int(state["step"]) + 1
      say(f"resumed from step {first_step - 1} in {args.checkpoint_dir}")
    if first_step > args.steps:  # e.g. a restart loop that runs once more after the last save
      checkpoints.close()
      say(
        f"all --steps {args.steps} are trained (the latest checkpoint is step {first_step - 1}): "
        f"nothing to do, and {args.out} is left as it is; raise --steps to train further."
      )
      return {"first_step": first_step, "train_loss": [], "val_loss": []}

  @jax.jit
  def evaluate(params, x, y):
    return loss(setup.gather(params), x, y)

  layout = (
    "" if args.mesh is None else f" (mesh {', '.join(f'{k}={v}' for k, v in args.mesh.items())})"
  )
  say(
    f"{args.model} model: {n_params / 1e6:.2f}M params, stage {args.stage} on {args.devices} "
    f"{platform} devices{layout} in {_count(jax.process_count(), 'process', 'processes')}, "
    f"{args.precision} precision{_quantization(quantized)}, "
    f"{_count(args.microbatches, 'micro-batch', 'micro-batches')}; "
    f"{len(corpus.train) / 1e6:.2f}M train bytes, "
    f"{len(corpus.val) / 1e3:.0f}K validation bytes"
  )
  say(f"unigram baseline: validation loss {baseline:.3f} nats/byte")

  # Compiled ahead of time: the loop calls this one executable, which refuses
  # (rather than silently recompiles for) arguments of another shape or sharding.
  example = train_batch(0)
  start = time.perf_counter()
  compiled = setup.step.lower(params, opt_state, *example).compile()
  compile_time = time.perf_counter() - start
  memory = {f"stage {args.stage}": lm_report.memory_stats(compiled, params, opt_state)}

  train_loss, val_loss, step_times, grad_norms = [], [], [], []
  bar = tqdm(
    range(first_step, args.steps + 1),
    desc=f"ZeRO-{args.stage}",
    dynamic_ncols=True,
    initial=first_step - 1,
    total=args.steps,
    disable=not leader,
  )
  for step in bar:
    x, y = train_batch(step)
    start = time.perf_counter()
    params, opt_state, value = compiled(params, opt_state, x, y)
    train_loss.append(float(value))
    step_times.append(time.perf_counter() - start)
    if leader:
      lm_report.log_loss(loss_log, step, train_loss[-1])
    # Every process, every step: True at the same step on all once any got SIGTERM.
    preempted = zerojax.preemption_requested(step)
    if checkpoints:
      state = {"params": params, "opt_state": opt_state, "step": np.int32(step)}
      state["step"] = jax.device_put(state["step"], NamedSharding(mesh, P()))
      checkpoints.save(step, state, force=step == args.steps or preempted)
    if preempted:
      bar.close()
      if checkpoints:
        checkpoints.close()  # waits for the save
      saved = f"saved it to {args.checkpoint_dir}" if checkpoints else "no --checkpoint-dir"
      status = zerojax.PREEMPTED_EXIT_CODE
      say(f"preempted: stopped after step {step} ({saved}); exiting with status {status}")
      raise SystemExit(status)
    stats = dict(loss=f"{train_loss[-1]:.3f}")
    if args.stage:
      grad_norms.append(float(opt_state.pre_clip_grad_norm))
      stats["grad_norm"] = f"{grad_norms[-1]:.2f}"  # before clip_by_global_norm
      if opt_state.loss_scale is not None:
        stats["skipped"] = int(opt_state.skipped_steps)
    stats |= dict(tok_s=f"{x.size / step_times[-1]:,.0f}", step_ms=f"{1e3 * step_times[-1]:.0f}")
    bar.set_postfix(stats)
    if step % args.eval_every == 0 or step == args.steps:
      val_loss.append({"step": step, "loss": float(evaluate(params, *val_batch))})
      if leader:
        bar.write(
          f"step {step}: train {train_loss[-1]:.3f}, validation {val_loss[-1]['loss']:.3f} "
          f"(unigram {baseline:.3f}) nats/byte"
        )
  bar.close()
  if checkpoints:
    checkpoints.close()  # waits for the last save
    say(f"checkpoints {checkpoints.all_steps()} in {args.checkpoint_dir}")

  full_params = setup.gather(params)
  if args.stage and args.report:
    # The baseline holds a whole replica of the parameters and optimizer state.
    baseline_setup = make_setup(0, mesh, optimizer, loss)
    params0 = place_on_model_axis(full_params, mesh)
    opt_state0 = baseline_setup.init(params0)
    compiled0 = baseline_setup.step.lower(params0, opt_state0, *example).compile()
    memory = {"stage 0": lm_report.memory_stats(compiled0, params0, opt_state0), **memory}
  text = None
  if args.report:
    say(lm_report.format_memory(memory))
    text = lm_model.sample(full_params, model, jax.random.key(args.seed))
    say(f"sample:\n{text}")

  step_seconds = float(np.median(step_times))
  metrics = {
    "config": dataclasses.asdict(preset)
    | vars(args)
    | {"out": str(args.out), "checkpoint_dir": args.checkpoint_dir and str(args.checkpoint_dir)}
    | {"mesh": args.mesh or {"data": args.devices}}
    | {"n_params": n_params, "platform": platform},
    "unigram_loss": baseline,
    "first_step": first_step,
    "train_loss": train_loss,
    "val_loss": val_loss,
    "pre_clip_grad_norm": grad_norms,
    "skipped_steps": int(opt_state.skipped_steps) if args.stage else 0,
    "compile_seconds": compile_time,
    "step_seconds": step_seconds,
    "tokens_per_second": args.batch_size * args.seq_len / step_seconds,
    "memory_bytes": memory,
    "sample": text,
  }
  if leader:
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    lm_report.plot(args.out / "loss.png", train_loss, val_loss, baseline)
    print(f"wrote {args.out / 'metrics.json'} and {args.out / 'loss.png'}")
  return metrics


if __name__ == "__main__":
  main()
