"""Collectives and loops stay in step on XLA:CPU (ordering.py, beside this file).

XLA:CPU may start a collective while a loop that holds collectives is still
running, and every ``shard_map`` collective shares one rendezvous key, so the
devices can meet in the wrong collective and the process aborts. zerojax
links each such pair with a data dependency. These tests check the links in
the compiled program (deterministic), that they change no value, and that the
parameter-heavy model which aborted trains for many steps in its own process.

Run as a script, this module is that model's worker (tests/collective_order_worker.py) with
the links switched off, to count the aborts without them (docs/troubleshooting.md):

  python -m zerojax._src.comm.ordering_test --stage 2 --steps 30
"""

import functools
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax
from tests import collective_order_worker as worker
from tests import environment
from zerojax._src.comm import ordering
from zerojax._src.diagnostics import hlo

WORKER = worker.__file__


@pytest.fixture
def mesh():
  return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def compiled_step(stage: int, mesh) -> str:
  """The optimised HLO of one training step of the worker's model."""
  tx = getattr(zerojax, f"zero{stage}")(optax.adam(1e-3), mesh=mesh)
  params = tx.shard(jax.tree.map(np.asarray, worker.make_params()))
  state = tx.init(params)
  grad_fn = zerojax.value_and_grad(worker.loss_fn, tx)

  def step(params, state, x):
    loss, grads = grad_fn(params, x)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  x = jax.device_put(np.ones((64, 512), np.float32), NamedSharding(mesh, P("data")))
  text = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, x).compile().as_text()
  assert text is not None
  return text


def unlinked(text: str) -> list[tuple[str, str]]:
  """Pairs (loop, collective) of the entry computation with no data path between them.

  Only ``shard_map`` collectives count (they share ``channel_id=1``, hence one
  rendezvous key); loops count if their body holds one. GSPMD's collectives
  have channel ids of their own and cannot meet in the wrong rendezvous.
  """
  computations, entry = hlo.parse_module(text)

  @functools.cache
  def holds(name: str) -> bool:
    return any(
      _is_shard_map_collective(i) or any(holds(c) for c in _callees(i))
      for i in computations.get(name, ())
    )

  instructions = {i.name: i for i in computations[entry]}

  @functools.cache
  def ancestors(name: str) -> frozenset[str]:
    operands = [o for o in instructions[name].operands if o in instructions]
    return frozenset(operands).union(*(ancestors(o) for o in operands))

  loops = [
    i.name for i in instructions.values() if i.opcode == "while" and any(map(holds, _callees(i)))
  ]
  talkers = loops + [n for n, i in instructions.items() if _is_shard_map_collective(i)]
  return [
    (loop, other)
    for loop in loops
    for other in talkers
    if other != loop and loop not in ancestors(other) and other not in ancestors(loop)
  ]


def _is_shard_map_collective(instruction) -> bool:
  kind = instruction.opcode.removesuffix("-start")
  return kind in hlo.KINDS and "channel_id=1," in instruction.attributes


def _callees(instruction) -> list[str]:
  return [
    callee
    for _, names in hlo.CALLEES.findall(instruction.attributes)
    for callee in re.findall(r"[\w.\-]+", names.replace("%", " "))
  ]


@pytest.mark.parametrize("stage", [2, 3])
def test_every_loop_is_linked_to_every_collective(stage, mesh):
  assert unlinked(compiled_step(stage, mesh)) == []


def test_without_ordering_a_collective_can_race_a_loop(mesh, monkeypatch):
  # The check above can fail: this is the program that aborted.
  monkeypatch.setattr(ordering, "links_needed", lambda mesh: False)
  assert unlinked(compiled_step(2, mesh))


def test_links_change_no_value(mesh):
  def per_device(ws, x):
    def body(h, w):
      h = jnp.tanh(h @ w)
      return h, jax.lax.psum_scatter(w * h.sum(), "data", scatter_dimension=0, tiled=True)

    h, stacked = jax.lax.scan(body, x, ws)
    after = jax.lax.psum_scatter(x.T @ x, "data", scatter_dimension=0, tiled=True)
    return h, stacked, after, jax.lax.psum(jnp.sum(h), "data")

  out_specs = (P("data"), P(None, "data"), P("data"), P())
  specs = functools.partial(
    jax.shard_map, mesh=mesh, in_specs=(P(), P("data")), out_specs=out_specs
  )
  plain = jax.jit(specs(per_device))
  linked = jax.jit(specs(ordering.link_loops(per_device)))
  ws = jnp.stack([jnp.eye(16) * 0.5, -jnp.eye(16), jnp.zeros((16, 16))])
  x = jnp.full((16, 16), -0.0).at[0, 0].set(jnp.nan).at[1, 1].set(jnp.inf)
  for a, b in zip(plain(ws, x), linked(ws, x), strict=True):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


def test_parameter_heavy_model_trains_without_aborting():
  # Without the ordering (this module run as a script), runs of this worker side by side on
  # CI's 2 cores aborted: 5 of 8 within 15 steps, 12 of 12 within 30 (2026-11-26); alone on a
  # quiet machine, 8 of 8 within 15 (most at the first step). So two runs side by side, each
  # loading the machine for the other, of 30 steps. XLA's termination timeout turns a hang into
  # a failure.
  env = environment.subprocess_env(XLA_FLAGS=environment.STUCK_COLLECTIVES_ABORT)
  command = [sys.executable, WORKER, "--stage", "2", "--steps", "30"]
  runs = [
    subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(2)
  ]
  try:
    outputs = [run.communicate(timeout=300) for run in runs]
  finally:
    for run in runs:
      run.kill()  # a no-op once it has exited
  for run, (out, err) in zip(runs, outputs, strict=True):
    assert run.returncode == 0, err[-3000:]
    assert out.startswith("ok ")


def main() -> None:
  """The worker, with the links switched off (its flags: ``--stage``, ``--steps``, ...)."""
  ordering.links_needed = lambda mesh: False
  worker.main()


if __name__ == "__main__":
  main()
