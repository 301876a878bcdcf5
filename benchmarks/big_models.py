"""Models no device holds, compiled for the machines they need: init, train, evaluate, sample.

A 7.5B and a 70B transformer (``transformer.py``: Llama's shape, bfloat16
compute, float32 master weights, AdamW) compiled deviceless (nothing runs) for
the machines wave 5 names: the 7.5B model on a TPU v5e 8 x 8 (64 chips of 16
GiB) and on 8 nodes of 8 H100 (80 GB), the 70B model on a v5e 16 x 16 (256
chips) and on 16 nodes of 8 H100. For each, per device, what four programs
need, zerojax's stage 3 next to GSPMD FSDP's (``jax.jit`` with
``NamedSharding`` s, the compiler placing the gathers):

* ``init``: ``tx.sharded_init(init_fn)``, the parameters and AdamW's state
  made straight into shards, against ``jax.jit(init, out_shardings=...)``
  (MaxText's way) on a mesh of ``Auto`` axes and of explicit ones;
* ``train``: one step, ``zerojax.value_and_grad`` with the layers under
  ``zerojax.scan``, against ``jax.value_and_grad`` over ``jax.lax.scan``,
  each layer's ``jax.checkpoint`` saving nothing but its input; one sequence
  of 2048 tokens a device;
* ``evaluate``: each sequence's loss, ``zerojax.forward``, against the same
  function under ``jax.jit`` and against ``tx.gather`` (the whole model);
* ``sample``: one decoding step of one sequence a device with a KV cache of
  2048 positions, ``zerojax.forward``, against ``jax.jit``.

Each row's "formula" is the ZeRO formula's bytes of model state a device
holds, plus its share of the batch's KV cache when sampling: 12 bytes a
parameter split N ways where the optimizer state is made or updated (float32
parameters, which zerojax's stage 3 stores as the master copy and casts to
bfloat16 as it gathers, and AdamW's two float32 moments), 4 where only the
parameters are arguments. The gradients' shards (4 more bytes a parameter,
N ways) are the train step's temporaries. "arguments", "outputs" and "temporaries" are
``compiled.memory_analysis()``'s, "peak" XLA's own peak where the compiler
reports one. A program that does not fit is refused by the compiler: its row
says so.

Run (each machine compiles in a ``zerojax.diagnostics.DevicelessProcess`` of its own, which
runs ``compile_program`` for each program, and is cached in ``--cache``, where a run compiles
only the programs missing; about 10 minutes for all four on 2 cores, --again compiles them all
again)::

  python benchmarks/big_models.py --markdown docs/big_models.md
  python benchmarks/big_models.py --only 70B:v5e-256
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
import report
import transformer
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax
from zerojax.diagnostics import DevicelessProcess, deviceless_mesh, deviceless_target

GIB = 2**30
#: The (model, machine) pairs, as ``--only`` names them.
RUNS = ("7.5B:v5e-64", "7.5B:h100x64", "70B:v5e-256", "70B:h100x128")
SETUPS = (
  ("init", "zero3 sharded_init"),
  ("init", "GSPMD FSDP, Auto axes"),
  ("init", "GSPMD FSDP, explicit axes"),
  ("train", "zero3"),
  ("train", "zero3, bf16 reductions"),
  ("train", "GSPMD FSDP"),
  ("evaluate", "zero3 forward"),
  ("evaluate", "zero3 forward, prefetch=0"),
  ("evaluate", "GSPMD FSDP"),
  ("evaluate", "on tx.gather"),
  ("sample", "zero3 forward"),
  ("sample", "zero3 forward, prefetch=0"),
  ("sample", "GSPMD FSDP"),
)
AXIS = transformer.AXIS


class Programs:
  """The four programs of ``config`` on ``target``'s devices, zerojax's and GSPMD FSDP's."""

  def __init__(self, config: transformer.Config, target: str, sequences: int = 1):
    self.config, self.sequences = config, sequences
    self.n = deviceless_target(target).device_count
    self.mesh = deviceless_mesh(target, (self.n,), (AXIS,), (AxisType.Explicit,))
    self.auto = deviceless_mesh(target, (self.n,), (AXIS,), (AxisType.Auto,))
    self.tx = zerojax.zero3(optax.adamw(1e-4), mesh=self.mesh, precision="bf16")
    # "bf16" reduces gradients in float32; GSPMD FSDP's gradients are reduced in bfloat16, as
    # they come out of the bfloat16 matmuls: this one compares like with like.
    bf16_reductions = zerojax.Precision(params="float32", compute="bfloat16", reduce="bfloat16")
    self.bf16_reductions_tx = zerojax.zero3(
      optax.adamw(1e-4), mesh=self.mesh, precision=bf16_reductions
    )
    # Whole parameters feed GSPMD's programs, whose mesh is of Auto axes.
    self.auto_tx = zerojax.zero3(optax.adamw(1e-4), mesh=self.auto, precision="bf16")
    self.init_fn = lambda key: transformer.init_fn(config, key)
    self.full = transformer.abstract_params(config)

  def abstract(self, mesh, like: Any, spec: P) -> jax.ShapeDtypeStruct:
    """An abstract array of ``like``'s shape and dtype, placed on ``mesh`` as ``spec`` says."""
    return jax.ShapeDtypeStruct(like.shape, like.dtype, sharding=NamedSharding(mesh, spec))

  def batch(self, mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """``sequences`` a device to train on; one to sample from: its inputs and cache."""
    c, n = self.config, self.n
    batch = {
      "tokens": jax.ShapeDtypeStruct((n * self.sequences, c.seq_len + 1), jnp.int32),
      "last": jax.ShapeDtypeStruct((n,), jnp.int32),
      "position": jax.ShapeDtypeStruct((n,), jnp.int32),
      **transformer.abstract_cache(c, n),
    }
    return {k: self.abstract(mesh, s, P(AXIS)) for k, s in batch.items()}

  def key(self, mesh) -> jax.ShapeDtypeStruct:
    return self.abstract(mesh, jax.eval_shape(lambda: jax.random.key(0)), P())

  def stored(self, tx: zerojax.ZeroTransformation) -> tuple[Any, Any]:
    """zerojax's parameters and optimizer state, abstract, as ``tx.sharded_init`` makes them."""
    with jax.set_mesh(tx.mesh):
      return jax.eval_shape(tx.sharded_init(self.init_fn), self.key(tx.mesh))

  def fsdp(self) -> tuple[Any, Any]:
    """GSPMD FSDP's float32 parameters and AdamW state, abstract, split as ``fsdp_specs`` says
    (the moments as their parameters, the step count whole)."""
    specs = transformer.fsdp_specs(self.config, AXIS)
    params = jax.tree.map(lambda s, spec: self.abstract(self.auto, s, spec), self.full, specs)
    # A moment's path ends in its parameter's (optax's tree_map_params would run init on arrays,
    # and no array can be made here); the step count is whole.
    by_keys = {
      tuple(k.key for k in path): spec
      for path, spec in jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec)[0]
    }

    def place(path: Any, s: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
      keys = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
      return self.abstract(self.auto, s, by_keys.get(keys, P()) if s.ndim else P())

    opt_state = jax.tree_util.tree_map_with_path(
      place, jax.eval_shape(optax.adamw(1e-4).init, self.full)
    )
    return params, opt_state

  def lower(self, program: str, setup: str) -> jax.stages.Lowered:
    c = self.config
    if program == "init":
      if setup.startswith("zero3"):
        with jax.set_mesh(self.mesh):
          return self.tx.sharded_init(self.init_fn).lower(self.key(self.mesh))
      return self._fsdp_init(AxisType.Auto if "Auto" in setup else AxisType.Explicit)
    zero, gathered = setup.startswith("zero3"), setup == "on tx.gather"
    prefetch = 0 if setup.endswith("prefetch=0") else 1
    mesh = self.mesh if zero else self.auto
    batch = self.batch(mesh)
    if zero:
      params, opt_state = self.stored(self.tx)
    elif gathered:  # on Auto axes the abstract outputs carry no sharding: ask for the stored one
      shard, shardings = self.auto_tx.shard, self.auto_tx.param_shardings(self.full)
      params = jax.tree.map(
        lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
        jax.eval_shape(shard, self.full),
        shardings,
      )
    else:
      params, opt_state = self.fsdp()
    with jax.set_mesh(mesh):
      if program == "train":
        tx = self.bf16_reductions_tx if setup.endswith("bf16 reductions") else self.tx
        return jax.jit(self._train_step(zero, tx), donate_argnums=(0, 1)).lower(
          params, opt_state, batch["tokens"]
        )
      if program == "evaluate":
        loss = lambda p, t: transformer.per_example_loss(c, p, t, zero, prefetch)
        if gathered:  # the whole model on every device, in the compute dtype
          fn = lambda p, t: loss(self.auto_tx.gather(p), t)
        else:
          fn = zerojax.forward(loss, self.tx) if zero else loss
        return jax.jit(fn).lower(params, batch["tokens"])
      step = lambda p, t, k, v, at: transformer.decode(
        c, p, t, {"k": k, "v": v}, at, zero, prefetch
      )
      fn = zerojax.forward(step, self.tx) if zero else step
      args = (batch["last"], batch["k"], batch["v"], batch["position"])
      return jax.jit(fn, donate_argnums=(2, 3)).lower(params, *args)

  def train(
    self, zero: bool, tx: zerojax.ZeroTransformation, remat: Any, prefetch: int = 1
  ) -> jax.stages.Lowered:
    """The training step, zerojax's (``tx``) or GSPMD FSDP's, its layer under ``remat``
    (``remat`` and zerojax's ``prefetch`` as ``transformer.per_example_loss`` takes them)."""
    mesh = self.mesh if zero else self.auto
    params, opt_state = self.stored(tx) if zero else self.fsdp()
    with jax.set_mesh(mesh):
      step = self._train_step(zero, tx, remat, prefetch)
      return jax.jit(step, donate_argnums=(0, 1)).lower(
        params, opt_state, self.batch(mesh)["tokens"]
      )

  def _train_step(
    self, zero: bool, tx: zerojax.ZeroTransformation, remat: Any = None, prefetch: int = 1
  ):
    c = self.config
    if zero:
      grad_fn = zerojax.value_and_grad(transformer.mean_loss(c, True, remat, prefetch), tx)
    else:
      grad_fn, tx = jax.value_and_grad(transformer.mean_loss(c, False, remat)), optax.adamw(1e-4)

    def step(params, opt_state, tokens):
      loss, grads = grad_fn(params, tokens)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    return step

  def _fsdp_init(self, axis_type: AxisType) -> jax.stages.Lowered:
    """``jax.jit(init, out_shardings=...)`` of the parameters and AdamW's state (on explicit
    axes, values traced without a sharding are whole on every device)."""
    mesh = self.auto if axis_type == AxisType.Auto else self.mesh
    fresh = lambda key: (lambda p: (p, optax.adamw(1e-4).init(p)))(self.init_fn(key))
    params, opt_state = self.fsdp()
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s.sharding.spec), (params, opt_state))
    with jax.set_mesh(mesh):
      return jax.jit(fresh, out_shardings=shardings).lower(self.key(mesh))

  def formula(self, program: str, setup: str) -> float:
    """The ZeRO paper's model-state bytes a device holds in ``program``, GiB."""
    psi, n = self.config.parameters, self.n
    state = 12 if program in ("init", "train") else 4
    cache = sum(s.size * 2 for s in transformer.abstract_cache(self.config, n).values())
    return (state * psi + (cache if program == "sample" else 0)) / n / GIB


