"""The restore verdicts and the process vote alone, with fake processes (through the manager:
tests/test_checkpoint.py)."""

import numpy as np
import pytest

from zerojax._src.checkpoint import verdict as verdict_lib
from zerojax._src.checkpoint.verdict import Verdict

R, D, M = Verdict.READ, Verdict.DAMAGED, Verdict.MISFIT  # short, for the table below


@pytest.mark.parametrize(
  ("verdicts", "process", "agreed", "message"),
  [
    ([R, R, R, R], 0, R, None),
    ([R, D, R, D], 0, D, "step 3 could not be read on process(es) [1, 3]; their errors say why."),
    ([R, D, R, D], 1, D, "own"),
    ([D, M, R, M], 0, M, "step 3 does not fit this manager's spec on process(es) [1, 3];"),
    ([D, M, R, M], 2, M, "step 3 does not fit this manager's spec on process(es) [1, 3];"),
    ([M, D], 0, M, "own"),
  ],
)
def test_the_vote_takes_the_worst_verdict_and_names_who_reached_it(
  monkeypatch, verdicts, process, agreed, message
):
  own_error = None if verdicts[process] == R else ValueError("own")
  monkeypatch.setattr(verdict_lib, "on_every_process", lambda value: np.array(verdicts))
  verdict, error = verdict_lib.vote(verdicts[process], own_error, "step 3")
  assert verdict is agreed
  if message is None:
    assert error is None
  else:
    assert str(error).startswith(message)
    assert (error is own_error) == (message == "own")


def test_the_walk_back_skips_damaged_checkpoints_and_stops_at_a_misfit():
  tried = []

  def read(step):
    tried.append(step)
    if step == 40:
      raise ValueError("misfit")
    return ("state", None) if step <= 20 else (None, ValueError(f"damaged {step}"))

  state, step, damaged = verdict_lib.latest_readable([10, 20, 30, 35], read, "ckpt")
  assert (state, step, tried) == ("state", 20, [35, 30, 20])
  assert [(s, str(error)) for s, error in damaged] == [(35, "damaged 35"), (30, "damaged 30")]
  with pytest.raises(ValueError, match=r"damaged 35 None of the earlier checkpoints \[30\] could"):
    verdict_lib.latest_readable([30, 35], read, "ckpt")
  with pytest.raises(ValueError, match=r"^damaged 30$"):
    verdict_lib.latest_readable([30], read, "ckpt")
  tried.clear()
  with pytest.raises(ValueError, match="misfit"):
    verdict_lib.latest_readable([10, 40], read, "ckpt")
  assert tried == [40]  # an earlier checkpoint of the same run would not fit either
  with pytest.raises(FileNotFoundError, match="no checkpoints in ckpt"):
    verdict_lib.latest_readable([], read, "ckpt")
