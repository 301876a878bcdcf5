"""The pipeline slots a compiled step runs, counted in its program."""

from __future__ import annotations

import re

import jax

from zerojax._src.diagnostics import hlo as hlo_lib
from zerojax._src.pipeline.stage import BACKWARD_SLOT, FORWARD_SLOT

_BODY = re.compile(r"body=%?([\w.\-]+)")


def pipeline_slots(hlo: str | jax.stages.Compiled) -> tuple[int, int]:
  """Forward and backward slots a pipeline stage runs per step, counted in the compiled program.

  ``zerojax.pipeline`` runs its schedule tick by tick, and in every tick each
  stage runs a slot, forward or backward, whether it holds a micro-batch then
  or idles in the bubble. Counting the slots the compiled step runs shows the
  bubble the program really has: with ``M`` micro-batches of ``chunks`` chunks
  a stage (virtual stages), ``F`` forward and ``B`` backward slots, and a
  backward slot costing about two forward ones, the bubble is
  ``1 - 3 * M * chunks / (F + 2 * B)``, to compare with the
  ``bubble()`` of ``zerojax.pipeline_timetable``.

  Two counts, each of which can only miss slots, and the larger is taken per
  kind. By layer loops: a slot runs its stage's layers once, in a layer loop
  (``zerojax.scan``) named after the slot, counted as often as the tick loops
  around it run it; it misses a layer loop that XLA unrolls (XLA:GPU, two
  layers to a chunk). By tick loops: each iteration of a loop whose body runs
  a slot's operations runs one slot of that kind; it misses a tick loop of one
  iteration, which XLA inlines.

  Args:
    hlo: the compiled step (a ``jax.stages.Compiled``, or its ``as_text()``).

  Returns:
    ``(forward, backward)``: the slots of each kind a stage runs per step.

  Raises:
    TypeError: for a function or a lowered program, which is not compiled yet.

  Example:
    Two stages of 3 layers, 4 micro-batches, GPipe: 5 ticks forward and 5
    backward, a bubble of ``1 - 3 * 4 / 15 = 0.2``, as the timetable says:

    >>> import jax, jax.numpy as jnp, zerojax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((2, 4), ("stage", "data"))
    >>> w = jax.device_put(jnp.full((2, 3, 16, 16), 0.1), NamedSharding(mesh, P("stage")))
    >>> def stage_fn(w, h):  # one stage: its 3 layers
    ...   return zerojax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, w)[0]
    >>> def loss(w, x):
    ...   y = zerojax.pipeline(stage_fn, w, x, microbatches=4, schedule="gpipe")
    ...   return jnp.mean(y**2)
    >>> with jax.set_mesh(mesh):
    ...   compiled = jax.jit(jax.grad(loss)).lower(w, jnp.ones((8, 16))).compile()
    >>> from zerojax.diagnostics import pipeline_slots
    >>> pipeline_slots(compiled)
    (5, 5)
    >>> round(zerojax.pipeline_timetable("gpipe", stages=2, microbatches=4).bubble(), 6)
    0.2
  """
  computations, entry = hlo_lib.parse_module(hlo_lib.text_of(hlo))
  counts = hlo_lib.executions(computations, entry)
  slot_names = f"{FORWARD_SLOT}|{BACKWARD_SLOT}"

  def body_of(loop: hlo_lib._Instruction) -> str:
    found = _BODY.search(loop.attributes)
    assert found is not None, "a while loop always names its body"
    return found.group(1)

  whiles = [
    (name, loop)
    for name, instructions in computations.items()
    for loop in instructions
    if loop.opcode == "while"
  ]

  layer_loops = [(name, loop) for name, loop in whiles if re.search(slot_names, loop.attributes)]
  inner = {body_of(loop) for _, loop in layer_loops}
  by_layers = [0, 0]
  for name, loop in layer_loops:
    if name not in inner:
      by_layers[0 if FORWARD_SLOT in loop.attributes else 1] += counts.get(name, 0)

  def reached(name: str, seen: set[str]) -> set[str]:
    """``name`` and the computations it calls, transitively."""
    if name not in seen:
      seen.add(name)
      for instruction in computations.get(name, ()):
        for _, callees in hlo_lib.CALLEES.findall(instruction.attributes):
          for callee in re.findall(r"[\w.\-]+", callees.replace("%", " ")):
            reached(callee, seen)
    return seen

  by_ticks = [0, 0]
  for _, loop in whiles:
    if re.search(slot_names, loop.attributes):
      continue
    inside = reached(body_of(loop), set())
    for k, slot in enumerate((FORWARD_SLOT, BACKWARD_SLOT)):
      if any(slot in i.attributes for name in inside for i in computations.get(name, ())):
        by_ticks[k] += counts.get(body_of(loop), 0)
  return max(by_layers[0], by_ticks[0]), max(by_layers[1], by_ticks[1])
