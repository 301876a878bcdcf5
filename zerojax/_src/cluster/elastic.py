"""Elastic batches: the same global batch on fewer (or more) devices, through micro-batches.

When a host is lost for good and training goes on without it, the device count
changes but the global batch must not: the batch is part of the optimisation
(the learning rate and its schedule were tuned for it). The per-device batch
cannot grow either (it is what fits in a device's memory). Gradient
accumulation makes up the difference: ``per_device x devices x micro-batches``
stays the global batch. DeepSpeed's ``elasticity`` config makes the same
choice; this module does the arithmetic.
"""

from __future__ import annotations


def elastic_microbatches(global_batch: int, devices: int, max_per_device: int) -> int:
  """The fewest micro-batches that reach ``global_batch`` on ``devices`` devices.

  Each device takes at most ``max_per_device`` sequences at a time, and every
  device the same number, so the result ``m`` is the smallest whole number for
  which ``global_batch == per_device * devices * m`` with a whole
  ``per_device <= max_per_device``. Such an ``m`` exists exactly when
  ``devices`` divides ``global_batch`` (at worst with one sequence per device
  per micro-batch). Pass ``m`` as ``microbatches`` to
  ``zerojax.value_and_grad``.

  Args:
    global_batch: the sequences (examples) of one optimizer step.
    devices: the devices the batch is split over (the data axis, times the
      replica axis under hybrid sharding).
    max_per_device: the most sequences a device can take in one micro-batch.

  Returns:
    The number of micro-batches per step.

  Raises:
    ValueError: if a number is below 1, or ``devices`` does not divide
      ``global_batch``; the message lists the device counts that do.

  Example:
    >>> from zerojax.distributed import elastic_microbatches
    >>> elastic_microbatches(32, devices=8, max_per_device=4)
    1
    >>> elastic_microbatches(32, devices=4, max_per_device=4)  # a host of 4 lost
    2
    >>> elastic_microbatches(32, devices=16, max_per_device=4)  # 2 per device
    1
  """
  _check_positive(global_batch=global_batch, devices=devices, max_per_device=max_per_device)
  if global_batch % devices:
    raise ValueError(
      f"a global batch of {global_batch} cannot be split evenly over {devices} devices with any "
      f"number of micro-batches: every device must take the same whole number of sequences. "
      f"The device counts that reach it: {', '.join(map(str, _divisors(global_batch)))}. Use "
      f"one of them, or choose a global batch that {devices} divides."
    )
  per_device = global_batch // devices
  return next(m for m in _divisors(per_device) if per_device // m <= max_per_device)


def elastic_device_counts(
  global_batch: int, max_per_device: int, *, max_devices: int | None = None
) -> dict[int, int]:
  """Every device count that reaches ``global_batch``, with its number of micro-batches.

  The table DeepSpeed's elasticity computes (its ``valid_gpus``), for a global
  batch chosen up front: the device counts training can go on with, and the
  micro-batches ``elastic_microbatches`` picks for each.

  Args:
    global_batch: the sequences of one optimizer step.
    max_per_device: the most sequences a device can take in one micro-batch.
    max_devices: leave out larger device counts (default: ``global_batch``,
      one sequence per device).

  Returns:
    ``{devices: micro-batches}``, by increasing device count.

  Raises:
    ValueError: if a number is below 1.

  Example:
    >>> import zerojax
    >>> zerojax.distributed.elastic_device_counts(32, max_per_device=4, max_devices=16)
    {1: 8, 2: 4, 4: 2, 8: 1, 16: 1}
  """
  _check_positive(global_batch=global_batch, max_per_device=max_per_device)
  if max_devices is not None:
    _check_positive(max_devices=max_devices)
  return {
    devices: elastic_microbatches(global_batch, devices, max_per_device)
    for devices in _divisors(global_batch)
    if max_devices is None or devices <= max_devices
  }


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def _check_positive(**numbers: int) -> None:
  for name, value in numbers.items():
    if value < 1:
      raise ValueError(f"{name} must be a whole number of at least 1, got {value}.")
