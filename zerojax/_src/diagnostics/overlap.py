"""Whether a loop's collectives can overlap its compute, read from optimized HLO.

Where an all-gather's result feeds a matmul of the same loop iteration, the
matmul waits for the network whatever the scheduler does; where the gathered
weights reach the compute only through the loop's carry (``zerojax.scan``
with ``prefetch=1``), the next iteration's gather can run while this one
computes. Likewise a reduce-scatter of a gradient the same iteration computed
waits for that matmul, while one of the previous iteration's gradient need
not. This is visible in the compiled program's text on any backend, CPU
included, where collectives are synchronous and overlap cannot be timed.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax

from zerojax._src.diagnostics import hlo as hlo_lib

#: Opcodes that compute (rather than move or reshape data).
_COMPUTE = frozenset({"dot", "convolution"})
_GATHERS = frozenset({"all-gather"})
_REDUCTIONS = frozenset({"reduce-scatter", "all-to-all"})
_COLLECTIVES = frozenset({"all-gather", "reduce-scatter", "all-to-all", "all-reduce"})
#: The custom calls that compute: GPU library matmuls and convolutions (``__cublas$lt$matmul``).
_LIBRARY_COMPUTE = re.compile(r"cublas|cudnn|gemm|matmul|conv", re.IGNORECASE)
#: How XLA:TPU names the fusions that start and finish an asynchronous collective.
_TPU_START, _TPU_DONE = "async-collective-start", "async-collective-done"


@dataclasses.dataclass(frozen=True)
class LoopCollectives:
  """The collectives of one while loop's body, and whether each waits on the same iteration.

  Attributes:
    body: the name of the body computation.
    gathers: all-gathers per iteration.
    reductions: reduce-scatters (and all-to-alls, the quantized kind) per iteration.
    waiting_gathers: all-gathers whose result a matmul or convolution of the
      same iteration consumes (directly, through fusions, or through a loop
      nested in the body): that compute cannot start before the gather ends.
    waiting_reductions: reductions whose operand a matmul or convolution of
      the same iteration produced: they cannot start before it ends.
    asynchronous: the collectives (gathers and reductions) that run
      asynchronously: started, then finished by a later instruction
      (``all-gather-start`` ... ``all-gather-done`` on GPU, an
      ``async-collective-start`` ... ``-done`` fusion pair on TPU). The CPU's
      are all synchronous.
    overlapped: the asynchronous ones with a matmul or convolution scheduled
      between their start and their finish: compute that runs while they move
      data (read from the scheduled program's order).

  Example:
    The layer loops of a stage-3 step, forward and backward, with and without prefetching:

    >>> import jax, jax.numpy as jnp, optax, zerojax
    >>> tx = zerojax.zero3(optax.sgd(0.1), mesh=jax.make_mesh((jax.device_count(),), ("data",)))
    >>> params, x = tx.shard({"layers": jnp.full((4, 64, 64), 0.01)}), jnp.ones((8, 64))
    >>> def compiled(prefetch):
    ...   def loss_fn(params, x):
    ...     layer = lambda h, w: (jnp.tanh(h @ w), None)
    ...     return jnp.mean(zerojax.scan(layer, x, params["layers"], prefetch=prefetch)[0])
    ...   return jax.jit(zerojax.value_and_grad(loss_fn, tx)).lower(params, x).compile()
    >>> from zerojax.diagnostics import loop_collectives
    >>> [(loop.gathers, loop.waiting_gathers) for loop in loop_collectives(compiled(0))]
    [(1, 1), (1, 1)]
    >>> [(loop.gathers, loop.waiting_gathers) for loop in loop_collectives(compiled(1))]
    [(1, 0), (1, 0)]
  """

  body: str
  gathers: int
  reductions: int
  waiting_gathers: int
  waiting_reductions: int
  asynchronous: int = 0
  overlapped: int = 0


def loop_collectives(hlo: str | jax.stages.Compiled) -> list[LoopCollectives]:
  """Every while loop of a compiled program that holds collectives, with what they wait on.

  Read the optimized program (``compiled.as_text()``): it is what runs, after
  XLA's own loop rewrites. A prefetching ``zerojax.scan`` shows
  ``waiting_gathers == 0`` and ``waiting_reductions == 0`` in each of its
  loops; a plain scan that gathers its layer shows one waiting gather per
  loop.

  Args:
    hlo: an HLO module's text, or a ``jax.stages.Compiled``.

  Returns:
    A ``LoopCollectives`` per while loop (nested ones included) whose body
    holds a collective, in the order the program defines them.

  Example:
    A loop that gathers and multiplies in the same iteration waits on its gather:

    >>> import jax, jax.numpy as jnp, zerojax
    >>> auto = (jax.sharding.AxisType.Auto,)
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=auto)
    >>> def layers(w, h):
    ...   step = lambda h, w: (h @ jax.lax.all_gather(w, "data", axis=1, tiled=True), None)
    ...   return jax.lax.scan(step, h, w)[0]
    >>> specs = dict(in_specs=(jax.P(None, None, "data"), jax.P()), out_specs=jax.P())
    >>> f = jax.jit(jax.shard_map(layers, mesh=mesh, check_vma=False, **specs))
    >>> [(loop.gathers, loop.waiting_gathers) for loop in zerojax.diagnostics.loop_collectives(
    ...   f.lower(jnp.ones((3, 16, 16)), jnp.ones((4, 16))).compile())]
    [(1, 1)]
  """
  computations, _ = hlo_lib.parse_module(hlo_lib.text_of(hlo))

  @functools.cache
  def computes(name: str) -> bool:
    """Whether computation ``name`` (or one it calls) holds a matmul or convolution."""
    return any(_computes(i, computes) for i in computations.get(name, ()))

  loops = []
  for instructions in computations.values():
    for instruction in instructions:
      if instruction.opcode != "while":
        continue
      body = re.search(r"body=%?([\w.\-]+)", instruction.attributes)
      if body is None:
        raise ValueError(f"a while loop without a body in the HLO: {instruction}")
      body = body.group(1)
      found = _analyse(body, computations[body], computes, computations)
      if found.gathers or found.reductions:
        loops.append(found)
  return loops


def _computes(instruction, computes) -> bool:
  if instruction.opcode == "custom-call":  # cuBLAS and cuDNN matmuls and convolutions on GPU
    target = re.search(r'custom_call_target="([^"]*)"', instruction.attributes)
    return bool(target and _LIBRARY_COMPUTE.search(target.group(1)))
  return instruction.opcode in _COMPUTE or any(computes(c) for c in _callees(instruction))


def _callees(instruction) -> list[str]:
  names = []
  for _, callees in hlo_lib.CALLEES.findall(instruction.attributes):
    names += re.findall(r"[\w.\-]+", callees.replace("%", " "))
  return names


def _analyse(body: str, instructions, computes, computations) -> LoopCollectives:
  by_name = {i.name: i for i in instructions}
  users: dict[str, list[str]] = {}
  for i in instructions:
    for operand in i.operands:
      users.setdefault(operand, []).append(i.name)
  operands = lambda name: by_name[name].operands
  consumers = lambda name: users.get(name, ())

  def any_computes(names, step) -> bool:
    """Whether any of ``names``, or what ``step`` leads to from them, computes."""
    seen, todo = set(), list(names)
    while todo:
      name = todo.pop()
      if name in seen or name not in by_name:  # parameters of the body end the walk
        continue
      seen.add(name)
      if _computes(by_name[name], computes):
        return True
      todo.extend(step(name))
    return False

  def finish(start) -> str | None:
    """The instruction that finishes asynchronous collective ``start``, if it is one.

    Followed through the tuples it returns and, on TPU, through the fusions
    that carry it forward alongside compute.
    """
    seen, todo = set(), list(consumers(start.name))
    while todo:
      name = todo.pop()
      if name in seen:
        continue
      seen.add(name)
      if _is_done(by_name[name]):
        return name
      if by_name[name].opcode == "get-tuple-element" or _continues(by_name[name]):
        todo.extend(consumers(name))
    return None

  order = {i.name: position for position, i in enumerate(instructions)}
  kinds = {i.name: _kind(i, computations) for i in instructions}
  gathers = [i for i in instructions if kinds[i.name] in _GATHERS]
  reductions = [i for i in instructions if kinds[i.name] in _REDUCTIONS]
  dones = {i.name: finish(i) for i in gathers + reductions}
  # What a gather's result reaches: the instruction that finishes it, if asynchronous.
  results = {name: done or name for name, done in dones.items()}
  overlapped = sum(
    any(_computes(i, computes) for i in instructions[order[name] + 1 : order[done]])
    for name, done in dones.items()
    if done is not None
  )
  return LoopCollectives(
    body=body,
    gathers=len(gathers),
    reductions=len(reductions),
    waiting_gathers=sum(any_computes(consumers(results[g.name]), consumers) for g in gathers),
    waiting_reductions=sum(any_computes(r.operands, operands) for r in reductions),
    asynchronous=sum(done is not None for done in dones.values()),
    overlapped=overlapped,
  )


def _kind(instruction, computations) -> str | None:
  """The collective ``instruction`` runs or starts (``"all-gather"``, ...), or ``None``.

  XLA:TPU starts an asynchronous collective with a fusion whose computation
  holds it.
  """
  opcode = instruction.opcode.removesuffix("-start")
  if opcode in _COLLECTIVES and not instruction.opcode.endswith("-done"):
    return opcode
  if instruction.opcode == "fusion" and instruction.name.startswith(_TPU_START):
    for callee in _callees(instruction):
      for inner in computations.get(callee, ()):
        if inner.opcode in _COLLECTIVES:
          return inner.opcode
  return None


def _continues(instruction) -> bool:
  """Whether ``instruction`` is an XLA:TPU fusion that carries a collective forward."""
  return instruction.opcode == "fusion" and any(
    callee.startswith("async_collective_fusion") for callee in _callees(instruction)
  )


def _is_done(instruction) -> bool:
  return instruction.opcode.endswith("-done") or (
    instruction.opcode == "fusion" and instruction.name.startswith(_TPU_DONE)
  )
