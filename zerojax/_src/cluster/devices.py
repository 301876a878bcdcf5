"""Fake several devices on one CPU, so that sharding over a mesh is real without accelerators."""

from __future__ import annotations

import operator

import jax

from zerojax_launch import placement


def use_cpu_devices(count: int) -> None:
  """Gives JAX's CPU backend ``count`` devices (call it before anything touches a device).

  On a machine without accelerators, JAX has one CPU device; with ``count`` of
  them, ``jax.make_mesh((count,), ("data",))`` and every zerojax collective run
  for real, one device per thread. JAX reads the number when its backend
  starts, on the first use of a device (``jax.devices()``, an array, a jitted
  call), not on ``import jax``; so call this first, after the imports. It sets
  ``jax.config.update("jax_num_cpu_devices", count)``, which takes precedence
  over ``XLA_FLAGS=--xla_force_host_platform_device_count``. Only the CPU
  platform is affected: on GPUs or TPUs the mesh still spans the accelerators.
  On a host without any (no ``/dev/nvidia<N>``, ``/dev/accel<N>`` or
  ``/dev/vfio/<N>``), and with no platform chosen (``JAX_PLATFORMS``), it also
  sets ``jax_platforms`` to ``"cpu"``, so that accelerator plugins installed
  there (``jax[cuda12]``, libtpu) are not started only to fail.

  Once the backend has started, the count cannot change any more: calling this
  again with the count it has does nothing, and with another count raises.

  Args:
    count: the number of CPU devices, at least 1.

  Raises:
    TypeError: if ``count`` is not a whole number (an ``int``).
    ValueError: if ``count`` is below 1, or JAX's CPU backend already started
      with another number of devices.

  Example:
    At the top of a script, on a CPU-only machine:

    >>> import jax, zerojax
    >>> zerojax.distributed.use_cpu_devices(8)
    >>> jax.device_count()
    8

    Too late to change the number:

    >>> zerojax.distributed.use_cpu_devices(4)
    Traceback (most recent call last):
    ...
    ValueError: JAX's CPU backend already started with 8 devices, so it cannot have 4 ...
  """
  try:
    count = operator.index(count)
  except TypeError:
    raise TypeError(
      f"use_cpu_devices takes a whole number of devices, got {count!r} (a "
      f"{type(count).__name__}): pass an int, e.g. zerojax.distributed.use_cpu_devices(8)."
    ) from None
  if count < 1:
    raise ValueError(f"use_cpu_devices needs at least 1 device, got {count}.")
  try:
    # Accepted before the backend starts, and afterwards if it is the value already set.
    jax.config.update("jax_num_cpu_devices", count)
    chosen = jax.config.jax_platforms  # pyright: ignore[reportAttributeAccessIssue] (a flag)
    if not chosen and placement.local_accelerators()[0] == "cpu":
      jax.config.update("jax_platforms", "cpu")
  except RuntimeError:
    started_with = len(jax.local_devices(backend="cpu"))
    if started_with != count:
      raise ValueError(
        f"JAX's CPU backend already started with {started_with} devices, so it cannot have "
        f"{count} now: call zerojax.distributed.use_cpu_devices({count}) before anything "
        "touches a device (jax.devices(), creating an array, a jitted call), or run in a fresh "
        "process."
      ) from None
