"""The shared benchmark harness: the model, its training setups, timing, measuring and tables.

``compare.py``, ``scaling.py``, ``quantization.py`` and ``precision.py`` import
this module and nothing of each other, and use zerojax's public API only.

* **The model**: a pre-norm transformer stack whose layer weights are stacked
  and scanned (``ModelConfig``, ``init_params``, ``make_loss``,
  ``make_batch``), in the sizes of ``PRESETS``.
* **The setups**: one way each of training it (``Setup``): replicated data
  parallelism and GSPMD FSDP in plain JAX, zerojax's stages on the explicit
  path (``zerojax.value_and_grad``) and the drop-in path (plain
  ``jax.value_and_grad``).
* **Timing**: every setup in turn, round after round (``time_interleaved``),
  so that a slow spell of a shared machine hits them all alike.
* **Measuring**: persistent bytes, ``zerojax.profile`` of the compiled step,
  and the collective volume in the ZeRO paper's units (``measure``).
* **Reporting**: Markdown tables, the run's provenance, and the generated
  section of a Markdown file (``write_markdown``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax

AXIS = "data"
MIB = 2**20
RESULTS_END = "<!-- results: end -->"
#: zerojax's stages by number.
ZERO = {1: zerojax.zero1, 2: zerojax.zero2, 3: zerojax.zero3}


def use_cpu_devices(count: int) -> None:
  """Runs on ``count`` CPU devices, whatever accelerators the machine has."""
  jax.config.update("jax_platforms", "cpu")
  zerojax.use_cpu_devices(count)


# ---------------------------------------------------------------------------
# The model.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A pre-norm transformer stack with stacked (scanned) layer weights."""

  layers: int
  d_model: int
  heads: int
  vocab: int
  seq: int
  batch: int


#: Model shapes by name. Activation-heavy: long sequences, a large batch and few
#: layers, so activations dominate. Parameter-heavy: deep, a tiny batch of
#: short sequences, and a prime vocabulary (the head's sharded dimension pads
#: from 1021 to 1024), so parameters, gradients and optimizer state dominate.
PRESETS = {
  "activation-heavy": dict(layers=4, d_model=256, heads=4, vocab=1024, seq=64, batch=16),
  "parameter-heavy": dict(layers=12, d_model=256, heads=4, vocab=1021, seq=8, batch=8),
}


def add_model_flags(parser: argparse.ArgumentParser) -> None:
  """Adds the flags that ``model_config`` reads: a preset, and each shape to override it."""
  parser.add_argument("--preset", choices=PRESETS, default="activation-heavy")
  for name in ("layers", "d-model", "heads", "vocab", "seq"):
    parser.add_argument(f"--{name}", type=int, help="default: the preset's")
  parser.add_argument("--batch", type=int, help="global batch (sequences); default: the preset's")


def add_run_flags(
  parser: argparse.ArgumentParser, *, warmup: int = 2, rounds: int = 10, steps: bool = True
) -> None:
  """Adds the flags every benchmark takes: where to write, and how to time (interleaved rounds).

  ``steps=False`` leaves ``--steps`` to the script (quantization.py's means train_lm steps).
  """
  parser.add_argument("--markdown", metavar="PATH", help="write the results into this file")
  parser.add_argument("--warmup", type=int, default=warmup, help="untimed steps per setup")
  parser.add_argument("--rounds", type=int, default=rounds, help="interleaved timing rounds")
  if steps:
    parser.add_argument("--steps", type=int, default=1, help="timed steps per setup per round")


def model_config(args: argparse.Namespace) -> ModelConfig:
  """The ``ModelConfig`` the flags describe: the preset, with any shape flag given instead."""
  given = {k: v for k, v in vars(args).items() if k in PRESETS[args.preset] and v is not None}
  return ModelConfig(**{**PRESETS[args.preset], **given})