def _is_spec(x: Any) -> bool:
  return isinstance(x, P)


def measure(lower: Any, *args: Any) -> dict[str, Any]:
  """The per-device GiB of the program ``lower(*args)`` lowers, compiled (``memory_analysis()``'s,
  ``host_...`` in host memory), or the compiler's reason (``error``) it does not fit."""
  try:
    memory = lower(*args).compile().memory_analysis()
  except Exception as error:  # XLA refuses a program that does not fit the device
    return {"error": str(error).splitlines()[0][:160]}
  return {
    "arguments": memory.argument_size_in_bytes / GIB,
    "outputs": memory.output_size_in_bytes / GIB,
    "temporaries": memory.temp_size_in_bytes / GIB,
    "aliased": memory.alias_size_in_bytes / GIB,
    "peak": getattr(memory, "peak_memory_in_bytes", 0) / GIB or None,
    **{
      f"host {k}": getattr(memory, f"host_{k}_size_in_bytes", 0) / GIB
      for k in ("argument", "output", "temp", "alias")
    },
  }


@functools.cache
def _programs(model: str, target: str) -> Programs:
  return Programs(transformer.CONFIGS[model], target)


def compile_program(model: str, target: str, program: str, setup: str) -> dict[str, Any]:
  """``program: setup`` 's row on ``target``: its formula and ``measure`` 's per-device bytes, or
  the compiler's reason it does not fit (in a ``DevicelessProcess`` for ``target``: ``run``
  calls this)."""
  programs = _programs(model, target)
  return {"formula": programs.formula(program, setup), **measure(programs.lower, program, setup)}


