"""Names that moved out of the top-level ``zerojax`` namespace, still found there for a release."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def moved_names(package: str, moved: dict[str, str]) -> Callable[[str], Any]:
  """A module ``__getattr__`` that finds each moved name in its new module, with a warning.

  Args:
    package: the module whose attributes moved (``"zerojax"``).
    moved: the old name -> the module it lives in now (``"zerojax.diagnostics"``).

  Example:
    >>> import warnings
    >>> find = moved_names("pkg", {"profile": "zerojax.diagnostics"})
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   found = find("profile")
    >>> found.__module__, str(caught[0].message).split(";")[0]
    ('zerojax._src.profile', 'pkg.profile moved to zerojax.diagnostics.profile')
  """

  def find(name: str) -> Any:
    if name not in moved:
      raise AttributeError(f"module {package!r} has no attribute {name!r}")
    warnings.warn(
      f"{package}.{name} moved to {moved[name]}.{name}; the old name goes in the next release.",
      DeprecationWarning,
      stacklevel=2,
    )
    return getattr(importlib.import_module(moved[name]), name)

  return find
