"""The layout record alone: what fits is a function of two records (through the manager:
tests/test_checkpoint.py)."""

import json

import jax
import jax.numpy as jnp
import pytest

import zerojax
from tests.helpers import AXIS_TYPES, CHECKPOINT_MODEL, checkpoint_spec, checkpoint_tx
from zerojax._src.checkpoint import record as record_lib

SETTINGS = [(8, 3), (4, 1), (2, 2), (1, 3)]


def saved_record(setting) -> record_lib.Record:
  """The layout record a checkpoint of ``checkpoint_tx(*setting)`` holds, as read back from JSON."""
  spec = checkpoint_spec(checkpoint_tx(*setting))
  return json.loads(json.dumps(record_lib.layout_record(spec.logical, spec.master_path)))


@pytest.mark.parametrize("precision", [None, "bf16", "fp16"])
def test_records_fit_across_device_counts_stages_and_axis_types(precision):
  settings = [(*s, precision, axis) for s in SETTINGS for axis in AXIS_TYPES]
  records = [saved_record(setting) for setting in settings]
  for spec in records:
    for saved in records:
      assert record_lib.misfits(spec, saved) == []


def test_records_of_another_policy_or_model_list_each_difference():
  fp16, bf16 = saved_record((8, 2, "fp16")), saved_record((8, 2, "bf16"))
  assert record_lib.misfits(bf16, fp16) == [
    f"['opt_state'].loss_scale.{name}: in the checkpoint, not in the spec"
    for name in sorted(zerojax.LossScaleState._fields)
  ]
  # A bf16 run's master copy is float32, as a float32 run's params are: it fits either way.
  assert record_lib.misfits(saved_record((8, 3)), bf16) == []
  assert record_lib.misfits(bf16, saved_record((4, 1))) == []
  bigger = checkpoint_spec(
    checkpoint_tx(8, 3), {**CHECKPOINT_MODEL, "w": jax.ShapeDtypeStruct((5, 1002), jnp.float32)}
  )
  assert record_lib.misfits(
    record_lib.layout_record(bigger.logical, bigger.master_path), saved_record((8, 3))
  ) == [
    f"{path}: shape (5, 1001) in the checkpoint, (5, 1002) in the spec"
    for path in [
      "['opt_state'].inner_state[0].mu['w']",
      "['opt_state'].inner_state[0].nu['w']",
      "['params']['w']",
    ]
  ]


def test_a_long_list_of_differences_is_cut_at_twenty():
  lines = [f"leaf{i}: in the spec, not in the state" for i in range(25)]
  message = str(record_lib.listed_error("the state does not match", lines, "Fix it."))
  assert message.splitlines() == [
    "the state does not match:",
    *(f"  {line}" for line in lines[:20]),
    "  ... and 5 more",
    "Fix it.",
  ]