def run(name: str, cache: Path, again: bool) -> dict[str, Any]:
  """``name``'s results (``programs`` and the ``seconds`` they took to compile), from ``cache``
  or compiled in a ``DevicelessProcess`` for its machine."""
  model, target = name.split(":")
  path = cache / f"{model}-{target}.json"
  cached = {} if again or not path.exists() else json.loads(path.read_text())
  done = cached.get("programs", {})
  keys = [f"{program}: {setup}" for program, setup in SETUPS]
  if set(done) != set(keys):
    clock = report.Clock()
    programs = {}
    with DevicelessProcess(target, scheduler_log=False) as process:
      for key, (program, setup) in zip(keys, SETUPS, strict=True):
        if key not in done:
          done[key] = process.call(f"{__file__}:compile_program", model, target, program, setup)
          print(f"{model} on {target}, {program}: {setup}: {done[key]}", flush=True)
        programs[key] = done[key]
    cache.mkdir(parents=True, exist_ok=True)
    seconds = cached.get("seconds", 0) + clock.elapsed()
    path.write_text(json.dumps({"programs": programs, "seconds": seconds}, indent=1))
  return json.loads(path.read_text())


def note(row: dict[str, Any], machine: Any) -> str:
  """Why a program does not fit: the compiler's refusal, or, as XLA:GPU compiles a program that
  needs more than the device has (XLA:TPU refuses it), the bytes it needs."""
  if "error" in row:
    return row["error"]
  need = row["arguments"] + row["outputs"] - row["aliased"] + row["temporaries"]
  hbm = machine.hbm_bytes / GIB
  if machine.platform == "cuda" and need > hbm:
    return f"does not fit: needs {need:.0f} GiB of {hbm:.0f}"
  return ""


