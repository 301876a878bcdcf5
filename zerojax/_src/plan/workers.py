"""What the planner's worker processes compile, found by reference, and what they showed.

A process compiles for one platform (the compilers read their environment
when they load), so a plan hands candidates to ``DevicelessProcess`` es, which
call ``compile_json`` with the program's reference (``"module:name"`` or
``"path/to/file.py:name"``): a ``Program`` must be defined at the top level
of a module. Outcomes are cached on disk by (program, its source, target,
setup, versions), so a second plan compiles only what is new.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import json
import os
import pathlib
import sys
import threading
from typing import Any

from zerojax._src.diagnostics import process
from zerojax._src.plan import program as program_lib
from zerojax._src.plan.compile import Outcome, compile_setup
from zerojax._src.plan.setup import Setup


def reference(program: program_lib.Program | str) -> str:
  """How a worker process finds ``program``: ``"module:name"`` or ``"file.py:name"``.

  Raises:
    ValueError: if ``program`` is not a top-level name of any imported module.
  """
  if isinstance(program, str):
    return program
  for name, module in list(sys.modules.items()):
    for attribute, value in list(getattr(module, "__dict__", {}).items()):
      if value is program:
        file = getattr(module, "__file__", None)
        if name == "__main__" and file:
          return f"{os.path.abspath(file)}:{attribute}"
        return f"{name}:{attribute}"
  raise ValueError(
    f"cannot find program {program.name!r} at the top level of any module: the planner "
    "compiles in worker processes that import it, so define the Program at a module's top "
    "level, or pass 'module:name' or 'path/to/file.py:name'."
  )


def load(ref: str) -> program_lib.Program:
  """The ``Program`` that ``reference`` named (called if it is a function making one).

  Raises:
    ValueError: if ``ref`` names nothing, or something that is not a ``Program``.
  """
  found = process.find(ref)
  found = found() if callable(found) and not isinstance(found, program_lib.Program) else found
  if not isinstance(found, program_lib.Program):
    raise ValueError(
      f"program {ref!r} is {type(found).__name__}, not a zerojax.planning.Program "
      "(or a function of no arguments returning one)."
    )
  return found


def source_digest(ref: str) -> str:
  """A digest of the file that defines ``ref`` 's program: a changed program compiles again."""
  where = ref.rpartition(":")[0]
  path = where if where.endswith(".py") else importlib.import_module(where).__file__
  return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()[:16] if path else ""


def _zerojax_digest() -> str:
  """A digest of zerojax's own source: a changed zerojax (the step it builds, the estimates it
  reads) compiles again, between releases too."""
  root = pathlib.Path(__file__).resolve().parents[2]
  digest = hashlib.sha256()
  for path in sorted(root.rglob("*.py")):
    digest.update(path.read_bytes())
  return digest.hexdigest()[:16]


class Cache:
  """One plan's outcomes on disk: a JSON file per setup, named by the setup and by what else
  decides the outcome (the program and its file's contents, the target, the versions, and
  zerojax's own source), read once when the cache is made.

  Args:
    directory: where the files go; ``None`` keeps nothing.
    ref: the program's reference.
    target: the machine.
  """

  def __init__(self, directory: str | os.PathLike | None, ref: str, target: str):
    self.directory = None
    if directory is None:
      return
    import jax

    self.directory = pathlib.Path(directory)
    versions = [jax.__version__, importlib.metadata.version("zerojax"), _zerojax_digest()]
    self._identity = [ref, source_digest(ref), target, *versions]

  def _path(self, setup: Setup) -> pathlib.Path:
    assert self.directory is not None  # get and put return early without one
    key = json.dumps([*self._identity, setup.to_json()], sort_keys=True)
    return self.directory / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"

  def get(self, setup: Setup) -> Outcome | None:
    """The cached outcome, if any."""
    if self.directory is None:
      return None
    path = self._path(setup)
    return Outcome.from_json(json.loads(path.read_text())) if path.exists() else None

  def put(self, outcome: Outcome) -> None:
    """Keeps ``outcome`` (written whole, then renamed into place)."""
    if self.directory is None:
      return
    self.directory.mkdir(parents=True, exist_ok=True)
    path = self._path(outcome.setup)
    partial = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    partial.write_text(json.dumps(outcome.to_json()))
    partial.replace(path)


def compile_json(ref: str, setup: dict[str, Any], target: str) -> dict[str, Any]:
  """``compile_setup`` by reference and in JSON, for a ``DevicelessProcess`` to call."""
  return compile_setup(load(ref), Setup(**setup), target).to_json()
