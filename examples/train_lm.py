"""Trains a character-level GPT on the Python standard library with ZeRO stage 0, 1, 2 or 3.

The model is a decoder-only transformer (pre-norm RMSNorm, causal multi-head
attention, ReLU MLP, learned positions, tied embeddings) written as Flax Linen
modules. Its layers run under ``nn.scan``, so their parameters are stacked
along a leading layer dimension; the scanned block is wrapped with
``zerojax.flax.remat_gathered``, which gathers one layer's weights when the
block is called and re-gathers them in the backward pass, so under ZeRO-3 only
one layer is ever whole. Gradients come from
``zerojax.value_and_grad``, which runs the loss once per device on its slice of
the batch. Stage 0 is the baseline: replicated parameters and optimizer state,
plain ``jax.value_and_grad`` under ``jax.jit`` with the batch sharded.

The data is the source of the running interpreter's standard library (no
download), read as bytes: the vocabulary is the 256 byte values. At the end the
script prints the measured per-device memory of the compiled train step next to
stage 0's, writes ``metrics.json`` and ``loss.png`` to ``--out``, and prints a
sample from the trained model.

On CPU the script asks XLA for ``--devices`` host devices (8 by default), so the
sharding is real. Usage::

  python examples/train_lm.py                                 # small model, ZeRO-3
  python examples/train_lm.py --stage 0                       # replicated baseline
  python examples/train_lm.py --model tiny --steps 20 --stage 2
  python examples/train_lm.py --model medium --devices 8      # on 8 accelerators
  python examples/train_lm.py --checkpoint-dir ckpt --resume  # save every 100 steps; resume
  python -m zerojax.launch -n 2 --devices-per-process 4 examples/train_lm.py  # 2 processes

With ``--checkpoint-dir`` the training state (parameters, optimizer state with
its master copy and loss scale, step) is saved as sharded arrays every
``--save-every`` steps and at the end, keeping the last ``--keep``; ``--resume``
continues from the latest one, on any device count and stage. Batches are a
function of the seed and the step number, so a resumed run trains on exactly
the batches an uninterrupted run would.

Multi-process (one process per host or GPU): ``--coordinator``,
``--num-processes`` and ``--process-id`` (or the variables ``python -m
zerojax.launch`` sets, or ``--detect-cluster`` under SLURM, Open MPI or a
Cloud TPU pod slice) join the processes with ``zerojax.initialize``; each
process then loads only its rows of every batch and ``zerojax.global_batch``
assembles the global array. Process 0 alone prints and writes files.

From Python, ``main(["--model", "tiny", "--steps", "20"])`` returns the metrics.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import pathlib
import sysconfig
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from matplotlib.figure import Figure
from tqdm import tqdm

import zerojax
import zerojax.flax

AXIS = "data"
VOCAB = 256  # bytes
MAX_CORPUS_BYTES = 3 * 2**20
VAL_FRACTION = 0.05
EVAL_BATCHES = 4  # validation windows per evaluation, in units of --batch-size
SAMPLE_PROMPT = "def "
SAMPLE_LENGTH = 240
SAMPLE_TEMPERATURE = 0.7


@dataclasses.dataclass(frozen=True)
class Preset:
  """A model size and the defaults of the flags that go with it."""

  d_model: int
  n_layers: int
  n_heads: int
  seq_len: int
  batch_size: int
  lr: float
  steps: int


PRESETS = {
  # For CI: seconds on a laptop CPU.
  "tiny": Preset(d_model=64, n_layers=2, n_heads=4, seq_len=64, batch_size=32, lr=3e-3, steps=50),
  # The default: a few minutes on a 2-core CPU, well below the unigram baseline.
  "small": Preset(
    d_model=128, n_layers=4, n_heads=4, seq_len=64, batch_size=32, lr=3e-3, steps=600
  ),
  # For accelerators.
  "medium": Preset(
    d_model=512, n_layers=8, n_heads=8, seq_len=256, batch_size=64, lr=6e-4, steps=5000
  ),
  "large": Preset(
    d_model=1024, n_layers=24, n_heads=16, seq_len=512, batch_size=128, lr=3e-4, steps=20000
  ),
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  """Parses the flags; those left unset take the ``--model`` preset's value."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=3)
  parser.add_argument("--model", choices=tuple(PRESETS), default="small")
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
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("out"))
  args = parser.parse_args(argv)
  preset = PRESETS[args.model]
  for name in ("steps", "batch_size", "seq_len", "lr"):
    if getattr(args, name) is None:
      setattr(args, name, getattr(preset, name))
  if args.stage == 0 and (args.precision != "fp32" or args.microbatches != 1):
    parser.error("--precision and --microbatches apply to stages 1-3 (zerojax)")
  if args.stage == 0 and args.checkpoint_dir:
    parser.error("--checkpoint-dir applies to stages 1-3 (zerojax)")
  if args.resume and not args.checkpoint_dir:
    parser.error("--resume needs --checkpoint-dir")
  return args