def section(name: str, results: dict[str, dict[str, Any]]) -> list[str]:
  model, target = name.split(":")
  config, machine = transformer.CONFIGS[model], deviceless_target(target)
  hbm = machine.hbm_bytes / GIB
  keys = ("formula", "arguments", "outputs", "temporaries", "peak")
  cell = lambda row, k: f"{row[k]:.2f}" if row.get(k) is not None else "-"
  rows = [
    {"program": what, **{k: cell(row, k) for k in keys}, "note": note(row, machine)}
    for what, row in results.items()
  ]
  return report.section(
    f"{config.parameters / 1e9:.1f}B parameters ({config.layers} layers, d {config.d}) on "
    f"{target} ({machine.device_count} devices of {hbm:.0f} GiB), GiB per device",
    report.table(rows, {k: (k, "") for k in ("program", *keys, "note")}),
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--only", action="append", choices=RUNS, help="one model:machine pair")
  parser.add_argument("--cache", type=Path, default=Path("/tmp/zerojax-big-models"))
  parser.add_argument("--again", action="store_true", help="compile again what is cached")
  report.add_output_flags(parser)
  args = parser.parse_args()
  clock = report.Clock()
  lines, seconds = [], 0.0
  for name in args.only or RUNS:
    results = run(name, args.cache, args.again)
    lines += section(name, results["programs"])
    seconds += results["seconds"]
  text = "\n".join(
    [
      *lines,
      f"Compiling the programs took {seconds:.0f} s in all (each machine's are cached in "
      "--cache; --again compiles them again).",
      "",
      report.accelerator_provenance(clock),
      "",
      *report.command("big_models.py", sys.argv[1:]),
    ]
  )
  print(text)
  if args.markdown:
    begin = "<!-- results: big_models.py -->"
    report.write_markdown(args.markdown, text, begin, "Models bigger than a device")


if __name__ == "__main__":
  main()
