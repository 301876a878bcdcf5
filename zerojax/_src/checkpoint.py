"""Sharded checkpoints of a training state, restorable onto any device count and stage.

Each process writes only its own shards (Orbax), asynchronously, into a
temporary directory that is renamed once complete. Arrays are saved as stored,
padding included, so saving copies nothing on the devices. Every checkpoint
also records the state's *logical* leaves (paths, shapes without padding,
dtypes): a restore compares them with the target's and names what differs, and
reads each array straight into the target's shardings, cutting or zero-filling
the end of a padded dimension where the target pads it differently. Padding is
always zeros at the end of one dimension, and the logical region is the same
on both sides, so this gives back the saved values exactly.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._src import mesh as mesh_lib
from zerojax._src import zero as zero_lib

#: How a leaf is described in a checkpoint: its logical shape and dtype name.
LeafInfo = tuple[tuple[int, ...], str]


class StateSpec(NamedTuple):
  """What a training state looks like, as stored on a mesh and logically.

  Build one with ``train_state_spec``. A ``CheckpointManager`` saves states of
  this spec and restores checkpoints into it, whichever spec they were saved
  with, as long as the logical leaves agree.

  Attributes:
    stored: a pytree of ``jax.ShapeDtypeStruct`` with ``sharding`` set: the
      state's arrays as they live on the mesh (padded where the layout pads).
    logical: the same pytree without padding or shardings: what the state is,
      whatever the device count or stage.
    master_path: the keys that lead from the state's root to its full-precision
      parameters (what ``export_safetensors`` writes).

  Example:
    >>> import jax, jax.numpy as jnp, optax, zerojax
    >>> tx = zerojax.zero3(optax.adam(1e-3), mesh=jax.make_mesh((jax.device_count(),), ("data",)))
    >>> spec = zerojax.train_state_spec(tx, {"w": jnp.ones((5, 1001))})
    >>> spec.stored["params"]["w"].shape, spec.logical["params"]["w"].shape, spec.master_path
    ((5, 1008), (5, 1001), ('params',))
  """

  stored: Any
  logical: Any
  master_path: tuple[str | int, ...] = ("params",)


def train_state_spec(tx: zero_lib.ZeroTransformation, params: Any, **extras: Any) -> StateSpec:
  """The spec of ``{"params": ..., "opt_state": ..., **extras}`` for ``tx``.

  Args:
    tx: the ``ZeroTransformation`` the state is (or will be) trained with: its
      mesh, stage and precision policy decide how the state is stored.
    params: the parameters, full or as ``tx`` stores them, as arrays or
      ``jax.ShapeDtypeStruct``. For a spec of another device count or stage,
      pass the full ones (another transformation's padding would be taken
      for part of the model).
    **extras: more leaves of the state (a step counter, an RNG key, ...), as
      arrays or ``jax.ShapeDtypeStruct``; they are replicated on ``tx.mesh``.
      Use raw keys (``jax.random.PRNGKey`` or ``jax.random.key_data``).

  Returns:
    The ``StateSpec``.

  Raises:
    ValueError: if ``extras`` names ``params`` or ``opt_state``, or holds a
      typed PRNG key.

  Example:
    >>> import jax, jax.numpy as jnp, optax, zerojax
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = zerojax.zero3(optax.adam(1e-3), mesh=mesh)
    >>> spec = zerojax.train_state_spec(tx, {"w": jnp.zeros((5, 1001))}, step=jnp.int32(0))
    >>> spec.stored["params"]["w"].shape, spec.logical["params"]["w"].shape
    ((5, 1008), (5, 1001))
    >>> spec.stored["params"]["w"].sharding.spec
    P(None, 'data')
  """
  if "opt_state" in extras:
    raise ValueError(
      "train_state_spec makes opt_state itself from tx and params; name the extra leaf otherwise."
    )
  master = tx.layout(params).map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
  replicated = NamedSharding(tx.mesh, P())
  extras = {name: _extra(name, x) for name, x in extras.items()}
  stored = {
    "params": _placed(jax.eval_shape(tx.shard, master), tx.param_shardings(master)),
    "opt_state": _placed(jax.eval_shape(tx.init, master), tx.state_shardings(master)),
    **{name: _placed(x, replicated) for name, x in extras.items()},
  }
  logical_params, logical_state = tx.logical_shapes(master)
  logical = {"params": logical_params, "opt_state": logical_state, **extras}
  master_params = tx.master_params(stored["params"], stored["opt_state"])
  return StateSpec(stored, logical, _path_of(stored, master_params))


def _extra(name: str, x: Any) -> jax.ShapeDtypeStruct:
  struct = jax.eval_shape(lambda x: x, x)
  if not isinstance(struct, jax.ShapeDtypeStruct) or jax.dtypes.issubdtype(
    struct.dtype, jax.dtypes.prng_key
  ):
    raise ValueError(
      f"extra state leaf {name!r} must be one array; for a typed PRNG key "
      "store jax.random.key_data(key) and rebuild it with jax.random.wrap_key_data."
    )
  return jax.ShapeDtypeStruct(struct.shape, struct.dtype)


def _placed(structs: Any, shardings: Any) -> Any:
  return jax.tree.map(
    lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
    structs,
    shardings,
  )


def _path_of(tree: Any, subtree: Any) -> tuple[str | int, ...]:
  """The keys from ``tree``'s root to ``subtree``, one of its nodes (found by identity)."""
  first = jax.tree.leaves(subtree)[0]
  depth = len(jax.tree_util.tree_flatten_with_path(subtree)[0][0][0])
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if leaf is first:
      return tuple(key_name(key) for key in path[: len(path) - depth])
  raise ValueError("the master parameters are not part of the state")


