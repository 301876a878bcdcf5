"""Sphinx extension: a re-exported constant is documented by its ``#:`` comment.

autodoc reads a constant's ``#:`` comment from the module the entry names
(``zerojax.distributed``), but the public modules import their constants from
``zerojax._src``, where the comments are; without one autodoc shows the value's
type's docstring (``int([x]) -> integer ...``). This takes the comment from the
``zerojax._src`` module that assigns the name, and warns (an error under
``sphinx -W``) when there is none, so that no entry shows ``int``'s docstring.
"""

import functools
import pkgutil
from typing import Any

from sphinx.application import Sphinx
from sphinx.pycode import ModuleAnalyzer
from sphinx.util import logging

import zerojax._src
import zerojax_launch

logger = logging.getLogger(__name__)


def source_modules() -> list[str]:
  """The modules of ``zerojax._src`` and the launcher's package, without the tests beside them.

  The ``*_test`` modules import pytest, which the docs extra does not install.
  """
  packages = ((zerojax._src, "zerojax._src."), (zerojax_launch, "zerojax_launch."))
  return [
    info.name
    for package, prefix in packages
    for info in pkgutil.walk_packages(package.__path__, prefix)
    if not info.name.endswith("_test")
  ]


@functools.cache
def source_comments() -> dict[str, list[str]]:
  """``name -> lines`` of every module-level ``#:`` comment in ``source_modules()``."""
  found = {}
  for module in source_modules():
    docs = ModuleAnalyzer.for_module(module).find_attr_docs()
    found.update((name, list(lines)) for (scope, name), lines in docs.items() if not scope)
  return found


def document_constant(
  app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
  if what != "data" or type(obj).__doc__ is None:
    return
  own = "\n".join(lines).strip()
  if own and own != type(obj).__doc__.strip():
    return  # documented where the entry names it
  comment = source_comments().get(name.rpartition(".")[2])
  if comment is None:
    logger.warning("%s has no #: comment in zerojax._src to document it", name)
    return
  lines[:] = comment


def setup(app: Sphinx) -> dict:
  app.connect("autodoc-process-docstring", document_constant)
  return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