def init_params(config: ModelConfig, key: jax.Array) -> dict[str, Any]:
  """Full fp32 parameters: embedding, ``layers`` stacked blocks, final norm, head."""
  d, f, n, v = config.d_model, 4 * config.d_model, config.layers, config.vocab
  keys = jax.random.split(key, 6)

  def normal(key, shape, fan_in):
    return jax.random.normal(key, shape, jnp.float32) / np.sqrt(fan_in)

  return {
    "embed": normal(keys[0], (v, d), 1.0) * 0.02,
    "layers": {
      "norm1": jnp.ones((n, d)),
      "qkv": normal(keys[1], (n, d, 3 * d), d),
      "out": normal(keys[2], (n, d, d), d),
      "norm2": jnp.ones((n, d)),
      "up": normal(keys[3], (n, d, f), d),
      "down": normal(keys[4], (n, f, d), f),
    },
    "norm": jnp.ones((d,)),
    "head": normal(keys[5], (d, v), d),
  }


def parameter_count(params: Any) -> int:
  """Ψ: the number of parameters in ``params`` (arrays or ``jax.ShapeDtypeStruct`` s)."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(params))


def model_parameter_count(config: ModelConfig) -> int:
  """Ψ of the model ``config`` describes, from shapes alone."""
  return parameter_count(abstract_params(config))


def abstract_params(config: ModelConfig) -> Any:
  """The shapes and dtypes of ``init_params``'s parameters, as ``jax.ShapeDtypeStruct`` s."""
  return jax.eval_shape(functools.partial(init_params, config), jax.random.key(0))


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def _block(layer: dict[str, jax.Array], h: jax.Array, heads: int) -> jax.Array:
  """One causal self-attention + GELU MLP block on ``h`` of shape (batch, seq, d_model)."""
  b, s, d = h.shape
  q, k, v = jnp.split(_rms_norm(h, layer["norm1"]) @ layer["qkv"], 3, axis=-1)
  q, k, v = (t.reshape(b, s, heads, d // heads) for t in (q, k, v))
  # A Python float keeps the compute dtype (a NumPy scalar would promote bf16 to fp32).
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / float(np.sqrt(d // heads))
  scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
  attention = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
  h = h + attention.reshape(b, s, d) @ layer["out"]
  return h + jax.nn.gelu(_rms_norm(h, layer["norm2"]) @ layer["up"]) @ layer["down"]


#: How ``make_loss`` runs the layer stack, by name.
STACKS = {
  "scan": "zerojax.scan, each layer gathered one ahead, one collective per layer",
  "scan, prefetch=0": "zerojax.scan gathering each layer in its own iteration",
  "per-leaf": "jax.lax.scan under jax.checkpoint(policy=zerojax.remat_policy), each leaf "
  "gathered on its own (zerojax before prefetching and bucketing)",
  "gather": "jax.lax.scan under jax.checkpoint(policy=zerojax.remat_policy), the layer "
  "gathered with one zerojax.gather",
}


def make_loss(
  config: ModelConfig, activations: NamedSharding | None = None, stack: str = "scan"
) -> Callable:
  """The mean next-token cross-entropy ``loss(params, tokens, targets)``.

  The same code runs on full parameters (``zerojax.gather`` passes arrays
  through, ``zerojax.scan`` is ``jax.lax.scan``) and on zerojax shards, where
  each layer is gathered for its iteration and again in the backward pass.

  Args:
    config: the model's shape.
    activations: if given, the residual stream is constrained to this
      sharding before every layer and before the head (GSPMD setups only).
    stack: how the layers run, one of ``STACKS``.
  """

  def constrain(h):
    return h if activations is None else jax.lax.with_sharding_constraint(h, activations)

  def layer_step(h, layer):
    return _block(layer, constrain(h), config.heads), None

  def gathering(gather):
    step = lambda h, layer: layer_step(h, gather(layer))
    return lambda h, layers: jax.lax.scan(
      jax.checkpoint(step, policy=zerojax.remat_policy), h, layers
    )

  run = {
    "scan": lambda h, layers: zerojax.scan(layer_step, h, layers),
    "scan, prefetch=0": lambda h, layers: zerojax.scan(layer_step, h, layers, prefetch=0),
    "per-leaf": gathering(
      lambda layer: jax.tree.map(
        zerojax.gather, layer, is_leaf=lambda x: isinstance(x, zerojax.Shard)
      )
    ),
    "gather": gathering(zerojax.gather),
  }[stack]

  def loss(params, tokens, targets):
    h = zerojax.gather(params["embed"])[tokens]
    h, _ = run(h, params["layers"])
    h = _rms_norm(constrain(h), zerojax.gather(params["norm"]))
    logits = (h @ zerojax.gather(params["head"])).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  return loss


def make_batch(
  config: ModelConfig, mesh: jax.sharding.Mesh, axes: Any = AXIS
) -> tuple[jax.Array, jax.Array]:
  """The fixed random ``(tokens, targets)`` batch every step trains on, split over ``axes``."""
  tokens = jax.random.randint(jax.random.key(1), (config.batch, config.seq + 1), 0, config.vocab)
  return jax.device_put((tokens[:, :-1], tokens[:, 1:]), NamedSharding(mesh, P(axes)))


# ---------------------------------------------------------------------------
# The setups.
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Setup:
  """One way of training the model: its jitted and compiled step, the batch and its state.

  Attributes:
    name: what the tables call it.
    jitted: ``(params, state, tokens, targets) -> (params, state, loss)``, jitted.
    step: ``jitted`` compiled for ``params``, ``state`` and ``batch``.
    batch: the ``(tokens, targets)`` it trains on.
    params: the current parameters.
    state: the current optimizer state.
    loss: the last step's loss.
  """

  name: str
  jitted: Any
  step: jax.stages.Compiled
  batch: tuple[jax.Array, jax.Array]
  params: Any
  state: Any
  loss: float = float("nan")

  def profile(self) -> zerojax.StepProfile:
    """``zerojax.profile`` of the step (compiled already: nothing is compiled again)."""
    return zerojax.profile(self.jitted, self.params, self.state, *self.batch)


def fsdp_spec(
  shape: tuple[int, ...], num_shards: int, min_size: int = zerojax.DEFAULT_MIN_SHARD_SIZE
) -> P:
  """Shards over ``data`` the dimension zerojax's default layout picks, or replicates.

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
  spec[dim] = AXIS
  return P(*spec)


def compile_plain(name, loss, opt, params, state, batch, shardings) -> Setup:
  """A plain-JAX step (``jax.value_and_grad`` + ``opt``) jitted with explicit shardings."""

  def step(params, state, tokens, targets):
    value, grads = jax.value_and_grad(loss)(params, tokens, targets)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  params_sharding, state_sharding, batch_sharding = shardings
  replicated = NamedSharding(batch_sharding.mesh, P())
  jitted = jax.jit(
    step,
    in_shardings=(params_sharding, state_sharding, batch_sharding, batch_sharding),
    out_shardings=(params_sharding, state_sharding, replicated),
    donate_argnums=(0, 1),
  )
  return Setup(name, jitted, jitted.lower(params, state, *batch).compile(), batch, params, state)


def compile_zero(name, tx, grad_fn, params, batch) -> Setup:
  """A step of ``grad_fn`` + the zerojax ``tx``, parameters placed with ``tx.shard``."""

  def step(params, state, tokens, targets):
    value, grads = grad_fn(params, tokens, targets)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  params = tx.shard(params)
  state = tx.init(params)
  replicated = NamedSharding(tx.mesh, P())
  jitted = jax.jit(
    step,
    out_shardings=(tx.param_shardings(params), tx.state_shardings(params), replicated),
    donate_argnums=(0, 1),
  )
  return Setup(name, jitted, jitted.lower(params, state, *batch).compile(), batch, params, state)


def _placed(tree: Any, mesh, spec_of: Callable[[tuple[int, ...]], P]) -> tuple[Any, Any]:
  """``tree`` placed leaf by leaf with ``spec_of(shape)``, and the shardings used."""
  shardings = jax.tree.map(lambda x: NamedSharding(mesh, spec_of(x.shape)), tree)
  return jax.device_put(tree, shardings), shardings


def replicated_dp(config, mesh, params, batch) -> Setup:
  """Parameters and Adam state on every device; GSPMD all-reduces the gradients."""
  opt = optax.adam(1e-3)
  params, params_sharding = _placed(params, mesh, lambda _: P())
  state, state_sharding = _placed(opt.init(params), mesh, lambda _: P())
  loss = make_loss(config, NamedSharding(mesh, P(AXIS)), stack="gather")
  shardings = (params_sharding, state_sharding, NamedSharding(mesh, P(AXIS)))
  return compile_plain("replicated DP", loss, opt, params, state, batch, shardings)


def gspmd_fsdp(config, mesh, params, batch, *, constrain_activations=True) -> Setup:
  """Parameters and Adam state sharded with ``NamedSharding``; GSPMD does the rest."""
  opt = optax.adam(1e-3)
  n = mesh.shape[AXIS]
  params, params_sharding = _placed(params, mesh, lambda shape: fsdp_spec(shape, n))
  state, state_sharding = _placed(opt.init(params), mesh, lambda shape: fsdp_spec(shape, n))
  activations = NamedSharding(mesh, P(AXIS)) if constrain_activations else None
  name = "GSPMD FSDP" if constrain_activations else "GSPMD FSDP, no act. constraint"
  shardings = (params_sharding, state_sharding, NamedSharding(mesh, P(AXIS)))
  loss = make_loss(config, activations, stack="gather")
  return compile_plain(name, loss, opt, params, state, batch, shardings)


def zero_explicit(
  config, mesh, params, batch, *, stage: int, stack: str = "scan", **options
) -> Setup:
  """``zerojax.value_and_grad``, the layers run as ``stack`` says (see ``STACKS``).

  ``options`` go to ``zerojax.zero{stage}`` (``quantized_weights``, ...). The
  setup is named ``zero{stage} explicit``, with the stack after a comma unless
  it is ``zerojax.scan``'s default.
  """
  tx = ZERO[stage](optax.adam(1e-3), mesh=mesh, axis_name=AXIS, **options)
  grad_fn = zerojax.value_and_grad(make_loss(config, stack=stack), tx)
  name = f"zero{stage} explicit" + ("" if stack == "scan" else f", {stack}")
  return compile_zero(name, tx, grad_fn, params, batch)


def zero_dropin(config, mesh, params, batch, *, stage: int, **options) -> Setup:
  """Plain ``jax.value_and_grad``; only the optimizer is wrapped."""
  tx = ZERO[stage](optax.adam(1e-3), mesh=mesh, axis_name=AXIS, **options)
  grad_fn = jax.value_and_grad(make_loss(config, NamedSharding(mesh, P(AXIS)), stack="gather"))
  return compile_zero(f"zero{stage} drop-in", tx, grad_fn, params, batch)


def build_setups(config: ModelConfig, mesh, batch, builders: tuple[Callable, ...]) -> list[Setup]:
  """The setups of ``builders`` (``(config, mesh, params, batch) -> Setup``), same start each."""
  setups = []
  for build in builders:
    params = init_params(config, jax.random.key(0))
    setups.append(build(config, mesh, params, batch))
    print(f"compiled {setups[-1].name}", flush=True)
  return setups


# ---------------------------------------------------------------------------
# Timing.
# ---------------------------------------------------------------------------


def run_steps(setup: Setup, count: int) -> list[float]:
  """Runs ``count`` steps, returning each one's wall time in seconds."""
  times = []
  for _ in range(count):
    start = time.perf_counter()
    setup.params, setup.state, loss = setup.step(setup.params, setup.state, *setup.batch)
    loss.block_until_ready()
    times.append(time.perf_counter() - start)
  setup.loss = float(loss)
  return times


def time_interleaved(setups: list[Setup], warmup: int, rounds: int, steps: int):
  """Step times per setup, and per-round ratios to the first setup.

  Each round runs ``steps`` steps of every setup in turn, so a slow spell of
  a shared machine hits all setups alike; a setup's ratio for a round is its
  median step time over the first setup's in the same round.

  Args:
    setups: the setups, the baseline first.
    warmup: untimed steps per setup.
    rounds: timing rounds.
    steps: timed steps per setup per round.

  Returns:
    ``(times, ratios)``: per setup, every timed step's seconds, and the
    per-round ratios.
  """
  for setup in setups:
    run_steps(setup, warmup)
  times = {s.name: [] for s in setups}
  ratios = {s.name: [] for s in setups}
  for _ in range(rounds):
    medians = {}
    for setup in setups:
      round_times = run_steps(setup, steps)
      times[setup.name] += round_times
      medians[setup.name] = statistics.median(round_times)
    baseline = medians[setups[0].name]
    for name, median in medians.items():
      ratios[name].append(median / baseline)
  return times, ratios


def relative_time(ratios: dict[str, list[float]], name: str, baseline: str) -> list[float]:
  """Per round, ``name``'s step time over ``baseline``'s (both timed in that round)."""
  return [a / b for a, b in zip(ratios[name], ratios[baseline], strict=True)]


def ratio_range(ratios: list[float]) -> str:
  """``"0.85-1.12"``: the smallest and largest of per-round ratios."""
  return f"{min(ratios):.2f}-{max(ratios):.2f}"


# ---------------------------------------------------------------------------
# Measuring.
# ---------------------------------------------------------------------------


def persistent_bytes(tree: Any) -> int:
  """Bytes one device holds of ``tree``: its first addressable shard of each leaf."""
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def ideal(name: str, psi: int, n: int) -> tuple[float, float]:
  """ZeRO-paper (persistent bytes per device, collective volume in Ψ) for fp32 Adam.

  Parameters take 4Ψ bytes and Adam's two moments 8Ψ. Replicated DP keeps
  all of it; stages 1 and 2 keep the parameters and 1/N of the state; stage 3
  and FSDP 1/N of everything. Communication: an all-reduce of the gradients
  is 2Ψ (a reduce-scatter plus an all-gather), stages 1 and 2 reduce-scatter
  gradients and all-gather parameters (2Ψ), stage 3 and FSDP all-gather the
  parameters twice, forward and backward, and reduce-scatter gradients (3Ψ).
  """
  if name.startswith("replicated"):
    return 12 * psi, 2.0
  if name.startswith(("zero1", "zero2")):
    return 4 * psi + 8 * psi / n, 2.0
  return 12 * psi / n, 3.0


def collective_volume(moved: dict[str, float]) -> float:
  """The bytes of ``moved`` (per collective kind) in ZeRO's accounting.

  An all-reduce counts twice its operand: a ring all-reduce is a
  reduce-scatter plus an all-gather.
  """
  return sum(moved.values()) + moved.get("all-reduce", 0)


def moved_bytes(profile: zerojax.StepProfile) -> dict[str, float]:
  """Bytes per collective kind of a profiled step."""
  return {kind: c.bytes for kind, c in profile.collectives.items()}


def volume_by_axis(step, mesh, psi: int) -> dict[str, float]:
  """``collective_volume`` of a compiled step over each axis of ``mesh``, in Ψ (fp32).

  A collective over several axes counts on each of them.
  """
  moved = {axis: 0.0 for axis in mesh.axis_names}
  for axes, kinds in zerojax.count_collectives_by_axes(step, mesh).items():
    volume = collective_volume({kind: c.bytes for kind, c in kinds.items()})
    for axis in axes:
      moved[axis] += volume / (4 * psi)
  return moved


def measure(setups: list[Setup], times, ratios, psi: int, n: int) -> list[dict[str, Any]]:
  """One row of results per setup: memory, collective bytes, volume, time and loss."""
  rows = []
  for setup in setups:
    profile = setup.profile()
    moved = moved_bytes(profile)
    ideal_bytes, ideal_volume = ideal(setup.name, psi, n)
    rows.append(
      {
        "setup": setup.name,
        "persistent": persistent_bytes((setup.params, setup.state)) / MIB,
        "ideal": ideal_bytes / MIB,
        "arguments": profile.argument_bytes / MIB,
        "temp": profile.temp_bytes / MIB,
        "peak": profile.peak_bytes / MIB,
        **{kind: size / MIB for kind, size in moved.items()},
        "volume": collective_volume(moved) / (4 * psi),
        "ideal volume": ideal_volume,
        "step ms": 1e3 * statistics.median(times[setup.name]),
        "vs DP": statistics.median(ratios[setup.name]),
        "range": ratio_range(ratios[setup.name]),
        "loss": setup.loss,
      }
    )
  return rows


# ---------------------------------------------------------------------------
# Reporting.
# ---------------------------------------------------------------------------


#: Every column the benchmarks' tables share, by the key of its row field: (title, format).
COLUMNS = {
  "n": ("N", "d"),
  "setup": ("setup", "s"),
  "persistent": ("params+opt MiB", ".3f"),
  "estimate": ("estimator MiB", ".3f"),
  "ideal": ("ZeRO formula MiB", ".3f"),
  "arguments": ("XLA args MiB", ".2f"),
  "temp": ("XLA temp MiB", ".2f"),
  "peak": ("XLA peak MiB", ".2f"),
  "all-gather": ("all-gather MiB", ".2f"),
  "reduce-scatter": ("reduce-scatter MiB", ".2f"),
  "all-reduce": ("all-reduce MiB", ".2f"),
  "collective-permute": ("permute MiB", ".2f"),
  "all-to-all": ("all-to-all MiB", ".2f"),
  "volume": ("volume (Ψ)", ".2f"),
  "ideal volume": ("ZeRO (Ψ)", ".0f"),
  "step ms": ("median step ms", ".0f"),
  "vs DP": ("time vs DP", ".2f"),
  "range": ("per-round range", "s"),
  "loss": ("final loss", ".5f"),
}


#: The columns of a step's collectives, and of its time against replicated DP's.
COLLECTIVE_COLUMNS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "volume")
TIME_COLUMNS = ("step ms", "vs DP", "range")


def start(args: argparse.Namespace) -> tuple[Clock, ModelConfig, jax.sharding.Mesh]:
  """A benchmark's start: ``--devices`` CPU devices, the clock, the model and a flat mesh."""
  use_cpu_devices(args.devices)
  mesh = jax.make_mesh((args.devices,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
  return Clock(), model_config(args), mesh


def section(title: str, *lines: str) -> list[str]:
  """A report's section: its bold title, then ``lines``, each block followed by a blank line."""
  return [f"**{title}**", "", *lines, ""]


def columns(*keys: str, more: dict[str, tuple[str, str]] | None = None) -> dict:
  """The ``COLUMNS`` of ``keys``, in that order, then a script's own ``more``."""
  return {key: COLUMNS[key] for key in keys} | (more or {})


def table(rows: list[dict[str, Any]], columns: dict[str, tuple[str, str]]) -> str:
  """A Markdown table of ``rows`` (also plain text); ``columns`` maps a key to (title, format)."""
  header = [title for title, _ in columns.values()]
  body = [[format(row[key], spec) for key, (_, spec) in columns.items()] for row in rows]
  widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
  render = lambda line: "| " + " | ".join(map(str.ljust, line, widths)) + " |"
  rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
  return "\n".join([render(header), rule, *(render(line) for line in body)])


def _cpu_name() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    return platform.processor() or platform.machine()


class Clock:
  """The wall time and the one-minute load average of a run, from its start."""

  def __init__(self):
    self.start, self.load = time.perf_counter(), os.getloadavg()[0]

  def elapsed(self) -> float:
    return time.perf_counter() - self.start


def provenance(devices: int, clock: Clock) -> str:
  """When, with what and on what machine the run was made, how long it took, and the load."""
  return (
    f"Measured {datetime.date.today().isoformat()} with jax {jax.__version__}, optax "
    f"{optax.__version__}, Python {platform.python_version()}, on {platform.platform()}: "
    f"{len(os.sched_getaffinity(0))} CPUs ({_cpu_name()}) split into {devices} forced "
    f"host devices. The whole run took {clock.elapsed():.0f} s; the one-minute load average "
    f"was {clock.load:.1f} at the start and {os.getloadavg()[0]:.1f} at the end."
  )


def command(script: str, argv: list[str]) -> list[str]:
  """The lines of a Markdown code block that reruns ``script`` with ``argv``."""
  return ["```", " ".join([f"python benchmarks/{script}", *argv]), "```"]


def describe_model(model: ModelConfig, psi: int) -> str:
  """One sentence: the model's shape, batch, optimizer and parameter count Ψ."""
  return (
    f"Model: {model.layers} layers, d_model {model.d_model}, {model.heads} heads, vocabulary "
    f"{model.vocab}, global batch {model.batch} x {model.seq} tokens, fp32, `optax.adam`; "
    f"Ψ = {psi:,} parameters ({4 * psi / MIB:.2f} MiB)."
  )


def describe_timing(warmup: int, rounds: int, steps: int) -> str:
  """One sentence: how the setups were timed."""
  return (
    f"Timing: {warmup} warm-up steps, then {rounds} interleaved rounds, each timing "
    f"{steps} step(s) of every setup."
  )


def write_markdown(path: str, section: str, begin: str, title: str) -> None:
  """Replaces the generated section of ``path`` (between the markers), keeping the rest.

  Args:
    path: the Markdown file; created, with ``title`` as its heading, if missing.
    section: the new text between the markers.
    begin: the marker that opens the section (``RESULTS_END`` closes it).
    title: the heading of a new file.
  """
  block = f"{begin}\n{section}\n{RESULTS_END}"
  try:
    with open(path) as f:
      text = f.read()
  except FileNotFoundError:
    text = f"# {title}\n\n{begin}\n{RESULTS_END}\n"
  if begin not in text or RESULTS_END not in text:
    raise ValueError(f"{path} has no {begin!r} ... {RESULTS_END!r} section to replace")
  before, rest = text.split(begin, 1)
  after = rest.split(RESULTS_END, 1)[1]
  with open(path, "w") as f:
    f.write(before + block + after)


def plot_path(plots: str | None, markdown: str | None, name: str) -> tuple[str | None, str | None]:
  """Where to save the plot ``name`` in ``plots``, and its path relative to ``markdown``.

  ``(None, None)`` when no ``plots`` directory is given.
  """
  if not plots:
    return None, None
  os.makedirs(plots, exist_ok=True)
  path = os.path.join(plots, name)
  return path, os.path.relpath(path, os.path.dirname(markdown or ".") or ".")


def mark_zero_volumes(ax, right: float) -> None:
  """Dashed lines at ZeRO's 2Ψ and 3Ψ on a plot of volume per step, labelled at ``right``."""
  for level in (2, 3):
    ax.axhline(level, color="gray", linestyle="--", linewidth=1)
    ax.annotate(f"{level}Ψ", (right, level), xytext=(2, 2), textcoords="offset points")
