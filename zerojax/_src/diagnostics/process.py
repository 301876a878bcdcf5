"""A process that compiles for a deviceless target, running functions it is handed by name.

The compilers read their environment when they load, so compiling for an
H100 node or a TPU slice takes a process started with
``deviceless_environment(target)``, one platform a process. A
``DevicelessProcess`` starts one and keeps it: each ``call`` names a function
(``"module:function"``, or ``"path/to/file.py:function"`` as a script would
run, its folder on the path), sends it JSON arguments over the process's
standard input, and returns what it returns, as JSON. The planner's workers
and the benchmarks compile this way.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from zerojax._src.diagnostics import deviceless

#: The name of the machine a process runs on, for functions that also compile for it here.
LOCAL = "local"
#: Marks an answer among whatever else a compiler prints to standard output.
_ANSWER = "zerojax-deviceless-answer: "


def find(ref: str) -> Any:
  """The object ``ref`` names: ``"module:name"``, or ``"path/to/file.py:name"``.

  A file is loaded once per process as a module of its own, with its folder
  first on ``sys.path`` (as ``python path/to/file.py`` has it), so that it
  may import the modules beside it.

  Raises:
    ValueError: if ``ref`` names no module, file or attribute.

  Example:
    >>> from zerojax.diagnostics import find_by_name
    >>> find_by_name("zerojax.diagnostics:deviceless_target")("v5e-8").platform
    'tpu'
  """
  where, _, attribute = ref.rpartition(":")
  if not where or not attribute:
    raise ValueError(f"{ref!r}: name it as 'module:name' or 'path/to/file.py:name'.")
  if where.endswith(".py"):
    path = os.path.abspath(where)
    if not os.path.exists(path):
      raise ValueError(f"{ref!r}: there is no file {where!r}.")
    name = "zerojax_file_" + hashlib.sha256(path.encode()).hexdigest()[:12]
    module = sys.modules.get(name)
    if module is None:
      folder = os.path.dirname(path)
      if folder not in sys.path:
        sys.path.insert(0, folder)
      spec = importlib.util.spec_from_file_location(name, path)
      if spec is None or spec.loader is None:
        raise ValueError(f"{ref!r}: {where!r} is not a Python file.")
      module = importlib.util.module_from_spec(spec)
      sys.modules[name] = module
      spec.loader.exec_module(module)
  else:
    try:
      module = importlib.import_module(where)
    except ImportError as error:
      raise ValueError(f"{ref!r}: cannot import {where!r} ({error}).") from error
  if not hasattr(module, attribute):
    raise ValueError(f"{ref!r}: {where!r} has no {attribute!r}.")
  return getattr(module, attribute)


#: The module each platform's compiler comes in, for a clear error where it is missing.
_COMPILERS = {"cuda": "jax_cuda12_plugin", "tpu": "libtpu"}


def _check_compiler(target: deviceless.DevicelessTarget) -> None:
  module = _COMPILERS[target.platform]
  if importlib.util.find_spec(module) is None:
    raise ValueError(
      f"compiling for {target.name} needs the {target.platform} compiler ({module}), which is "
      'not installed: pip install "zerojax[accelerators]" (no GPU or TPU needed).'
    )


class DevicelessProcess:
  """A process compiling for ``target``, which runs the functions ``call`` names.

  Args:
    target: one of ``DEVICELESS_TARGETS``; ``"local"`` runs the calls in this
      process instead.
    xla_flags: ``XLA_FLAGS`` to compile with (``deviceless_environment``'s).
    scheduler_log: on GPU, have XLA log its scheduler's estimate (read it
      with ``capture_stderr`` and ``scheduler_estimate`` in the function).

  Raises:
    ValueError: for an unknown target, or one whose compiler is not installed
      (``pip install "zerojax[accelerators]"``).

  The process's only JAX platform is the CPU: the target's devices come from
  its topology (``deviceless_mesh``), and arrays that a module makes when
  imported live on the CPU. Its working directory's modules are importable.

  Example:
    >>> from zerojax.diagnostics import DevicelessProcess
    >>> with DevicelessProcess("local") as process:
    ...   process.call("math:comb", 5, 2)
    10

    With a deviceless target the function runs in the process, and its
    arguments and result travel as JSON::

      with DevicelessProcess("v5e-8") as process:
        result = process.call("benchmarks/accelerators.py:compile_cell", "zero3 scan")
  """

  def __init__(self, target: str, *, xla_flags: str = "", scheduler_log: bool = True):
    self.target = target
    self._process = None
    if target == LOCAL:
      return
    _check_compiler(deviceless.find_target(target))
    environment = {
      **os.environ,
      **deviceless.environment(target, scheduler_log=scheduler_log, xla_flags=xla_flags),
      "JAX_PLATFORMS": "cpu",
    }
    environment["PYTHONPATH"] = os.pathsep.join(
      [os.getcwd(), *filter(None, [environment.get("PYTHONPATH")])]
    )
    # The process's last words, if it dies; closed in close().
    self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
    self._process = subprocess.Popen(
      [sys.executable, "-m", "zerojax._src.diagnostics.process"],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=self._log,
      env=environment,
      text=True,
    )

  def call(self, ref: str, *args: Any) -> Any:
    """``find_by_name(ref)(*args)`` in the process; arguments and result as JSON.

    Raises:
      RuntimeError: if the function raises (its error is in the message) or the
        process dies (its last words are).
    """
    process = self._process
    if process is None:
      return json.loads(json.dumps(find(ref)(*args)))
    assert process.stdin is not None and process.stdout is not None  # opened as pipes
    process.stdin.write(json.dumps({"call": ref, "args": args}) + "\n")
    process.stdin.flush()
    printed = []
    for line in process.stdout:
      if line.startswith(_ANSWER):
        answer = json.loads(line.removeprefix(_ANSWER))
        if "error" in answer:
          raise RuntimeError(f"{ref} for {self.target}: {answer['error']}")
        return answer["result"]
      printed.append(line)
    self._log.seek(0)
    last_words = [*self._log.read().splitlines()[-20:], *printed[-5:]]
    raise RuntimeError(
      f"the process compiling for {self.target} died in {ref} (exit {process.wait()}):\n"
      + "\n".join(last_words)
    )

  def close(self) -> None:
    """Ends the process."""
    process, self._process = self._process, None
    if process is not None:
      assert process.stdin is not None and process.stdout is not None  # opened as pipes
      with contextlib.suppress(BrokenPipeError):  # a process that died has said why already
        process.stdin.close()
      process.wait()
      process.stdout.close()
      self._log.close()

  def __enter__(self) -> DevicelessProcess:
    return self

  def __exit__(self, *exc_info: object) -> None:
    self.close()


def _serve() -> None:
  """The process's loop: a call a line in, its result a line out."""
  for line in sys.stdin:
    request = json.loads(line)
    try:
      answer = {"result": find(request["call"])(*request["args"])}
    except Exception as error:  # reported to the caller, which raises it there
      answer = {"error": f"{type(error).__name__}: {error}"}
    print(_ANSWER + json.dumps(answer), flush=True)


if __name__ == "__main__":
  _serve()
