"""A directory of checkpoints on disk: which entries are checkpoints, and moving damaged ones aside.

A checkpoint is a directory named by its step (Orbax's default names: the
number) that holds what Orbax writes into every checkpoint it saves: the
``_CHECKPOINT_METADATA`` file, or zerojax's ``state`` and ``layout`` items.
Any other directory named like a step (an empty ``7``, someone's files in
``3``) is not a checkpoint: it is left alone, neither listed, restored, renamed
nor deleted, with a warning that names it, and saving that step raises. Only a
checkpoint can be moved aside as damaged.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from zerojax._src.checkpoint import verdict as verdict_lib

#: What Orbax writes into every checkpoint, and zerojax's two items: a step
#: directory holding any of them is a checkpoint (perhaps a damaged one).
MARKERS = ("_CHECKPOINT_METADATA", "state", "layout")

_STANDARD = ocp.step.standard_name_format()


def is_checkpoint(path: epath.PathLike) -> bool:
  """Whether ``path`` is a checkpoint's directory (complete or damaged), not something else."""
  path = epath.Path(path)
  return path.is_dir() and any((path / marker).exists() for marker in MARKERS)


class _CheckpointsOnly(ocp.step.NameFormat):
  """Orbax's standard step names, finding only the entries that are checkpoints.

  Orbax would take any entry named like a step for a checkpoint: list it,
  restore it, and delete it when it falls out of ``max_to_keep``.
  """

  def build_name(self, step: int) -> str:
    return _STANDARD.build_name(step)

  def find_all(self, base_path: epath.PathLike) -> Iterator[ocp.step.Metadata]:
    return (found for found in _STANDARD.find_all(base_path) if is_checkpoint(found.path))

  def find_step(self, base_path: epath.PathLike, step: int) -> ocp.step.Metadata:
    found = _STANDARD.find_step(base_path, step)
    if not is_checkpoint(found.path):
      raise ValueError(f"{found.path} is not a checkpoint (it holds none of {MARKERS}).")
    return found


def open_manager(directory: str | os.PathLike, **options: Any) -> ocp.CheckpointManager:
  """An Orbax manager for zerojax's two items: ``state`` (arrays) and ``layout`` (JSON).

  Args:
    directory: the checkpoints' directory.
    **options: ``ocp.CheckpointManagerOptions``; with ``create=False`` the
      directory must exist.

  Raises:
    ValueError: if ``directory``, or a directory above it, is a file.
    FileNotFoundError: if it does not exist and ``create=False``.
  """
  path = epath.Path(os.path.abspath(directory))
  existing = next(p for p in (path, *path.parents) if p.exists())
  if not existing.is_dir():
    creates = " (CheckpointManager creates it if needed)" * options.get("create", True)
    raise ValueError(
      f"checkpoints go in a directory, but {existing} is a file"
      f"{'' if existing == path else f' (in the path {path})'}: pass the path of a "
      f"directory{creates}."
    )
  if not path.exists() and not options.get("create", True):
    raise FileNotFoundError(f"the checkpoint directory {path} does not exist.")
  _warn_about_strangers(path)
  return ocp.CheckpointManager(
    path,
    options=ocp.CheckpointManagerOptions(step_name_format=_CheckpointsOnly(), **options),
    item_handlers={
      "state": ocp.PyTreeCheckpointHandler(),
      "layout": ocp.JsonCheckpointHandler(),
    },
  )


def _warn_about_strangers(directory: epath.Path) -> None:
  strangers = [found.path for found in _STANDARD.find_all(directory)]
  strangers = sorted(os.fspath(path) for path in strangers if not is_checkpoint(path))
  if strangers:
    warnings.warn(
      f"{', '.join(strangers)} in {directory}: named like a checkpoint but not one (it holds "
      f"none of {MARKERS}). Left alone: not restored, renamed or deleted. Move it out of the "
      "checkpoint directory to silence this.",
      stacklevel=4,  # where the user opened the directory
    )


def step_directory(manager: ocp.CheckpointManager, step: int) -> epath.Path:
  """Where ``manager`` keeps checkpoint ``step``."""
  return epath.Path(manager.directory) / _STANDARD.build_name(step)


