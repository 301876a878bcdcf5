"""Compiling candidates in worker processes, and remembering what they showed.

A process compiles for one platform (the compilers read their environment
when they load), so a plan starts worker processes with
``zerojax.diagnostics.deviceless_environment(target)`` and hands each one
candidate at a time over its standard input; each answers with one line of
JSON. Workers import the program by reference (``"module:name"`` or
``"path/to/file.py:name"``), which is why a ``Program`` must be defined at
the top level of a module. Outcomes are cached on disk by (program, its
source, target, setup, versions), so a second plan compiles only what is new.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
from typing import Any

from zerojax._src.diagnostics import deviceless
from zerojax._src.plan import program as program_lib
from zerojax._src.plan.compile import LOCAL, Outcome, compile_setup
from zerojax._src.plan.setup import Setup

#: Marks a worker's answer among whatever else a compiler prints to standard output.
_ANSWER = "zerojax-plan-outcome: "


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
        if name == "__main__":
          return f"{os.path.abspath(module.__file__)}:{attribute}"
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
  where, _, attribute = ref.rpartition(":")
  if not where or not attribute:
    raise ValueError(f"program {ref!r}: name it as 'module:name' or 'path/to/file.py:name'.")
  if where.endswith(".py"):
    name = "zerojax_plan_" + hashlib.sha256(where.encode()).hexdigest()[:12]
    module = sys.modules.get(name)
    if module is None:
      spec = importlib.util.spec_from_file_location(name, where)
      if spec is None or not os.path.exists(where):
        raise ValueError(f"program {ref!r}: there is no file {where!r}.")
      module = importlib.util.module_from_spec(spec)
      sys.modules[name] = module
      spec.loader.exec_module(module)
  else:
    module = importlib.import_module(where)
  found = getattr(module, attribute, None)
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


class Cache:
  """Outcomes on disk, one JSON file per (program, source, target, setup, versions).

  Args:
    directory: where the files go; ``None`` keeps nothing.
  """

  def __init__(self, directory: str | os.PathLike | None):
    self.directory = pathlib.Path(directory) if directory is not None else None

  def _path(self, ref: str, target: str, setup: Setup) -> pathlib.Path:
    import jax

    versions = [jax.__version__, importlib.metadata.version("zerojax")]
    key = json.dumps(
      [ref, source_digest(ref), target, setup.to_json(), *versions],
      sort_keys=True,
    )
    return self.directory / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"

  def get(self, ref: str, target: str, setup: Setup) -> Outcome | None:
    """The cached outcome, if any."""
    if self.directory is None:
      return None
    path = self._path(ref, target, setup)
    return Outcome.from_json(json.loads(path.read_text())) if path.exists() else None

  def put(self, ref: str, target: str, outcome: Outcome) -> None:
    """Keeps ``outcome`` (written whole, then renamed into place)."""
    if self.directory is None:
      return
    self.directory.mkdir(parents=True, exist_ok=True)
    path = self._path(ref, target, outcome.setup)
    partial = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    partial.write_text(json.dumps(outcome.to_json()))
    partial.replace(path)


class Worker:
  """A process that compiles candidates for one target, one at a time.

  For ``"local"`` it compiles in this process instead.
  """

  def __init__(self, ref: str, target: str):
    self.ref, self.target = ref, target
    self._process = None
    if target != LOCAL:
      environment = {**os.environ, **deviceless.environment(target)}
      # The target's devices come from its topology, whatever the platforms; with the CPU
      # as the only one, arrays a program's module makes when imported live there.
      environment["JAX_PLATFORMS"] = "cpu"
      environment["PYTHONPATH"] = os.pathsep.join(
        [os.getcwd(), *filter(None, [environment.get("PYTHONPATH")])]
      )
      # The worker's last words, if it dies; closed in close().
      self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
      self._process = subprocess.Popen(
        [sys.executable, "-m", "zerojax._src.plan.workers", ref, target],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=self._log,
        env=environment,
        text=True,
      )

  def compile(self, setup: Setup) -> Outcome:
    """``compile_setup`` of ``setup`` in the worker's process.

    Raises:
      RuntimeError: if the worker process dies (its last words are in the error).
    """
    if self._process is None:
      return compile_setup(load(self.ref), setup, self.target)
    self._process.stdin.write(json.dumps(setup.to_json()) + "\n")
    self._process.stdin.flush()
    lines = []
    for line in self._process.stdout:
      if line.startswith(_ANSWER):
        answer = json.loads(line.removeprefix(_ANSWER))
        if "crash" in answer:
          raise RuntimeError(f"compiling {setup.describe()} for {self.target}: {answer['crash']}")
        return Outcome.from_json(answer)
      lines.append(line)
    self._log.seek(0)
    last_words = [*self._log.read().splitlines()[-20:], *lines[-5:]]
    raise RuntimeError(
      f"the worker compiling {setup.describe()} for {self.target} died "
      f"(exit {self._process.wait()}):\n" + "\n".join(last_words)
    )

  def close(self) -> None:
    """Ends the worker's process."""
    if self._process is not None:
      with contextlib.suppress(BrokenPipeError):  # a worker that died has said why already
        self._process.stdin.close()
      self._process.wait()
      self._process.stdout.close()
      self._log.close()


def _serve(ref: str, target: str) -> None:
  """The worker's loop: a setup a line in, an outcome a line out."""
  program = load(ref)
  for line in sys.stdin:
    setup = Setup(**json.loads(line))
    try:
      answer: dict[str, Any] = compile_setup(program, setup, target).to_json()
    except Exception as error:  # reported to the planner, which raises it there
      answer = {"crash": f"{type(error).__name__}: {error}"}
    print(_ANSWER + json.dumps(answer), flush=True)


if __name__ == "__main__":
  _serve(*sys.argv[1:3])
