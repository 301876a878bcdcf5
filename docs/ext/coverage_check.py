"""Sphinx extension: every public name is documented, with an example.

The public names are the ``__all__`` of a package and of each of its public
submodules (those whose names do not start with ``_``), so a module added later
is checked without touching this file. A name counts as documented when the
site has an entry for it (``.. autofunction::`` and friends in api.md), and as
having an example when that entry shows code (a ``>>>`` example or a code block;
a constant's entry shows its value, which is example enough).
Anything missing is a warning that names it, and ``sphinx -W`` makes it an error.

Unlike optax's ``coverage_check`` builder, this runs inside the HTML build, so one
``python -m sphinx -W -b html`` both builds the site and checks it.
"""

import importlib
import pkgutil
from types import ModuleType

from docutils import nodes
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment
from sphinx.util import logging

logger = logging.getLogger(__name__)


def public_modules(package: str) -> list[ModuleType]:
  """The package and its submodules, at any depth, no part of whose names starts with ``_``."""
  root = importlib.import_module(package)
  names = []
  for info in pkgutil.iter_modules(root.__path__):
    if info.name.startswith("_"):
      continue
    names.append(f"{package}.{info.name}")
    if info.ispkg:  # zerojax.flax: its modules, zerojax.flax.linen and zerojax.flax.nnx
      names.extend(module.__name__ for module in public_modules(names[-1])[1:])
  return [root, *(importlib.import_module(name) for name in sorted(names))]


def public_names(package: str) -> list[str]:
  """Fully qualified ``module.name`` for every name in a public module's ``__all__``."""
  names = []
  for module in public_modules(package):
    if not hasattr(module, "__all__"):
      logger.warning(
        "%s has no __all__: define it so the docs know which of its names are public",
        module.__name__,
        type="coverage_check",
      )
      continue
    names.extend(f"{module.__name__}.{name}" for name in module.__all__)
  return names


def _shows_code(content: nodes.Element) -> bool:
  """Whether an entry's own content (not its members') has a code example."""
  for child in content.children:
    if isinstance(child, addnodes.desc):
      continue
    if isinstance(child, nodes.doctest_block | nodes.literal_block):
      return True
    if isinstance(child, nodes.Element) and _shows_code(child):
      return True
  return False


def _record_examples(app: Sphinx, doctree: nodes.document) -> None:
  """Notes which documented Python objects of this page show an example."""
  with_example = app.env.coverage_check_examples.setdefault(app.env.docname, set())
  for desc in doctree.findall(addnodes.desc):
    if desc.get("domain") != "py":
      continue
    content = next(iter(desc.findall(addnodes.desc_content)), None)
    if content is None or not _shows_code(content):
      continue
    for signature in desc.findall(addnodes.desc_signature):
      if signature.get("fullname"):
        with_example.add(f"{signature['module']}.{signature['fullname']}".lstrip("."))


def _init_env(app: Sphinx, env: BuildEnvironment, docnames: list[str]) -> list[str]:
  if not hasattr(env, "coverage_check_examples"):
    env.coverage_check_examples = {}
  return []


def _purge_doc(app: Sphinx, env: BuildEnvironment, docname: str) -> None:
  env.coverage_check_examples.pop(docname, None)


def _merge(app: Sphinx, env: BuildEnvironment, docnames, other: BuildEnvironment) -> None:
  for docname in docnames:
    env.coverage_check_examples[docname] = other.coverage_check_examples[docname]


def check_coverage(app: Sphinx, env: BuildEnvironment) -> None:
  """Warns about each public name without an entry, or with an entry but no example."""
  documented = env.get_domain("py").objects
  with_example = set().union(*env.coverage_check_examples.values())
  for package in app.config.coverage_check_packages:
    for name in public_names(package):
      if name not in documented:
        logger.warning(
          "public name %s is not documented: add it to api.md (e.g. `.. autofunction:: %s`)",
          name,
          name,
          type="coverage_check",
        )
      elif name not in with_example and documented[name].objtype != "data":
        logger.warning(
          "public name %s has no example: give its docstring an `Example:` section",
          name,
          type="coverage_check",
          location=documented[name].docname,
        )


def setup(app: Sphinx) -> dict:
  app.add_config_value("coverage_check_packages", [], "env", types=frozenset({list}))
  app.connect("env-before-read-docs", _init_env)
  app.connect("env-purge-doc", _purge_doc)
  app.connect("env-merge-info", _merge)
  app.connect("doctree-read", _record_examples)
  app.connect("env-check-consistency", check_coverage)
  return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