def check_free(manager: ocp.CheckpointManager, step: int) -> None:
  """Raises a ``ValueError`` if saving ``step`` would have to replace something not a checkpoint."""
  path = step_directory(manager, step)
  if path.exists() and not is_checkpoint(path):
    raise ValueError(
      f"cannot save step {step}: {path} exists and is not a checkpoint (it holds none of "
      f"{MARKERS}). Move it out of {manager.directory}, or save under another step."
    )


def _one_step(manager: ocp.CheckpointManager) -> str:
  """What an error adds when the manager's directory is one checkpoint's, not the run's."""
  directory = epath.Path(manager.directory)
  if not is_checkpoint(directory):
    return ""
  return (
    f": it is itself a checkpoint, step {directory.name} of {directory.parent}; pass "
    f"{directory.parent} (with step={directory.name}, or none for the latest)"
  )


def read_layout(manager: ocp.CheckpointManager, step: int | None) -> tuple[int, dict[str, Any]]:
  """The step (the latest if ``None``) and the layout record saved with it.

  Read by this process alone: unlike ``manager.restore``, no barrier with the
  other processes, so a process that fails here cannot leave them waiting.

  Raises:
    FileNotFoundError: if there is no such checkpoint, or it lacks its layout.
  """
  steps = sorted(manager.all_steps())
  if step is None:
    if not steps:
      raise FileNotFoundError(f"no checkpoints in {manager.directory}{_one_step(manager)}.")
    step = steps[-1]
  if step not in steps:
    stranger = step_directory(manager, step)
    raise FileNotFoundError(
      f"no checkpoint for step {step} in {manager.directory} (it has steps {steps})"
      + (f"; {stranger} is not a checkpoint." if stranger.exists() else ".")
    )
  try:
    layout = ocp.JsonCheckpointHandler().restore(step_directory(manager, step) / "layout")
  except (FileNotFoundError, ValueError) as error:
    raise FileNotFoundError(
      f"checkpoint step {step} in {manager.directory} has no readable layout "
      f"record ({error}); it is damaged: restore another step."
    ) from error
  return step, dict(layout)


def set_aside(
  manager: ocp.CheckpointManager, damaged: Sequence[tuple[int, Exception]], restored: int
) -> None:
  """Renames damaged checkpoints to ``<step>.damaged`` (kept for a look), and warns that it did.

  Process 0 renames, after every process has named the same targets; if it
  cannot, every process raises.

  Args:
    manager: the checkpoints' manager.
    damaged: the damaged checkpoints' steps, with the errors that say why.
    restored: the step restored instead, for the warning.

  Raises:
    ValueError: if the directories cannot be renamed (say, on a file system
      without directory renames).
  """
  moves = [_aside(step_directory(manager, step)) for step, _ in damaged]
  verdict_lib.on_every_process(0)  # everyone has named the targets before any is taken
  failure = None
  if jax.process_index() == 0:
    try:
      for source, target in moves:
        source.rename(target)
    except Exception as error:  # e.g. a file system without directory renames
      failure = error
  if verdict_lib.on_every_process(failure is not None)[0]:
    raise ValueError(
      f"checkpoint(s) {[step for step, _ in damaged]} in {manager.directory} are damaged and "
      f"could not be moved aside ({failure or 'see process 0'}): move or delete them by "
      f"hand, then restore again; step {restored} is the latest that can be read."
    )
  manager.reload()
  described = "; ".join(
    f"step {step} ({str(error).splitlines()[0][:200]}) moved to {target}"
    for (step, error), (_, target) in zip(damaged, moves, strict=True)
  )
  warnings.warn(
    f"damaged checkpoint(s) in {manager.directory}: {described}. Restored step {restored}, the "
    "latest that can be read.",
    stacklevel=3,
  )


def _aside(source: epath.Path) -> tuple[epath.Path, epath.Path]:
  """``source`` and a free name beside it: ``<name>.damaged``, else ``.damaged2``, ..."""
  target, count = source.with_name(f"{source.name}.damaged"), 1
  while target.exists():
    count += 1
    target = source.with_name(f"{source.name}.damaged{count}")
  return source, target
