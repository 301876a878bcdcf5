"""A package's public names, imported from their modules when first used (PEP 562).

``import zerojax`` then costs nothing until a name is read, so that the command
lines that need no JAX (``python -m zerojax.launch``, which only starts and
watches processes) start without importing it.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any


def attach(
  namespace: dict[str, Any], fallback: Callable[[str], Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
  """``__getattr__`` and ``__dir__`` for the module whose globals are ``namespace``.

  The names are those its ``if TYPE_CHECKING:`` block imports, which type
  checkers read and which never runs: so each is written once. A name imported
  ``from`` the package itself is its submodule.

  Args:
    namespace: the package's ``globals()``; each name is stored there once read.
    fallback: called with any other name (to raise ``AttributeError``).

  Example:
    >>> import zerojax
    >>> zerojax.__getattr__("zero3").__module__
    'zerojax._src.zero'
  """
  package = namespace["__name__"]
  where = _type_checking_imports(Path(namespace["__file__"]).read_text())

  def find(name: str) -> Any:
    if name not in where:
      return fallback(name)
    module = where[name]
    if module == package:
      value = importlib.import_module(f"{package}.{name}")
    else:
      value = getattr(importlib.import_module(module), name)
    namespace[name] = value
    return value

  return find, lambda: sorted({*namespace, *where})


def _type_checking_imports(source: str) -> dict[str, str]:
  """Every ``name -> module`` that the ``if TYPE_CHECKING:`` blocks of ``source`` import."""
  where = {}
  for node in ast.parse(source).body:
    if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
      for statement in node.body:
        if isinstance(statement, ast.ImportFrom) and statement.module:
          where.update((alias.asname or alias.name, statement.module) for alias in statement.names)
  return where
