"""Compiles one small training step several ways for a GPU or TPU target, and reports them.

Run by tests/test_accelerators.py in a process of its own, started with
``zerojax.diagnostics.deviceless_environment(TARGET)`` (the compilers read it
when they load): ``python tests/accelerator_worker.py TARGET OUT.json [SETUP ...]``. For
each setup (plain data parallelism, GSPMD FSDP, zero1, zero2, zero3 on its
paths) it writes the compiled step's per-device arguments and temporaries,
its layer loops (``zerojax.diagnostics.loop_collectives``) and, on GPU, XLA's estimate of
the step from its scheduler's log and how many reduce-scatters XLA's collective pipeliner moved
across loop iterations. Setups whose names end in "(biased)" train a second model:
bfloat16 compute, a bias per matrix, and a hidden width no mesh axis divides (padded shards).
Setups whose names end in "(offloaded)" or "(named saved)" run the first model under the
layer's own ``jax.checkpoint``, whose policy offloads the up-projection (checkpoint name
``"hidden"``) to pinned host memory or keeps it on the device; they report
``zerojax.diagnostics.profile`` 's host fields too.
"""

import argparse
import dataclasses
import json
import re
import sys

import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax
from zerojax.diagnostics import (
  DEVICELESS_TARGETS,
  capture_stderr,
  deviceless_mesh,
  deviceless_target,
  scheduler_estimate,
)

LAYERS, D, F = 4, 512, 1536
#: The biased model's hidden width (8 devices do not divide it, so its shards are padded) and
#: depth: deep enough that a copy of every layer's shard (2 layers of it) shows.
ODD, BIASED_LAYERS = 1500, 16
#: Tokens a step, by platform. XLA:TPU's compile time grows with them (three programs: 46 s of
#: CPU at 4096 tokens, 17 s at 1024) and its temporaries tell the paths apart as well at 1024
#: (a zero3 that packed each layer's leaves into one byte buffer per all-gather, as zerojax once
#: did: 207 MiB against GSPMD FSDP's 2); XLA:GPU overlaps the backward
#: loop's reductions only with enough compute to hide them behind, so it keeps 4096.
TOKENS = {"cuda": 8 * 512, "tpu": 8 * 128}
DOTS = jax.checkpoint_policies.dots_saveable
#: The checkpoint name of the activation the "(offloaded)" and "(named saved)" setups keep.
HIDDEN = "hidden"
#: The layer's own policies: offload the named activation to host memory, or keep it on the device.
NAMED = {
  "offloaded": jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[],
    names_which_can_be_offloaded=[HIDDEN],
    offload_src="device",
    offload_dst="pinned_host",
  ),
  "named saved": jax.checkpoint_policies.save_only_these_names(HIDDEN),
}


def abstract(tree, shardings):
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
  )


def full_params(biased=False):
  if biased:
    return {
      "up": jax.ShapeDtypeStruct((BIASED_LAYERS, D, ODD), jnp.float32),
      "up_bias": jax.ShapeDtypeStruct((BIASED_LAYERS, ODD), jnp.float32),
      "down": jax.ShapeDtypeStruct((BIASED_LAYERS, ODD, D), jnp.float32),
      "down_bias": jax.ShapeDtypeStruct((BIASED_LAYERS, D), jnp.float32),
    }
  return {
    "up": jax.ShapeDtypeStruct((LAYERS, D, F), jnp.float32),
    "down": jax.ShapeDtypeStruct((LAYERS, F, D), jnp.float32),
  }


def block(h, w):
  if "up_bias" in w:  # the biased model, in bfloat16 (a no-op where the weights arrive in it)
    w = jax.tree.map(lambda x: x.astype(jnp.bfloat16), w)
    x = h.astype(jnp.bfloat16)
    delta = jax.nn.gelu(x @ w["up"] + w["up_bias"]) @ w["down"] + w["down_bias"]
    return h + delta.astype(h.dtype), None
  return h + jax.nn.gelu(h @ w["up"]) @ w["down"], None


def named_block(keep):
  """``block`` under its own ``jax.checkpoint``, whose policy ``NAMED[keep]`` keeps "hidden"."""

  def layer(h, w):
    hidden = checkpoint_name(h @ w["up"], HIDDEN)
    return h + jax.nn.gelu(hidden) @ w["down"], None

  return jax.checkpoint(layer, policy=NAMED[keep])


def plain_step(opt, loss, arrays=lambda params: params):
  """A step of plain ``jax.value_and_grad`` on ``arrays(params)`` (``tx.unpad`` for zerojax)."""

  def step(params, state, x):
    value, grads = jax.value_and_grad(loss)(arrays(params), x)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  return step


