"""A directory of checkpoints on disk: Orbax's manager for it, and moving damaged ones aside."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from zerojax._src import checkpoint_verdict as verdict_lib

_STANDARD = ocp.step.standard_name_format()


def open_manager(directory: str | os.PathLike, **options: Any) -> ocp.CheckpointManager:
  """An Orbax manager for zerojax's two items: ``state`` (arrays) and ``layout`` (JSON).

  Args:
    directory: the checkpoints' directory.
    **options: ``ocp.CheckpointManagerOptions``.
  """
  return ocp.CheckpointManager(
    os.path.abspath(directory),
    options=ocp.CheckpointManagerOptions(**options),
    item_handlers={
      "state": ocp.PyTreeCheckpointHandler(),
      "layout": ocp.JsonCheckpointHandler(),
    },
  )


def step_directory(manager: ocp.CheckpointManager, step: int) -> epath.Path:
  """Where ``manager`` keeps checkpoint ``step``."""
  return epath.Path(manager.directory) / _STANDARD.build_name(step)


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
      raise FileNotFoundError(f"no checkpoints in {manager.directory}.")
    step = steps[-1]
  if step not in steps:
    raise FileNotFoundError(
      f"no checkpoint for step {step} in {manager.directory} (it has steps {steps})."
    )
  try:
    layout = ocp.JsonCheckpointHandler().restore(step_directory(manager, step) / "layout")
  except (FileNotFoundError, ValueError) as error:
    raise FileNotFoundError(
      f"checkpoint step {step} in {manager.directory} has no readable layout "
      f"record ({error}); it is damaged: restore another step."
    ) from error
  return step, layout


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
