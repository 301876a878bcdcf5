"""The examples run in their tiny configurations, and learn."""

import json

import pytest

from examples import digits_nnx, train_lm


@pytest.mark.parametrize("stage", [3])
def test_train_lm_tiny_learns(stage, tmp_path):
  metrics = train_lm.main(
    ["--model", "tiny", "--steps", "20", "--stage", str(stage), "--out", str(tmp_path)]
  )
  losses = metrics["train_loss"]
  assert losses[-1] < 0.8 * losses[0]
  assert json.loads((tmp_path / "metrics.json").read_text())["config"]["stage"] == stage
  assert (tmp_path / "loss.png").stat().st_size > 0


def test_digits_nnx_classifies():
  assert digits_nnx.main(["--steps", "100"])["test_accuracy"] > 0.9