def fsdp_spec(shape):
  """GSPMD FSDP's split: the first dimension after the layer axis that 8 divides, else none."""
  dims = [None] * len(shape)
  for axis in range(1, len(shape)):
    if shape[axis] % 8 == 0:
      dims[axis] = "data"
      return P(*dims)
  return P()  # a bias of the odd width stays whole: a NamedSharding cannot pad it


def gspmd(mesh, spec, biased=False, keep=None):
  """Plain JAX with parameters and Adam state placed by ``spec`` (``P()``: plain DP).

  With ``keep``, the layer is ``named_block(keep)`` (the layer's own policy), else
  ``block`` under ``DOTS``.
  """
  opt = optax.adam(1e-3)
  full = full_params(biased)
  specs = jax.tree.map(lambda x: fsdp_spec(x.shape) if spec != P() else P(), full)
  params = abstract(full, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
  state = jax.eval_shape(opt.init, params)
  leaves = zip(jax.tree.leaves(full), jax.tree.leaves(params), strict=True)
  by_shape = {x.shape: s.sharding for x, s in leaves}
  state = abstract(
    state,
    jax.tree.map(lambda x: by_shape[x.shape] if x.ndim else NamedSharding(mesh, P()), state),
  )
  batch = NamedSharding(mesh, P("data"))
  layer = block if keep is None else named_block(keep)

  def loss(params, x):
    body = lambda h, w: layer(jax.lax.with_sharding_constraint(h, batch), w)
    h, _ = jax.lax.scan(body if keep else jax.checkpoint(body, policy=DOTS), x, params)
    return jnp.mean(h**2)

  return plain_step(opt, loss), (params, state)


def zero(mesh, stage, stack=None, biased=False, keep=None):
  """zerojax's ``stage``: ``stack`` runs the layers on the explicit path, else drop-in.

  The biased model gathers and reduces in bfloat16 and shards every leaf, the biases too.
  With ``keep``, ``zerojax.scan`` runs ``named_block(keep)``, under its own policy.
  """
  # Gradients reduced in bfloat16 too, as GSPMD FSDP reduces those of the bfloat16 casts.
  bf16 = zerojax.Precision(params="fp32", compute="bf16", reduce="bf16")
  options = dict(precision=bf16, min_shard_size=1) if biased else {}
  tx = getattr(zerojax, f"zero{stage}")(optax.adam(1e-3), mesh=mesh, **options)
  full = full_params(biased)
  params = abstract(jax.eval_shape(tx.shard, full), tx.param_shardings(full))
  state = abstract(jax.eval_shape(tx.init, params), tx.state_shardings(full))
  if stack is None:
    return gspmd_loss_step(tx, mesh), (params, state)

  def loss(params, x):
    if stack == "gather":
      policy = zerojax.except_gathered(DOTS)
      body = jax.checkpoint(lambda h, w: block(h, zerojax.gather(w)), policy=policy)
      h, _ = jax.lax.scan(body, x, params)
    elif keep is not None:
      h, _ = zerojax.scan(named_block(keep), x, params, prefetch=stack)
    elif stack == "defer":
      h, _ = zerojax.scan(block, x, params, policy=DOTS, defer_reductions=True)
    else:
      h, _ = zerojax.scan(block, x, params, prefetch=stack, policy=DOTS)
    return jnp.mean(h**2)

  def step(params, state, x):
    value, grads = zerojax.value_and_grad(loss, tx)(params, x)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  return step, (params, state)


def gspmd_loss_step(tx, mesh):
  batch = NamedSharding(mesh, P("data"))

  def loss(params, x):
    body = lambda h, w: block(jax.lax.with_sharding_constraint(h, batch), w)
    h, _ = jax.lax.scan(jax.checkpoint(body, policy=DOTS), x, params)
    return jnp.mean(h**2)

  return plain_step(tx, loss, tx.unpad)


def setups(target):
  explicit = deviceless_mesh(target, (8,), ("data",), (AxisType.Explicit,))
  auto = deviceless_mesh(target, (8,), ("data",), (AxisType.Auto,))
  return {
    "plain DP": lambda: (gspmd(auto, P()), auto),
    "GSPMD FSDP": lambda: (gspmd(auto, P(None, "data")), auto),
    "zero1": lambda: (zero(explicit, 1, stack=1), explicit),
    "zero2": lambda: (zero(explicit, 2, stack=1), explicit),
    "zero3 scan": lambda: (zero(explicit, 3, stack=1), explicit),
    "zero3 scan, prefetch=0": lambda: (zero(explicit, 3, stack=0), explicit),
    "zero3 scan, deferred reductions": lambda: (zero(explicit, 3, stack="defer"), explicit),
    "zero3 gather": lambda: (zero(explicit, 3, stack="gather"), explicit),
    "zero3 drop-in": lambda: (zero(auto, 3), auto),
    "GSPMD FSDP (biased)": lambda: (gspmd(auto, P(None, "data"), biased=True), auto),
    "zero3 scan (biased)": lambda: (zero(explicit, 3, stack=1, biased=True), explicit),
    "zero3 scan, prefetch=0 (biased)": lambda: (
      zero(explicit, 3, stack=0, biased=True),
      explicit,
    ),
    "zero3 gather (biased)": lambda: (zero(explicit, 3, stack="gather", biased=True), explicit),
    **{
      f"{name} ({keep})": build
      for keep in NAMED
      for name, build in (
        ("GSPMD FSDP", lambda keep=keep: (gspmd(auto, P(None, "data"), keep=keep), auto)),
        ("zero3 scan", lambda keep=keep: (zero(explicit, 3, stack=1, keep=keep), explicit)),
      )
    },
  }


def narrowed_stacks(text, params):
  """How many ``convert`` s in the program make a bfloat16 copy of a stacked parameter's shard.

  XLA:TPU's bfloat16 propagation makes one of a float32 stack whose only use in a layer loop
  is a slice cast to bfloat16: every layer's shard, alive through the loop.
  """
  shapes = set()
  for leaf in jax.tree.leaves(params):
    local = leaf.sharding.shard_shape(leaf.shape)
    if len(local) >= 2 and local[0] in (LAYERS, BIASED_LAYERS):
      shapes.add(",".join(map(str, local)))
  return sum(len(re.findall(rf"= bf16\[{shape}\]\S* convert\(", text)) for shape in shapes)


def pipelined_reductions(text):
  """How many reduce-scatters of the GPU program XLA's collective pipeliner moved across loop
  iterations (each carried into the next iteration, the last one after the loop)."""
  starts = [line for line in text.splitlines() if "reduce-scatter-start(" in line]
  return sum('"is_pipelined":true' in line for line in starts)


def measure(target, build, profiled=False):
  (step, (params, state)), mesh = build()
  platform = deviceless_target(target).platform
  x = jax.ShapeDtypeStruct(
    (TOKENS[platform], D), jnp.float32, sharding=NamedSharding(mesh, P("data"))
  )
  jitted = jax.jit(step, donate_argnums=(0, 1))
  with capture_stderr() as log:
    compiled = jitted.lower(params, state, x).compile()
  memory = compiled.memory_analysis()
  report = {
    "arguments": memory.argument_size_in_bytes,
    "temporaries": memory.temp_size_in_bytes,
    "loops": [dataclasses.asdict(loop) for loop in zerojax.diagnostics.loop_collectives(compiled)],
    "narrowed_stacks": narrowed_stacks(compiled.as_text(), params),
    "host_buffers": len(re.findall(r"S\(5\)\}", compiled.as_text() or "")),
  }
  if profiled:  # zerojax.diagnostics.profile compiles the step again, as a user calls it
    found = zerojax.diagnostics.profile(jitted, params, state, x)
    report["profile"] = {
      field.name: getattr(found, field.name)
      for field in dataclasses.fields(found)
      if field.name.endswith("_bytes")
    }
  if platform == "cuda":
    estimate = scheduler_estimate(log[0], compiled)
    report["cycles"] = estimate.cycles
    report["loop_waiting"] = [loop.waiting for loop in estimate.loops]
    report["pipelined_reductions"] = pipelined_reductions(compiled.as_text())
  return report


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("target", choices=DEVICELESS_TARGETS)
  parser.add_argument("out")
  parser.add_argument("setups", nargs="*", help="the setups to compile (default: all)")
  args = parser.parse_args()
  chosen = {
    name: build
    for name, build in setups(args.target).items()
    if name in args.setups or not args.setups
  }
  results = {
    name: measure(args.target, build, profiled=any(f"({keep})" in name for keep in NAMED))
    for name, build in chosen.items()
  }
  with open(args.out, "w") as out:
    json.dump(results, out, indent=1)
  print(
    json.dumps({name: r["temporaries"] / 2**20 for name, r in results.items()}), file=sys.stderr
  )


if __name__ == "__main__":
  main()
