"""The record a checkpoint keeps of its state's logical leaves, and what makes it fit a spec.

Pure functions of plain data. Every checkpoint saves, beside its arrays, a
JSON *layout record* (``layout_record``): each logical leaf's keys, shape
without padding and dtype, and where the master parameters live. A restore
compares the checkpoint's record with its own spec's (``misfits``), so that a
checkpoint of another model, optimizer or precision policy is refused with a
list of what differs, while another device count or stage is not a difference.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from zerojax._src.checkpoint.spec import PARAMS, key_name

#: How a leaf is described: its logical shape and dtype name.
LeafInfo = tuple[tuple[int, ...], str]

#: A layout record as JSON holds it: ``{"leaves": {path: {"keys", "shape",
#: "dtype"}}, "master_path": [key, ...]}``.
Record = dict[str, Any]

# How many differences an error lists before it says how many more there are.
_SHOWN = 20


def describe(tree: Any) -> dict[str, LeafInfo]:
  """``{path: (shape, dtype name)}`` for every leaf of a pytree of arrays or structs.

  Example:
    >>> import jax.numpy as jnp
    >>> describe({"w": jnp.zeros((2, 3)), "n": [jnp.int32(0)]})
    {"['n'][0]": ((), 'int32'), "['w']": ((2, 3), 'float32')}
  """
  return {
    jax.tree_util.keystr(path): (tuple(int(n) for n in np.shape(x)), np.dtype(x.dtype).name)
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


def differences(
  expected: dict[str, LeafInfo], found: dict[str, LeafInfo], names: tuple[str, str]
) -> list[str]:
  """What differs between two ``describe`` results, one line per path.

  Args:
    expected: what should be there.
    found: what is there.
    names: what to call each in the lines, e.g. ``("spec", "checkpoint")``.

  Example:
    >>> for line in differences(
    ...   {"w": ((2, 3), "float32"), "b": ((3,), "float32")},
    ...   {"w": ((2, 4), "bfloat16")},
    ...   names=("spec", "file"),
    ... ):
    ...   print(line)
    b: in the spec, not in the file
    w: dtype bfloat16 in the file, float32 in the spec
    w: shape (2, 4) in the file, (2, 3) in the spec
  """
  want, have = names
  lines = [f"{path}: in the {want}, not in the {have}" for path in expected if path not in found]
  lines += [f"{path}: in the {have}, not in the {want}" for path in found if path not in expected]
  for path in expected.keys() & found.keys():
    for what, wanted, got in zip(("shape", "dtype"), expected[path], found[path], strict=True):
      if wanted != got:
        lines.append(f"{path}: {what} {got} in the {have}, {wanted} in the {want}")
  return sorted(lines)


def listed_error(what: str, lines: list[str], fix: str) -> ValueError:
  """A ``ValueError`` that says ``what``, lists the lines (the first 20), then says ``fix``.

  Example:
    >>> print(listed_error("the state does not match", ["w: in the spec, not the state"], "Fix."))
    the state does not match:
      w: in the spec, not the state
    Fix.
  """
  more = [f"... and {len(lines) - _SHOWN} more"] if len(lines) > _SHOWN else []
  return ValueError("\n  ".join([f"{what}:", *lines[:_SHOWN], *more]) + "\n" + fix)


def layout_record(logical: Any, master_path: tuple[str | int, ...]) -> Record:
  """The record a checkpoint of a state with these logical leaves saves beside its arrays.

  Args:
    logical: the state's logical leaves (``StateSpec.logical``).
    master_path: where its master parameters live (``StateSpec.master_path``).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> w = jax.ShapeDtypeStruct((5, 1001), jnp.float32)
    >>> record = layout_record({"params": {"w": w}}, ("params",))
    >>> record["leaves"]
    {"['params']['w']": {'keys': ['params', 'w'], 'shape': [5, 1001], 'dtype': 'float32'}}
    >>> record["master_path"]
    ['params']
  """
  leaves, _ = jax.tree_util.tree_flatten_with_path(logical)
  return {
    "leaves": {
      name: {"keys": [key_name(key) for key in path], "shape": list(shape), "dtype": dtype}
      for (path, _), (name, (shape, dtype)) in zip(leaves, describe(logical).items(), strict=True)
    },
    "master_path": list(master_path),
  }


def misfits(spec: Record, saved: Record) -> list[str]:
  """What keeps a checkpoint with record ``saved`` from restoring into ``spec``'s; none if it fits.

  The master parameters are compared wherever each side keeps them (the
  parameters themselves, or a separate master copy in the optimizer state),
  and parameters rounded from a separate master copy are left out: a restore
  remakes them. So a checkpoint fits a spec of any device count and stage
  whose model, optimizer and precision policy agree.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> w = jax.ShapeDtypeStruct((5, 1001), jnp.float32)
    >>> stage3 = layout_record({"params": {"w": w}}, ("params",))
    >>> stage2_bf16 = layout_record(
    ...   {"params": {"w": w.update(dtype=jnp.bfloat16)}, "opt_state": {"master": {"w": w}}},
    ...   ("opt_state", "master"),
    ... )
    >>> misfits(stage3, stage2_bf16)
    []
    >>> misfits(stage3, layout_record({"params": {"w": w.update(shape=(5, 1000))}}, ("params",)))
    ["['params']['w']: shape (5, 1000) in the checkpoint, (5, 1001) in the spec"]
  """
  spec_roles = _by_role(spec)
  expected = dict(spec_roles.values())
  # Leaves are named as in the spec where it has them, so that a master copy
  # kept elsewhere is reported under the spec's name for it.
  found = {spec_roles.get(keys, (name,))[0]: info for keys, (name, info) in _by_role(saved).items()}
  return differences(expected, found, ("spec", "checkpoint"))


def _by_role(record: Record) -> dict[tuple[str | int, ...], tuple[str, LeafInfo]]:
  """``{keys: (name, info)}``, the master parameters' keys starting ``"master"`` wherever they live.

  Parameters beside a separate master copy (a rounded copy of it) are left out.
  """
  master_path = tuple(record["master_path"])
  out = {}
  for name, leaf in record["leaves"].items():
    keys = tuple(leaf["keys"])
    if keys[: len(master_path)] == master_path:
      keys = ("master", *keys[len(master_path) :])
    elif keys[:1] == PARAMS:
      continue
    out[keys] = (name, (tuple(leaf["shape"]), leaf["dtype"]))
  return out
