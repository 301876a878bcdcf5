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

``CheckpointManager`` puts together the parts, each in its own module: the
spec (``checkpoint_spec``), the layout record and what fits it
(``checkpoint_record``), the master copy's moves between stages
(``checkpoint_master``), the restore decisions and the process vote
(``checkpoint_verdict``), and the directory on disk (``checkpoint_directory``).
"""

from __future__ import annotations

import operator
import os
import re
from typing import Any

import jax
import orbax.checkpoint as ocp

from zerojax._src.checkpoint import directory as directory_lib
from zerojax._src.checkpoint import master as master_lib
from zerojax._src.checkpoint import record as record_lib
from zerojax._src.checkpoint import verdict as verdict_lib
from zerojax._src.checkpoint.spec import StateSpec, train_state_spec
from zerojax._src.checkpoint.verdict import Verdict
from zerojax._src.sharding import stored as stored_lib

# train_state_spec lives with StateSpec; zerojax imports both from here.
__all__ = ("CheckpointManager", "StateSpec", "train_state_spec")

# What to do about a checkpoint that does not fit the spec.
_REFIT = (
  "Restore with the model, optimizer and precision policy that were saved; "
  "the device count and stage may differ."
)


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
    if not isinstance(spec, StateSpec):
      raise TypeError(
        f"CheckpointManager's spec is a zerojax.StateSpec, got {type(spec).__name__}: pass "
        "zerojax.train_state_spec(tx, params) (the transformation and the full parameters)."
      )
    self.spec = spec
    # On disk a stage-3 parameter is its array: Stored leaves are unwrapped to save and
    # wrapped again as spec.stored says after a restore, so checkpoints keep one format.
    self._plain = spec._replace(stored=stored_lib.unwrap(spec.stored))
    self._stored = record_lib.describe(self._plain.stored)
    self._record = record_lib.layout_record(spec.logical, spec.master_path)
    policies = ocp.checkpoint_managers
    self._manager = directory_lib.open_manager(
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
      TypeError: if ``step`` is not a whole number.
      ValueError: if ``state`` does not match the spec (naming every path
        whose structure, shape or dtype differs), or the step's directory
        name is taken by something that is not a checkpoint.
    """
    step = _whole_step(step)
    state = stored_lib.unwrap(state)
    lines = record_lib.differences(self._stored, record_lib.describe(state), ("spec", "state"))
    if lines:
      raise record_lib.listed_error(
        "the state does not match this manager's spec",
        lines,
        "Save the state the spec describes, or build the manager with that state's spec.",
      )
    if force or self._manager.should_save(step):
      directory_lib.check_free(self._manager, step)
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
    state, restored, damaged = verdict_lib.latest_readable(
      self.all_steps(), self._read, self.directory
    )
    if damaged:
      directory_lib.set_aside(self._manager, damaged, restored)
    return state

  def _read(self, step: int) -> tuple[Any, Exception | None]:
    """``(state, None)``, or ``(None, error)`` if ``step`` is damaged on any process.

    Raises:
      ValueError: if the checkpoint does not fit the spec (on any process).
    """
    own, state, error = self._attempt(step)
    verdict, error = verdict_lib.vote(own, error, f"checkpoint step {step} in {self.directory}")
    if verdict == Verdict.MISFIT:
      raise error  # pyright: ignore[reportGeneralTypeIssues] (a misfit comes with its error)
    return (None, error) if verdict == Verdict.DAMAGED else (state, None)

  def _attempt(self, step: int) -> tuple[Verdict, Any, Exception | None]:
    """This process's verdict on checkpoint ``step``, with the state read or the error."""
    try:
      _, layout = directory_lib.read_layout(self._manager, step)
    except FileNotFoundError as error:
      return Verdict.DAMAGED, None, error
    what = f"checkpoint step {step} in {self.directory}"
    lines = record_lib.misfits(self._record, layout)
    if lines:
      error = record_lib.listed_error(f"{what} does not fit this manager's spec", lines, _REFIT)
      return Verdict.MISFIT, None, error
    saved_master = tuple(layout["master_path"])
    path = directory_lib.step_directory(self._manager, step) / "state"
    try:
      state = _read_arrays(
        self._reader,
        path,
        master_lib.reading_plan(self._plain, saved_master),
        partial=master_lib.separate(saved_master),  # its rounded params are not read
      )
    except _OtherStructureError as error:
      lines = [f"{line}: {error.args[0][line]}" for line in sorted(error.args[0])]
      fit = f"{what} does not fit this manager's spec (its containers differ, as an optimizer's"
      fit += " empty states do: optax.adamw's three against optax.adam's two, say)"
      return Verdict.MISFIT, None, record_lib.listed_error(fit, lines, _REFIT)
    except _UnreadableError as error:
      damage = f"{what} could not be read in full ({error} ...). It is damaged: restore another"
      return Verdict.DAMAGED, None, ValueError(f"{damage} of {self.all_steps()}.")
    state = master_lib.master_in_place(self._plain, saved_master, state)
    state = master_lib.with_rounded_params(self._plain, state)
    return Verdict.READ, stored_lib.rewrap(self.spec.stored, state), None

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