def key_name(key: Any) -> str | int:
  """A pytree path entry as the dict key, attribute name or index it stands for."""
  for attribute in ("key", "name", "idx"):
    if hasattr(key, attribute):
      return getattr(key, attribute)
  raise ValueError(f"cannot name the pytree path entry {key!r}")


def describe(tree: Any) -> dict[str, LeafInfo]:
  """``{path: (shape, dtype name)}`` for every leaf of a pytree of arrays or structs."""
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
    >>> from zerojax._src.checkpoint import differences
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


def _mismatch(what: str, expected: dict, found: dict, names: tuple[str, str], fix: str) -> None:
  lines = differences(expected, found, names)
  if lines:
    shown = lines[:20] + ([f"... and {len(lines) - 20} more"] if len(lines) > 20 else [])
    raise ValueError("\n  ".join([f"{what}:", *shown]) + "\n" + fix)


def orbax_manager(directory: str | os.PathLike, **options: Any) -> ocp.CheckpointManager:
  """An Orbax manager for zerojax's two items: ``state`` (arrays) and ``layout`` (JSON)."""
  return ocp.CheckpointManager(
    os.path.abspath(directory),
    options=ocp.CheckpointManagerOptions(**options),
    item_handlers={
      "state": ocp.PyTreeCheckpointHandler(),
      "layout": ocp.JsonCheckpointHandler(),
    },
  )


def step_directory(manager: ocp.CheckpointManager, step: int) -> epath.Path:
  """Where ``manager`` keeps checkpoint ``step`` (Orbax's default step names: the number)."""
  return epath.Path(manager.directory) / ocp.step.standard_name_format().build_name(step)


def read_layout(manager: ocp.CheckpointManager, step: int | None) -> tuple[int, dict[str, Any]]:
  """The step (the latest if ``None``) and the layout recorded with it.

  Read by this process alone: unlike ``manager.restore``, no barrier with the
  other processes, so a process that fails here cannot leave them waiting.

  Raises:
    FileNotFoundError: if there is no such checkpoint, or it lacks its layout.
  """
  steps = manager.all_steps()
  if step is None and steps:
    step = max(steps)
  if step not in steps:
    raise FileNotFoundError(
      f"no checkpoint for step {step} in {manager.directory} (it has steps {sorted(steps)})."
    )
  try:
    layout = ocp.JsonCheckpointHandler().restore(step_directory(manager, step) / "layout")
  except (FileNotFoundError, ValueError) as error:
    raise FileNotFoundError(
      f"checkpoint step {step} in {manager.directory} has no readable layout "
      f"record ({error}); it is damaged: restore another step."
    ) from error
  return step, layout


