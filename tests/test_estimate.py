"""The memory estimator, its command line, and the step profiler."""

import jax
import jax.numpy as jnp
import optax
import pytest

import zerojax
from tests import models
from zerojax import estimate as estimate_cli

# The ZeRO paper's Table I: GB per device for Ψ = 7.5B, mixed-precision Adam.
TABLE_I = {
  1: (120, 120, 120),
  4: (52.5, 41.3, 30),
  16: (35.6, 21.6, 7.5),
  64: (31.4, 16.6, 1.88),
  256: (30.4, 15.4, 0.47),
  1024: (30.1, 15.1, 0.12),
}


@pytest.mark.parametrize("devices", sorted(TABLE_I))
def test_reproduces_zero_paper_table(devices):
  for stage, expected in zip((1, 2, 3), TABLE_I[devices], strict=True):
    total = zerojax.estimate_memory(7.5e9, num_devices=devices, stage=stage).total / 1e9
    assert round(total, 2) == pytest.approx(expected, abs=0.06)
  assert zerojax.estimate_memory(7.5e9, num_devices=devices, stage=0).total == 120e9


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_tree_estimate_is_what_zerojax_places(stage, mesh):
  params = models.make_params()
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  tx = getattr(zerojax, f"zero{stage}")(inner, mesh=mesh, min_shard_size=1)
  placed = tx.shard(params)
  state = tx.init(placed)
  per_device = lambda tree: sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))
  estimate = zerojax.estimate_tree_memory(
    params, inner, num_devices=8, stage=stage, min_shard_size=1
  )
  assert estimate.params == per_device(placed)
  assert estimate.optimizer_state == per_device(state)


def test_tree_estimate_counts_state_by_eval_shape():
  params = {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)}
  adam = zerojax.estimate_tree_memory(params, optax.adam(1e-3), num_devices=1, stage=0)
  adafactor = zerojax.estimate_tree_memory(params, optax.adafactor(1e-3), num_devices=1, stage=0)
  assert adam.optimizer_state == pytest.approx(8 * 4096 * 4096, abs=16)
  assert adafactor.optimizer_state < adam.optimizer_state / 1000


def test_bad_arguments_raise():
  with pytest.raises(ValueError, match="stage must be one of"):
    zerojax.estimate_memory(1e9, num_devices=8, stage=4)
  with pytest.raises(ValueError, match="num_devices must be at least 1"):
    zerojax.estimate_memory(1e9, num_devices=0, stage=1)


def test_command_line(capsys):
  text = estimate_cli.main(["--params", "7.5e9", "--devices", "64"])
  assert "31.41" in text and "16.64" in text and "1.88" in text and "120.00" in text
  assert text in capsys.readouterr().out
  assert "optax.lion" in estimate_cli.main(["--params", "1e9", "--optimizer", "lion"])


def test_profile_of_a_zero3_step(mesh):
  tx = zerojax.zero3(optax.adam(1e-3), mesh=mesh, min_shard_size=1)
  params = tx.shard(models.make_params())
  state = tx.init(params)
  report = zerojax.profile(models.explicit_step(tx), params, state, *models.make_batch())
  assert report.collectives["all-gather"].count > 0
  assert report.collectives["reduce-scatter"].count > 0
  assert report.peak_bytes >= report.temp_bytes > 0
  assert "reduce-scatter" in str(report) and "peak" in str(report)
