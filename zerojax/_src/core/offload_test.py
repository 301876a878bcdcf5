"""Offloading on a platform without pinned host memory, faked (the rest: tests/test_offload.py)."""

import jax
import optax
import pytest

import zerojax
from zerojax._src.core import offload


def test_a_platform_without_host_memory_is_refused_with_its_memory_kinds(monkeypatch):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  # An error naming the platform and the kinds it has.
  monkeypatch.setattr(offload, "memory_kinds", lambda device: ["device"])
  platform = r"the cpu device 'cpu' does not have \(its memory kinds: \['device'\]\)"
  with pytest.raises(ValueError, match=platform):
    zerojax.zero1(optax.adam(1e-3), mesh=mesh, offload="optimizer")
  zerojax.zero1(optax.adam(1e-3), mesh=mesh)  # without offload, nothing is asked of it
