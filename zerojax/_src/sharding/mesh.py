"""Meshes: finding the one to use, checking it, and computing in its global view."""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Callable
from typing import Any

import jax
from jax.core import Tracer
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._src.sharding import layout as layout_lib

#: The mesh axis ``zerojax.pipeline`` runs its stages over unless told otherwise.
PIPELINE_AXIS = "stage"


def resolve_mesh(
  mesh: Mesh | None,
  axis_name: str | tuple[str, ...],
  replica_axis: str | tuple[str, ...] | None = None,
) -> Mesh:
  """Returns ``mesh``, or the one set with ``jax.set_mesh``, checked for the axes.

  Raises:
    ValueError: if there is no mesh, it lacks one of the axes, or an axis is
      both a data and a replica axis.
  """
  if mesh is None:
    mesh = jax.sharding.get_mesh()
    if mesh is None or mesh.empty:
      raise ValueError(
        "no mesh: pass mesh=jax.make_mesh((jax.device_count(),), ('data',)) "
        "or call jax.set_mesh(mesh) before creating the transformation."
      )
  if not isinstance(mesh, Mesh):
    raise ValueError(
      f"mesh must be a jax.sharding.Mesh with devices, got {type(mesh).__name__}; "
      "build one with jax.make_mesh."
    )
  data_axes = layout_lib.axes(axis_name)
  replica_axes = layout_lib.axes(replica_axis or ())
  if not data_axes:
    raise ValueError("axis_name names no mesh axis: pass axis_name='data' or a tuple of axes.")
  for name, argument in [
    *((n, "axis_name") for n in data_axes),
    *((n, "replica_axis") for n in replica_axes),
  ]:
    if name not in mesh.axis_names:
      close = difflib.get_close_matches(name, mesh.axis_names, n=1)
      fix = (
        f"did you mean {argument}={close[0]!r}?"
        if close
        else f"pass {argument}=... naming one of them, or build the mesh with "
        f"jax.make_mesh((n,), ({name!r},))."
      )
      raise ValueError(f"mesh has no axis {name!r} (its axes are {mesh.axis_names}); {fix}")
  others = [name for name in mesh.axis_names if name not in data_axes]
  if PIPELINE_AXIS in data_axes and len(mesh.axis_names) > 1:
    raise ValueError(
      f"axis_name={axis_name!r} names {PIPELINE_AXIS!r}, the mesh axis zerojax.pipeline runs its "
      "stages over (its default axis_name): each stage holds its own layers, which ZeRO must "
      "not split across the stages. ZeRO splits over the data axes, the others: pass "
      f"axis_name={(others or [name for name in mesh.axis_names if name != PIPELINE_AXIS])[0]!r}."
    )
  shared = sorted(set(data_axes) & set(replica_axes))
  if shared or len(set(data_axes)) < len(data_axes):
    raise ValueError(
      f"axis_name={axis_name!r} and replica_axis={replica_axis!r} must name different axes "
      f"({shared or 'a repeated axis'}): an axis either shards everything (axis_name) or "
      "replicates everything and splits only the batch (replica_axis)."
    )
  return mesh


def set_mesh_unless_traced(mesh: Mesh, *trees: Any) -> contextlib.AbstractContextManager:
  """``jax.set_mesh(mesh)`` for an eager call; nothing inside a trace, which forbids it.

  Set, it tells jit the devices of outputs that depend on no input (such as a
  step counter). ``trees`` are the call's arguments: a tracer among them means
  a trace.
  """
  return contextlib.nullcontext() if is_traced(trees) else jax.set_mesh(mesh)


def is_traced(tree: Any) -> bool:
  """Whether any leaf is a tracer (we are inside ``jax.jit`` or another transformation)."""
  return any(isinstance(x, Tracer) for x in jax.tree.leaves(tree))


def traced_platform() -> str | None:
  """The platform (``"gpu"``, ``"tpu"``, ``"cpu"``) of the mesh being traced, as
  ``jax.shard_map`` sets it; ``None`` if it does not say (an abstract mesh)."""
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  return getattr(device, "platform", None)


def is_explicit(mesh: Mesh) -> bool:
  """Whether any axis of ``mesh`` uses explicit sharding (``jax.make_mesh``'s default)."""
  return any(t == AxisType.Explicit for t in mesh.axis_types)


def global_view(mesh: Mesh, fn: Callable[..., Any], out_specs: Any) -> Callable[..., Any]:
  """Runs ``fn`` on global arrays with sharding propagated by the compiler.

  zerojax runs the wrapped optimizer in the global view, where a norm is a
  global norm. On meshes with explicit axes that view is entered through
  ``jax.sharding.auto_axes``, because explicit sharding-in-types forbids what
  the optimizer may legitimately do (slice a padded dimension unevenly,
  contract over a sharded dimension in Muon's Newton-Schulz iteration).

  Args:
    mesh: the mesh.
    fn: a function of pytrees of arrays.
    out_specs: a pytree of ``PartitionSpec`` for ``fn``'s output.

  Returns:
    A function like ``fn`` whose outputs are constrained to ``out_specs``.
  """
  if is_explicit(mesh):

    def run_auto(*args):
      with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return jax.sharding.auto_axes(fn, out_sharding=out_specs)(*args)

    return run_auto

  def run_constrained(*args):
    return constrain(mesh, fn(*args), out_specs)

  return run_constrained


def constrain(mesh: Mesh, tree: Any, specs: Any) -> Any:
  """``with_sharding_constraint`` of a pytree to a matching pytree of ``PartitionSpec``."""
  return jax.tree.map(
    lambda x, spec: jax.lax.with_sharding_constraint(x, _sharding(mesh, spec)),
    tree,
    specs,
    is_leaf=lambda x: isinstance(x, P),
  )


def _sharding(mesh: Mesh, spec: P) -> Any:
  # Under an abstract-mesh context a bare spec is required; otherwise a NamedSharding.
  if not jax.sharding.get_abstract_mesh().empty:
    return spec
  return NamedSharding(mesh, spec)