# Where a state's master parameters live: the parameters themselves (stage 3,
# or no lower compute dtype), or a separate copy (stages 1-2 under a lower
# compute dtype), from which the parameters are rounded.
_PARAMS = ("params",)


def _separate(master_path: tuple[str | int, ...]) -> bool:
  return master_path != _PARAMS


def _comparable(
  spec_leaves: dict[str, Any],
  spec_master: tuple[str | int, ...],
  saved_leaves: dict[str, Any],
  saved_master: tuple[str | int, ...],
) -> tuple[dict[str, LeafInfo], dict[str, LeafInfo]]:
  """Both sides' logical leaves, keyed so that the master parameters line up wherever they live.

  A separate master copy makes the parameters a rounded copy of it, so those
  are left out: they are remade from the master on restore. Leaves are named
  as in the spec where it has them.
  """

  def by_role(leaves, master_path):
    out = {}
    for name, leaf in leaves.items():
      keys = tuple(leaf["keys"])
      if keys[: len(master_path)] == master_path:
        keys = ("master", *keys[len(master_path) :])
      elif keys[:1] == _PARAMS:
        continue
      out[keys] = (name, (tuple(leaf["shape"]), leaf["dtype"]))
    return out

  spec_roles = by_role(spec_leaves, spec_master)
  expected = dict(spec_roles.values())
  found = {
    spec_roles.get(keys, (name,))[0]: info
    for keys, (name, info) in by_role(saved_leaves, saved_master).items()
  }
  return expected, found


def _reading_plan(spec: StateSpec, saved_master: tuple[str | int, ...]) -> Any:
  """What to read: ``spec.stored`` with the master copy moved to where the checkpoint has it.

  A checkpoint's rounded parameters (beside a separate master copy) are not
  read at all.
  """
  master = at(spec.stored, spec.master_path)
  item = spec.stored
  if _separate(spec.master_path):
    item = _with(item, spec.master_path, None)
  if _separate(saved_master):
    item = {name: x for name, x in item.items() if name != "params"}
  return _with(item, saved_master, master)


def _master_in_place(spec: StateSpec, saved_master: tuple[str | int, ...], state: Any) -> Any:
  """A state read by ``_reading_plan``, its master copy moved back to where the spec has it."""
  master = at(state, saved_master)
  if _separate(saved_master):
    state = _with(state, saved_master, None)
  state = _with(state, spec.master_path, master)
  if _separate(spec.master_path):
    state = _with(state, _PARAMS, _rounded(master, spec.logical["params"], spec.stored["params"]))
  return state


def _rounded(master: Any, logical: Any, stored: Any) -> Any:
  """Parameters in ``stored``'s dtypes, shapes and shardings, rounded from the master copy."""

  def round_leaf(x, shape, struct):
    x = x[tuple(slice(0, n) for n in shape.shape)].astype(struct.dtype)
    return jnp.pad(x, [(0, want - have) for want, have in zip(struct.shape, x.shape, strict=True)])

  shardings = jax.tree.map(lambda struct: struct.sharding, stored)
  mesh = jax.tree.leaves(shardings)[0].mesh
  # In the global view: on explicit axes, slicing a padded dimension that the
  # master copy splits over the data axis is a sharding-type error outside it.
  round_all = mesh_lib.global_view(
    mesh,
    lambda master: jax.tree.map(round_leaf, master, logical, stored),
    jax.tree.map(lambda sharding: sharding.spec, shardings),
  )
  return jax.jit(round_all, out_shardings=shardings)(master)


def at(tree: Any, keys: Sequence[str | int]) -> Any:
  """The node of ``tree`` at ``keys`` (dict keys, sequence indices, attribute names)."""
  for key in keys:
    tree = tree[key] if isinstance(tree, dict) or isinstance(key, int) else getattr(tree, key)
  return tree