def request_host_devices(count: int) -> None:
  """Asks XLA for ``count`` CPU devices, unless ``XLA_FLAGS`` already sets a number.

  XLA reads the flag when JAX first initialises its backends, so this must run
  before anything touches a device. It only affects the CPU platform, so it is
  harmless on accelerators.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


# ---------------------------------------------------------------------------- data


def load_corpus() -> np.ndarray:
  """The standard library's top-level ``*.py`` files, sorted by name, as bytes (capped)."""
  stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
  chunks, size = [], 0
  for path in sorted(stdlib.glob("*.py")):
    chunks.append(path.read_bytes())
    size += len(chunks[-1])
    if size >= MAX_CORPUS_BYTES:
      break
  return np.frombuffer(b"".join(chunks)[:MAX_CORPUS_BYTES], np.uint8)


def unigram_loss(train: np.ndarray, val: np.ndarray) -> float:
  """Validation cross-entropy (nats) of byte frequencies counted on ``train`` (add-one)."""
  counts = np.bincount(train, minlength=VOCAB) + 1.0
  log_p = np.log(counts / counts.sum())
  return float(-log_p[val].mean())


def windows(data: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Inputs and next-byte targets of the windows of ``data`` beginning at ``starts``."""
  tokens = data[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
  return tokens[:, :-1], tokens[:, 1:]


# --------------------------------------------------------------------------- model


def rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


class Block(nn.Module):
  """One pre-norm transformer layer, in the ``(carry, _) -> (carry, None)`` form of ``nn.scan``."""

  d_model: int
  n_heads: int
  residual_std: float

  @nn.compact
  def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
    d = self.d_model
    normal = nn.initializers.normal
    norm_attn = self.param("norm_attn", nn.initializers.ones, (d,))
    qkv = self.param("qkv", normal(0.02), (d, 3 * d))
    attn_out = self.param("attn_out", normal(self.residual_std), (d, d))
    norm_mlp = self.param("norm_mlp", nn.initializers.ones, (d,))
    mlp_in = self.param("mlp_in", normal(0.02), (d, 4 * d))
    mlp_out = self.param("mlp_out", normal(self.residual_std), (4 * d, d))
    batch, length, _ = x.shape
    heads = lambda t: t.reshape(batch, length, self.n_heads, d // self.n_heads)
    q, k, v = jnp.split(rms_norm(x, norm_attn) @ qkv, 3, axis=-1)
    attended = jax.nn.dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
    x = x + attended.reshape(batch, length, d) @ attn_out
    return x + jax.nn.relu(rms_norm(x, norm_mlp) @ mlp_in) @ mlp_out, None


class Tables(nn.Module):
  """The parameters outside the layers, returned whole: byte and position embeddings, final norm."""

  d_model: int
  seq_len: int

  @nn.compact
  def __call__(self) -> tuple[jax.Array, jax.Array, jax.Array]:
    normal = nn.initializers.normal
    return (
      self.param("embed", normal(0.02), (VOCAB, self.d_model)),  # tied: also the output layer
      self.param("pos", normal(0.01), (self.seq_len, self.d_model)),
      self.param("norm_out", nn.initializers.ones, (self.d_model,)),
    )


class GPT(nn.Module):
  """A decoder-only transformer over bytes; its layers run under ``nn.scan``.

  Each module gathers its own parameters when it is called
  (``zerojax.flax.gathered``), and the scanned block is also rematerialised
  with ``zerojax.remat_policy`` (``zerojax.flax.remat_gathered``), so under
  ZeRO-3 one layer is whole at a time, in the forward and the backward pass.
  On full parameters (stage 0, evaluation) the gathers do nothing.
  """

  d_model: int
  n_layers: int
  n_heads: int
  seq_len: int

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    """Next-byte logits, shape ``tokens.shape + (VOCAB,)``."""
    embed, pos, norm_out = zerojax.flax.gathered(Tables)(self.d_model, self.seq_len)()
    # A one-hot matmul rather than a gather: its sharding follows the tokens' in
    # every view (a gather under explicit sharding must be told its output's).
    x = jax.nn.one_hot(tokens, VOCAB) @ embed + pos[: tokens.shape[1]]
    layers = nn.scan(
      zerojax.flax.remat_gathered(Block, prevent_cse=False),
      variable_axes={"params": 0},
      split_rngs={"params": True},
      length=self.n_layers,
    )
    residual_std = 0.02 / math.sqrt(2 * self.n_layers)
    x, _ = layers(self.d_model, self.n_heads, residual_std, name="layers")(x, None)
    return rms_norm(x, norm_out) @ embed.T


def make_model(preset: Preset, seq_len: int) -> GPT:
  return GPT(preset.d_model, preset.n_layers, preset.n_heads, seq_len)


def init_params(model: GPT, seed: int) -> dict[str, Any]:
  """GPT-2 style initialisation, as host arrays (placing host arrays needs no compilation)."""
  tokens = np.zeros((1, model.seq_len), np.int32)
  return jax.device_get(jax.jit(model.init)(jax.random.key(seed), tokens)["params"])


def loss_fn(params: dict[str, Any], x: jax.Array, y: jax.Array, model: GPT) -> jax.Array:
  """Mean next-byte cross-entropy, in nats, computed in fp32 whatever the compute dtype."""
  logits = model.apply({"params": params}, x).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


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
  precision: str = "fp32",
  microbatches: int = 1,
) -> Setup:
  """The ``Setup`` of ``stage``: ZeRO 1-3 through zerojax, or 0 for replicated data parallelism."""
  if stage == 0:
    plain_grad_fn = jax.value_and_grad(loss)
    grad_fn = lambda params, x, y, opt_state: plain_grad_fn(params, x, y)
    tx = None
    place = lambda params: jax.device_put(params, NamedSharding(mesh, P()))
    init, gather = jax.jit(optimizer.init), lambda params: params
  else:
    tx = (zerojax.zero1, zerojax.zero2, zerojax.zero3)[stage - 1](
      optimizer, mesh=mesh, axis_name=AXIS, precision=precision
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


def _count(n: int, one: str, many: str) -> str:
  return f"{n} {one if n == 1 else many}"


def per_device_bytes(tree: Any) -> int:
  """Bytes of ``tree`` that one device holds: the size of its shard of every leaf."""
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


MEMORY_ROWS = {
  "params_and_opt_state": "params + optimizer state",
  "arguments": "step arguments",
  "outputs": "step outputs",
  "temporaries": "step temporaries",
}


def memory_stats(compiled: jax.stages.Compiled, params: Any, opt_state: Any) -> dict[str, int]:
  """Per-device bytes of a compiled train step, as XLA measured them, and of its state."""
  analysis = compiled.memory_analysis()
  return {
    "params_and_opt_state": per_device_bytes((params, opt_state)),
    "arguments": analysis.argument_size_in_bytes,
    "outputs": analysis.output_size_in_bytes,
    "temporaries": analysis.temp_size_in_bytes,
  }


def format_memory(memory: dict[str, dict[str, int]]) -> str:
  """A table of per-device MiB, one column per stage, one row per ``MEMORY_ROWS`` entry."""
  lines = [f"{'per-device memory (MiB)':<26}" + "".join(f"{stage:>10}" for stage in memory)]
  for key, label in MEMORY_ROWS.items():
    lines.append(f"{label:<26}" + "".join(f"{m[key] / 2**20:>10.2f}" for m in memory.values()))
  return "\n".join(lines)


def sample(params: Any, model: GPT, key: jax.Array, prompt: str = SAMPLE_PROMPT) -> str:
  """Continues ``prompt`` by ``SAMPLE_LENGTH`` bytes, sampled at ``SAMPLE_TEMPERATURE``."""
  start = len(prompt.encode())
  seq_len = model.seq_len
  buffer = np.zeros(max(seq_len, start + SAMPLE_LENGTH), np.int32)
  buffer[:start] = np.frombuffer(prompt.encode(), np.uint8)

  @jax.jit
  def generate(params, buffer, key):
    def next_byte(i, carry):
      buffer, key = carry
      end = start + i
      first = jnp.maximum(end - seq_len, 0)
      window = jax.lax.dynamic_slice(buffer, (first,), (seq_len,))
      logits = model.apply({"params": params}, window[None])[0, end - first - 1]
      key, subkey = jax.random.split(key)
      token = jax.random.categorical(subkey, logits / SAMPLE_TEMPERATURE)
      return buffer.at[end].set(token), key

    return jax.lax.fori_loop(0, SAMPLE_LENGTH, next_byte, (buffer, key))[0]

  out = np.asarray(generate(params, buffer, key))[: start + SAMPLE_LENGTH]
  return out.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def plot(
  path: pathlib.Path, train_loss: list[float], val_loss: list[dict[str, float]], baseline: float
) -> None:
  """Saves the loss curves, with the unigram baseline for scale."""
  figure = Figure(figsize=(7, 4))
  ax = figure.subplots()
  ax.plot(train_loss, label="train", linewidth=0.8)
  ax.plot([v["step"] for v in val_loss], [v["loss"] for v in val_loss], "o-", label="validation")
  ax.axhline(baseline, color="gray", linestyle="--", label="unigram baseline")
  ax.set(xlabel="step", ylabel="cross-entropy (nats/byte)")
  ax.legend()
  figure.savefig(path, dpi=120, bbox_inches="tight")


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
    args.devices = args.devices or 8
    request_host_devices(args.devices)
  if jax.device_count() < args.devices:
    raise ValueError(
      f"--devices {args.devices} but JAX has {jax.device_count()} devices (it was initialised "
      "before this script could ask for more): pass a smaller --devices, or set "
      f"XLA_FLAGS=--xla_force_host_platform_device_count={args.devices}."
    )
  if args.batch_size % (args.devices * args.microbatches):
    raise ValueError(
      f"--batch-size {args.batch_size} must be a multiple of --devices {args.devices} "
      f"times --microbatches {args.microbatches}"
    )
  mesh = jax.make_mesh((args.devices,), (AXIS,), devices=jax.devices()[: args.devices])
  with jax.set_mesh(mesh):
    return train(args, mesh)


def train(args: argparse.Namespace, mesh: jax.sharding.Mesh) -> dict[str, Any]:
  """Trains, evaluates and samples on ``mesh``; returns the metrics and writes them to ``--out``."""
  preset = PRESETS[args.model]
  leader = jax.process_index() == 0  # in a multi-process run, the one that prints and writes
  say = print if leader else lambda *_, **__: None

  def global_batch(starts, data, first=False):
    # Each process loads only its rows; zerojax.global_batch joins them over the mesh
    # (checking on the first batch that every process passes the same shapes).
    rows = len(starts) // jax.process_count()
    mine = starts[jax.process_index() * rows :][:rows]
    return zerojax.global_batch(
      windows(data, mine, args.seq_len), mesh, axis_name=AXIS, check_processes=first
    )

  corpus = load_corpus()
  split = int(len(corpus) * (1 - VAL_FRACTION))
  train_data, val_data = corpus[:split], corpus[split:]
  baseline = unigram_loss(train_data, val_data)
  count = EVAL_BATCHES * args.batch_size
  val_starts = np.linspace(0, len(val_data) - args.seq_len - 1, count).astype(int)
  val_batch = global_batch(val_starts, val_data, first=True)

  def train_batch(step):
    # A function of the step alone, so that a resumed run sees the same batches.
    rng = np.random.default_rng([args.seed, 1, step])
    starts = rng.integers(0, len(train_data) - args.seq_len - 1, args.batch_size)
    return global_batch(starts, train_data)

  model = make_model(preset, args.seq_len)
  loss = functools.partial(loss_fn, model=model)
  optimizer = make_optimizer(args.lr, args.steps)
  setup = make_setup(args.stage, mesh, optimizer, loss, args.precision, args.microbatches)
  platform = jax.devices()[0].platform
  initial = init_params(model, args.seed)
  n_params = sum(x.size for x in jax.tree.leaves(initial))
  # The optimizer state (with the fp32 master copy) first: placing may round to --precision.
  opt_state = setup.init(initial)
  params = setup.place(initial)
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

  @jax.jit
  def evaluate(params, x, y):
    return loss(setup.gather(params), x, y)

  say(
    f"{args.model} model: {n_params / 1e6:.2f}M params, stage {args.stage} on {args.devices} "
    f"{platform} devices in {_count(jax.process_count(), 'process', 'processes')}, "
    f"{args.precision} precision, {_count(args.microbatches, 'micro-batch', 'micro-batches')}; "
    f"{len(train_data) / 1e6:.2f}M train bytes, "
    f"{len(val_data) / 1e3:.0f}K validation bytes"
  )
  say(f"unigram baseline: validation loss {baseline:.3f} nats/byte")

  # Compiled ahead of time: the loop calls this one executable, which refuses
  # (rather than silently recompiles for) arguments of another shape or sharding.
  example = train_batch(0)
  start = time.perf_counter()
  compiled = setup.step.lower(params, opt_state, *example).compile()
  compile_time = time.perf_counter() - start
  memory = {f"stage {args.stage}": memory_stats(compiled, params, opt_state)}

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
    if checkpoints:
      state = {"params": params, "opt_state": opt_state, "step": np.int32(step)}
      state["step"] = jax.device_put(state["step"], NamedSharding(mesh, P()))
      checkpoints.save(step, state, force=step == args.steps)
  bar.close()
  if checkpoints:
    checkpoints.close()  # waits for the last save
    say(f"checkpoints {checkpoints.all_steps()} in {args.checkpoint_dir}")

  full_params = setup.gather(params)
  if args.stage:
    # The baseline holds a whole replica of the parameters and optimizer state.
    baseline_setup = make_setup(0, mesh, optimizer, loss)
    params0 = baseline_setup.place(full_params)
    opt_state0 = baseline_setup.init(params0)
    compiled0 = baseline_setup.step.lower(params0, opt_state0, *example).compile()
    memory = {"stage 0": memory_stats(compiled0, params0, opt_state0), **memory}
  say(format_memory(memory))

  text = sample(full_params, model, jax.random.key(args.seed))
  say(f"sample:\n{text}")

  step_seconds = float(np.median(step_times))
  metrics = {
    "config": dataclasses.asdict(preset)
    | vars(args)
    | {"out": str(args.out), "checkpoint_dir": args.checkpoint_dir and str(args.checkpoint_dir)}
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
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    plot(args.out / "loss.png", train_loss, val_loss, baseline)
    print(f"wrote {args.out / 'metrics.json'} and {args.out / 'loss.png'}")
  return metrics


if __name__ == "__main__":
  main()
