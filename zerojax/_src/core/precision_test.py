"""The loss scale's own rule (adjust_loss_scale), step by step against DeepSpeed's.

Through the optimizer: tests/test_precision.py and tests/test_nonfinite.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from zerojax._src.core import precision


class DeepSpeedLossScaler:
  """DeepSpeed's ``DynamicLossScaler.update_scale`` (consecutive_hysteresis=False), transcribed."""

  def __init__(self, scale, window, hysteresis, minimum):
    self.cur_scale, self.scale_window, self.min_scale = scale, window, minimum
    self.delayed_shift = self.cur_hysteresis = hysteresis
    self.cur_iter, self.last_overflow_iter = 0, -1

  def update_scale(self, overflow):
    if overflow:
      if self.delayed_shift == 1 or self.cur_hysteresis == 1:
        self.cur_scale = max(self.cur_scale / 2, self.min_scale)
      else:
        self.cur_hysteresis -= 1
      self.last_overflow_iter = self.cur_iter
    elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
      self.cur_hysteresis = self.delayed_shift
      self.cur_scale *= 2
    self.cur_iter += 1


def test_dynamic_loss_scale_follows_deepspeed():
  config = precision.DynamicLossScale(initial=2.0**4, growth_interval=3, hysteresis=2, minimum=2.0)
  policy = precision.Precision(loss_scale=config)
  ours = precision.LossScaleState(*(jnp.asarray(x) for x in (2.0**4, 0, 2)))
  theirs = DeepSpeedLossScaler(2.0**4, 3, 2, 2.0)
  overflows = np.random.default_rng(0).random(300) < 0.3
  adjust = jax.jit(functools.partial(precision.adjust_loss_scale, policy))
  for overflow in overflows:
    ours = adjust(ours, jnp.asarray(not overflow))
    theirs.update_scale(overflow)
    assert float(ours.scale) == theirs.cur_scale