def _with(tree: Any, keys: tuple[str | int, ...], value: Any) -> Any:
  """``tree`` with the node at ``keys`` replaced by ``value`` (``tree`` itself is unchanged)."""
  if not keys:
    return value
  key, rest = keys[0], keys[1:]
  if isinstance(tree, dict):
    return {**tree, key: _with(tree.get(key), rest, value)}
  if isinstance(key, str):
    return tree._replace(**{key: _with(getattr(tree, key), rest, value)})
  items = list(tree)
  items[key] = _with(items[key], rest, value)
  return type(tree)(items)


# What a process made of a checkpoint it tried to restore.
_READ, _DAMAGED, _MISFIT = 0, 1, 2


def _on_every_process(value: int) -> np.ndarray:
  """Every process's ``value``, in process order (a collective: every process must call it)."""
  if jax.process_count() == 1:
    return np.array([value])
  return np.asarray(multihost_utils.process_allgather(np.int32(value))).ravel()


class CheckpointManager:
  """Saves training states of one ``StateSpec`` and restores checkpoints into it.

  Saving keeps the last ``max_to_keep`` checkpoints, one every
  ``save_interval_steps`` steps. A save is written into a temporary directory
  that is renamed when every process has finished, so a run killed mid-save
  leaves the previous checkpoints intact; the temporary directory is removed
  the next time a manager opens the directory.

  To restore onto another device count or stage, open the same directory with
  the spec of the new transformation: ``restore`` reads each process's shards
  of every array straight into the new shardings.

  Args:
    directory: where the checkpoints live (created if needed).
    spec: the ``StateSpec`` of the states to save and restore.
    max_to_keep: how many of the latest checkpoints to keep (``None``: all).
    save_interval_steps: ``save`` writes only steps that are multiples of this.
    async_save: write in the background; ``save`` returns once the arrays are
      copied to host memory. ``wait`` (or leaving the ``with`` block) waits.

  Example:
    >>> import tempfile, jax, jax.numpy as jnp, optax, zerojax
    >>> tx = zerojax.zero3(optax.adam(1e-3), mesh=jax.make_mesh((jax.device_count(),), ("data",)))
    >>> full = {"w": jnp.ones((5, 1001))}
    >>> params = tx.shard(full)
    >>> state = {"params": params, "opt_state": tx.init(params), "step": jnp.int32(7)}
    >>> spec = zerojax.train_state_spec(tx, full, step=state["step"])
    >>> directory = tempfile.mkdtemp()
    >>> with zerojax.CheckpointManager(directory, spec) as checkpoints:
    ...   checkpoints.save(7, state)
    True
    >>> mesh2 = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    >>> tx2 = zerojax.zero1(optax.adam(1e-3), mesh=mesh2)
    >>> spec2 = zerojax.train_state_spec(tx2, full, step=state["step"])
    >>> with zerojax.CheckpointManager(directory, spec2) as checkpoints:
    ...   restored = checkpoints.restore()
    >>> restored["params"]["w"].shape, int(restored["step"])
    ((5, 1001), 7)
  """

  def __init__(
    self,
    directory: str | os.PathLike,
    spec: StateSpec,
    *,
    max_to_keep: int | None = 3,
    save_interval_steps: int = 1,
    async_save: bool = True,
  ):
    self.spec = spec
    self._stored = describe(spec.stored)
    self._logical = describe(spec.logical)
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(spec.logical)[0]]
    self._record = {
      "leaves": {
        name: {"keys": [key_name(key) for key in path], "shape": list(shape), "dtype": dtype}
        for path, (name, (shape, dtype)) in zip(paths, self._logical.items(), strict=True)
      },
      "master_path": list(spec.master_path),
    }
    policies = ocp.checkpoint_managers
    self._manager = orbax_manager(
      directory,
      save_decision_policy=policies.FixedIntervalPolicy(save_interval_steps),
      preservation_policy=None if max_to_keep is None else policies.LatestN(max_to_keep),
      enable_async_checkpointing=async_save,
      cleanup_tmp_directories=True,
    )
    # Restores read through this handler directly, without the manager's
    # barrier between processes: a process whose read fails must not leave the
    # others waiting there (see ``_read``).
    self._reader = ocp.PyTreeCheckpointHandler()

  @property
  def directory(self) -> str:
    return os.fspath(self._manager.directory)

  def save(self, step: int, state: Any, *, force: bool = False) -> bool:
    """Saves ``state`` as checkpoint ``step``, unless the interval skips it.

    Args:
      step: the checkpoint's step number.
      state: a pytree of ``jax.Array`` s matching ``spec.stored``.
      force: save even if ``step`` is not a multiple of the interval.

    Returns:
      Whether a save was started.

    Raises:
      ValueError: if ``state`` does not match the spec (naming every path
        whose structure, shape or dtype differs).
    """
    _mismatch(
      "the state does not match this manager's spec",
      self._stored,
      describe(state),
      ("spec", "state"),
      "Save the state the spec describes, or build the manager with that state's spec.",
    )
    args = ocp.args.Composite(
      state=ocp.args.PyTreeSave(state), layout=ocp.args.JsonSave(self._record)
    )
    return self._manager.save(step, args=args, force=force)

  def restore(self, step: int | None = None) -> Any:
    """The checkpoint of ``step`` (by default the latest readable one), placed as ``spec.stored``.

    Where the spec keeps its master parameters elsewhere than the checkpoint
    (stages 1-2 under a lower compute dtype keep them in the optimizer state,
    stage 3 as the parameters themselves), the master copy is read into the
    spec's place for it, and compute-dtype parameters are rounded from it, as
    ``tx.shard`` would.

    Without ``step``, a damaged latest checkpoint (a file missing or
    truncated, its layout record unreadable: anything that stops it from being
    read in full, on any process) does not stop a resume: the one before is
    restored instead, and so on, and the damaged ones are renamed to
    ``<step>.damaged`` (kept for a look, out of the way of new saves) with a
    warning that says so. If none can be read, nothing is renamed and the
    latest's error is raised. In a multi-process run every process reaches the
    same verdict on every checkpoint (one tiny collective per checkpoint
    tried).

    Raises:
      FileNotFoundError: if there is no such checkpoint (no checkpoint at all,
        for the latest).
      ValueError: if its logical leaves differ from the spec's (naming every
        path whose structure, shape or dtype differs), or it (for the latest:
        every checkpoint) cannot be read in full.
    """
    if step is not None:
      state, error = self._read(step)
      if error is not None:
        raise error
      return state
    steps = self.all_steps()
    if not steps:
      raise FileNotFoundError(f"no checkpoint for step None in {self.directory} (it has steps []).")
    damaged = []
    for candidate in reversed(steps):
      state, error = self._read(candidate)
      if error is None:
        if damaged:
          self._set_aside(damaged, candidate)
        return state
      damaged.append((candidate, error))
    if len(steps) > 1:
      raise ValueError(
        f"{damaged[0][1]} None of the earlier checkpoints {steps[:-1]} could be read either."
      ) from damaged[0][1]
    raise damaged[0][1]

  def _read(self, step: int) -> tuple[Any, Exception | None]:
    """``(state, None)``, or ``(None, error)`` if ``step`` is damaged on any process.

    Raises:
      ValueError: if the checkpoint does not fit the spec (on any process).
    """
    state, problem, kind = None, None, _READ
    try:
      _, layout = read_layout(self._manager, step)
      saved_master = tuple(layout["master_path"])
    except FileNotFoundError as error:
      problem, kind = error, _DAMAGED
    else:
      try:
        self._check_fits(step, layout, saved_master)
      except ValueError as error:
        problem, kind = error, _MISFIT
      else:
        try:
          state = self._read_arrays(step, saved_master)
        except ValueError as error:
          problem, kind = error, _DAMAGED
    kinds = _on_every_process(kind)
    verdict = next((k for k in (_MISFIT, _DAMAGED) if (kinds == k).any()), _READ)
    if verdict != kind:
      where = [int(p) for p in np.flatnonzero(kinds == verdict)]
      what = "does not fit this manager's spec" if verdict == _MISFIT else "could not be read"
      problem = ValueError(
        f"checkpoint step {step} in {self.directory} {what} on process(es) {where}; their "
        "errors say why."
      )
    if verdict == _MISFIT:
      raise problem
    return (None, problem) if verdict == _DAMAGED else (state, None)

  def _check_fits(self, step: int, layout: dict[str, Any], saved_master: tuple) -> None:
    expected, found = _comparable(
      self._record["leaves"], self.spec.master_path, layout["leaves"], saved_master
    )
    _mismatch(
      f"checkpoint step {step} in {self.directory} does not fit this manager's spec",
      expected,
      found,
      ("spec", "checkpoint"),
      "Restore with the model, optimizer and precision policy that were saved; "
      "the device count and stage may differ.",
    )

  def _read_arrays(self, step: int, saved_master: tuple[str | int, ...]) -> Any:
    """The state of checkpoint ``step``, read by this process alone (no barrier)."""
    item = _reading_plan(self.spec, saved_master)
    restore_args = jax.tree.map(
      lambda x: ocp.ArrayRestoreArgs(
        sharding=x.sharding, global_shape=x.shape, dtype=x.dtype, strict=False
      ),
      item,
    )
    args = ocp.args.PyTreeRestore(
      item=item, restore_args=restore_args, partial_restore=_separate(saved_master)
    )
    try:
      state = self._reader.restore(step_directory(self._manager, step) / "state", args=args)
    except Exception as error:
      # Orbax's message ends with the whole TensorStore spec; its start says what failed.
      reason = f"{type(error).__name__}: {error}"[:400]
    else:
      return _master_in_place(self.spec, saved_master, state)
    # Raised outside the handler, so that Orbax's error and the unfinished reads
    # its traceback holds are released now rather than at some later collection.
    raise ValueError(
      f"checkpoint step {step} in {self.directory} could not be read in full "
      f"({reason} ...). It is damaged: restore another of {self.all_steps()}."
    )

  def _set_aside(self, damaged: list[tuple[int, Exception]], restored: int) -> None:
    """Renames damaged checkpoints to ``<step>.damaged`` (process 0), and says so."""
    moves = []
    for step, _ in damaged:
      source = step_directory(self._manager, step)
      target, count = source.with_name(f"{source.name}.damaged"), 1
      while target.exists():
        count += 1
        target = source.with_name(f"{source.name}.damaged{count}")
      moves.append((source, target))
    _on_every_process(0)  # everyone has named the targets before any is taken
    failure = None
    if jax.process_index() == 0:
      try:
        for source, target in moves:
          source.rename(target)
      except Exception as error:  # e.g. a file system without directory renames
        failure = error
    if _on_every_process(failure is not None)[0]:
      raise ValueError(
        f"checkpoint(s) {[step for step, _ in damaged]} in {self.directory} are damaged and "
        f"could not be moved aside ({failure or 'see process 0'}): move or delete them by "
        f"hand, then restore again; step {restored} is the latest that can be read."
      )
    self._manager.reload()
    described = "; ".join(
      f"step {step} ({str(error).splitlines()[0][:200]}) moved to {target}"
      for (step, error), (_, target) in zip(damaged, moves, strict=True)
    )
    warnings.warn(
      f"damaged checkpoint(s) in {self.directory}: {described}. Restored step {restored}, the "
      "latest that can be read.",
      stacklevel=3,
    )

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or ``None``."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """The steps of every complete checkpoint, oldest first."""
    return sorted(self._manager.all_steps())

  def wait(self) -> None:
    """Waits for a background save to finish (and raises its error, if any)."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for background saves and releases the manager."""
    self._manager.close()
    self._reader.close()

  def __enter__(self) -> CheckpointManager:
    return self

  def __exit__(self, *exc_info: Any) -> None:
    self.close()