def _whole_step(step: Any) -> int:
  """``step`` as an ``int`` (a numpy or JAX integer scalar will do), or a clear error."""
  try:
    index = None if isinstance(step, bool) else operator.index(step)
  except TypeError:
    index = None
  if index is None or index < 0:
    raise TypeError(
      f"a checkpoint's step is a whole number, 0 or more, got {step!r} "
      f"({type(step).__name__}): Orbax would name its directory {str(step)!r}, which "
      "all_steps(), latest_step() and restore() never list. Pass int(step)."
    )
  return index


class _UnreadableError(Exception):
  """Orbax could not read a checkpoint's arrays in full; the message says why, briefly."""


class _OtherStructureError(Exception):
  """The checkpoint's containers differ from the spec's where their leaves agree.

  Its argument is ``{path: what differs}``. Optimizers whose states differ
  only in empty nodes (``optax.adam`` and ``optax.adamw``) have the same
  leaves, so the layout record cannot tell them apart; Orbax's metadata can.
  """


#: How Orbax says that the tree to restore and the saved one differ, and each difference:
#: a path, then the restore item's ``(container, size)`` ("Source") and the saved one ("Target").
_ORBAX_OTHER_TREE = "tree structures do not match"
_ORBAX_DIFFERENCE = re.compile(r"^(\S+):\s*\n\s*- Source: (.+)\n\s*- Target: (.+)$", re.MULTILINE)


def _other_structure(message: str) -> dict[str, str] | None:
  """``{path: what differs}`` if Orbax's ``message`` says the trees differ, else ``None``."""
  if _ORBAX_OTHER_TREE not in message:
    return None
  found = _ORBAX_DIFFERENCE.findall(message)
  shown = lambda node: re.sub(r"^\(<class '(\w+)'>, (\d+)\)$", r"a \1 of \2", node.strip())
  return {
    path: f"{shown(saved)} in the checkpoint, {shown(spec)} in the spec"
    for path, spec, saved in found
  }


def _read_arrays(
  reader: ocp.PyTreeCheckpointHandler, path: Any, item: Any, *, partial: bool
) -> Any:
  """The arrays that ``item`` (``jax.ShapeDtypeStruct`` s) names, read by this process alone.

  Each is read straight into its struct's shape and sharding: the region both
  shapes share, zero-filled beyond. With ``partial``, saved arrays that
  ``item`` leaves out are not read; without it, ``item`` must name them all.

  Raises:
    _OtherStructureError: if the saved tree's containers differ from ``item``'s.
    _UnreadableError: if Orbax cannot read them in full.
  """
  restore_args = jax.tree.map(
    lambda x: ocp.ArrayRestoreArgs(
      sharding=x.sharding, global_shape=x.shape, dtype=x.dtype, strict=False
    ),
    item,
  )
  args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=partial)
  try:
    return reader.restore(path, args=args)
  except Exception as error:
    other = _other_structure(str(error))
    # Orbax's message ends with the whole TensorStore spec; its start says what failed.
    reason = f"{type(error).__name__}: {error}"[:400]
  # Raised outside the handler, so that Orbax's error and the unfinished reads
  # its traceback holds are released now rather than at some later collection.
  if other:
    raise _OtherStructureError(other)
  raise _UnreadableError(reason)
