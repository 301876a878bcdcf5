"""``zerojax.plan`` on a tiny model: a deviceless H100 node and a TPU v5e-8, and this machine.

The planner compiles in worker processes (one per target platform), so these
tests exercise the whole path a user's plan takes: the program imported by
reference, candidates compiled deviceless, the compiler's verdict and its
memory read, pruning, the cache, the table and the winner as code.
"""

import dataclasses
import json

import pytest

import zerojax
from tests import plan_program
from zerojax import planning
from zerojax._src.plan import compile as compile_lib
from zerojax.planning import Setup, Space

#: The smallest space that still has a choice on each axis the tiny model can take on one node.
SPACE = Space(stages=(2, 3), remat=("full",), batches=(1, 4), pipeline=(1, 2))
#: A device's memory in the pruning test: the tiny model's step fits at batch 1 (0.6 MiB, 0.8
#: keeping every value), not at 64 (8.2 MiB keeping only each layer's input).
LIMIT = 3 * 2**20


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
  cache = tmp_path_factory.mktemp("plan-cache")
  return {
    target: zerojax.plan(plan_program.TINY, target, space=SPACE, workers=2, cache=cache)
    for target in ("h100x8", "v5e-8")
  }, cache


@pytest.mark.parametrize("target", ["h100x8", "v5e-8"])
def test_the_plan_compiles_every_candidate_and_picks_the_fastest_that_fits(plans, target):
  found = plans[0][target]
  expected = SPACE.setups(layers=4, devices=8, nodes=1, names=True)
  assert {o.setup for o in found.outcomes} == set(expected)
  assert all(o.fits and o.error is None for o in found.outcomes)
  speeds = [o.tokens_per_second for o in found.outcomes]
  assert all(speed > 0 for speed in speeds)
  assert found.best.tokens_per_second == max(speeds)
  assert found.best.estimate.startswith("roofline" if target == "v5e-8" else "XLA:GPU")
  # Memory is the compiler's, per device: a pipeline of two stages holds half the layers.
  flat = found.outcome(Setup(stage=3, batch=1))
  assert 0 < flat.memory["arguments"] < 2 * plan_program.TINY.parameters * 16 / 8


def test_a_second_plan_comes_from_the_cache(plans):
  _, cache = plans
  again = zerojax.plan(plan_program.TINY, "v5e-8", space=SPACE, workers=1, cache=cache)
  assert again.cached == len(again.outcomes) > 0
  assert again.best == plans[0]["v5e-8"].best


def test_the_winner_prints_as_code_that_builds_it(plans):
  found = plans[0]["h100x8"]
  text = planning.code(found)
  best = found.best.setup
  assert f"tx = zerojax.zero{best.stage}(optimizer, mesh=mesh" in text
  assert "jax.make_mesh(" in text
  assert ("zerojax.pipeline(" in text) == (best.pipeline > 1)
  table = planning.table(found)
  assert best.describe() in table.splitlines()[2]  # the first row is the winner


def test_a_setup_that_does_not_fit_prunes_those_that_hold_more(monkeypatch, tmp_path):
  """Compiled here (``"local"``) for a device of ``LIMIT`` bytes: the plan stops compiling a
  setup at its first batch that does not fit, and never compiles what keeps more than a setup
  that did not fit; what it skips would not have fit, so it picks what the whole space picks."""
  monkeypatch.setattr(compile_lib, "device_bytes", lambda target: LIMIT)
  space = Space(stages=(3,), remat=("full", "none"), batches=(1, 64))
  pruned = zerojax.plan(plan_program.TINY, "local", space=space, cache=tmp_path)
  everything = zerojax.plan(plan_program.TINY, "local", space=space, cache=tmp_path, prune=False)
  compiled = {o.setup for o in pruned.outcomes}
  assert compiled | set(pruned.pruned) == {o.setup for o in everything.outcomes}
  assert pruned.pruned, "something did not fit, so something was pruned"
  assert not any(everything.outcome(setup).fits for setup in pruned.pruned)
  assert [o.setup for o in pruned.fitting] == [o.setup for o in everything.fitting]


def test_setup_rejects_what_zerojax_cannot_build():
  with pytest.raises(ValueError, match="remat must be one of"):
    Setup(remat="some")
  with pytest.raises(ValueError, match="microbatches must divide batch"):
    Setup(pipeline=2, microbatches=3, batch=4)


def test_a_program_the_workers_cannot_import_is_refused_with_how_to_fix_it():
  local = dataclasses.replace(plan_program.TINY, name="made here")
  with pytest.raises(ValueError, match="top level"):
    zerojax.plan(local, "v5e-8", space=SPACE, cache=None)
  with pytest.raises(ValueError, match="no file"):
    zerojax.plan("no/such/file.py:program", "v5e-8", cache=None)
  with pytest.raises(ValueError, match="unknown target"):
    zerojax.plan(plan_program.TINY, "v5e-9", cache=None)


def test_the_command_line_prints_the_table_and_the_code(plans, capsys, tmp_path):
  _, cache = plans
  out = tmp_path / "outcomes.json"
  planning.main(
    [
      "tests.plan_program:TINY",
      "--target",
      "v5e-8",
      "--stages",
      "2,3",
      "--remat",
      "full",
      "--batches",
      "1,4",
      "--pipeline",
      "1,2",
      "--cache",
      str(cache),
      "--json",
      str(out),
    ]
  )
  printed = capsys.readouterr().out
  assert "the plan's pick" in printed and "| setup | fits |" in printed
  assert len(json.loads(out.read_text())) == len(SPACE.setups(layers=4, devices=8, nodes=1))


def test_measuring_times_the_candidates_on_this_machine(tmp_path):
  space = Space(stages=(2, 3), remat=("full",), batches=(2,))
  found = zerojax.plan(plan_program.TINY, "local", space=space, cache=tmp_path, measure=2)
  assert [o.estimate for o in found.outcomes] == ["measured", "measured"]
  assert found.best.step_seconds == min(o.step_seconds for o in found.outcomes) > 0
  with pytest.raises(ValueError, match="compiled for, not here"):
    zerojax.plan(plan_program.TINY, "v5e-8", space=space, measure=1)


@pytest.mark.parametrize("target, per_node", [("h100x16", 8), ("2xv5e-16", 16)])
def test_bytes_across_nodes_are_counted_on_a_machine_of_two_nodes(tmp_path, target, per_node):
  """On two nodes of 8 H100 (or two TPU slices, whose transfers between them are sends over
  the data-center network) every mesh has a node axis: stage 3 over every device sends bytes
  across nodes, hybrid sharding (states sharded within a node) sends fewer."""
  space = Space(
    stages=(3,),
    sharding=("full", "hybrid"),
    quantized_weights=(False,),
    quantized_gradients=(False,),
    remat=("full",),
    batches=(1,),
  )
  found = zerojax.plan(plan_program.TINY, target, space=space, cache=tmp_path, workers=1)
  full = found.outcome(Setup(batch=1))
  hybrid = found.outcome(Setup(sharding="hybrid", batch=1))
  assert 0 < hybrid.across_bytes < full.across_bytes
  assert hybrid.within_bytes > 0  # its gathers stay inside a node
  assert f"jax.make_mesh((2, {per_node}), ('node', 'data'))" in planning.code(found, full.setup)
