"""The documentation: README's Quickstart runs as pasted, and the site's checks catch mistakes.

CI builds the real site with ``python -m sphinx -W --keep-going -b html docs docs/_build``
(.ci/run) and so shows that the site as it is passes; these tests break a copy of it on
purpose and show that the same command fails, naming what is wrong.
"""

import itertools
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

import zerojax
import zerojax.flax.linen
import zerojax.flax.nnx
from tests import environment
from tests.environment import ROOT

DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "ext"))

import constant_docs  # noqa: E402
import coverage_check  # noqa: E402
import internal_links  # noqa: E402


def test_readme_quickstart_runs_as_pasted_and_the_loss_falls(tmp_path):
  readme = (ROOT / "README.md").read_text()
  quickstart = re.search(r"\n## Quickstart\n.*?\n```python\n(.*?)\n```\n", readme, re.DOTALL)
  script = tmp_path / "quickstart.py"
  # Run as pasted, in a fresh process, under XLA's own flags rather than the tests'
  # fast-compile ones (its 100 steps run faster so); then say how many devices the mesh had.
  script.write_text(quickstart.group(1) + "\nprint('devices', mesh.size)\n")
  done = subprocess.run(
    [sys.executable, str(script)],
    cwd=tmp_path,
    env={**os.environ, "XLA_FLAGS": ""},
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 0, done.stderr
  *lines, devices = done.stdout.splitlines()
  assert devices == "devices 8"
  losses = [float(re.fullmatch(r"step \d+: loss (\S+)", line).group(1)) for line in lines]
  assert len(losses) == 5
  assert all(later < earlier for earlier, later in itertools.pairwise(losses))
  assert losses[-1] < losses[0] / 10


#: The pages whose Python snippets that print are run, each in a fresh process on 8 CPU devices:
#: each printing block alone, or, for a page whose blocks continue one another, the whole page.
PRINTING_PAGES = {"guide.md": "blocks", "flax.md": "blocks", "checkpoints.md": "page"}


def printing_snippets(page: str) -> list[str]:
  """The Python blocks of ``page`` that call ``print``, dedented (a block may be in a list); or
  for a ``"page"`` page, all its Python blocks as one."""
  text = (DOCS / page).read_text()
  blocks = re.findall(r"^( *)```python\n(.*?)^\1```$", text, flags=re.MULTILINE | re.DOTALL)
  blocks = [textwrap.dedent(block) for _, block in blocks]
  if PRINTING_PAGES[page] == "page":
    return ["".join(blocks)]
  return [block for block in blocks if "print(" in block]


def shown(snippet: str) -> list[str]:
  """What a snippet's prints print, as its comments say: after the print, or on the next line."""
  lines = [*snippet.splitlines(), ""]
  return [
    line.split("# ", 1)[1].strip() if "# " in line else after.removeprefix("# ").strip()
    for line, after in itertools.pairwise(lines)
    if line.lstrip().startswith("print(")
  ]


SNIPPETS = [(page, i) for page in PRINTING_PAGES for i in range(len(printing_snippets(page)))]


@pytest.mark.parametrize(("page", "index"), SNIPPETS, ids=[f"{p}-{i}" for p, i in SNIPPETS])
def test_docs_snippets_print_what_their_comments_say(page, index, tmp_path):
  # Run as pasted, but with the files the docs put in /tmp in a directory of the test's own.
  snippet = printing_snippets(page)[index]
  script = tmp_path / "snippet.py"
  script.write_text(snippet.replace('"/tmp/', f'"{tmp_path}/'))
  done = subprocess.run(
    [sys.executable, str(script)],
    cwd=tmp_path,
    env=environment.subprocess_env(devices=8),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 0, done.stderr
  assert done.stdout.splitlines() == shown(snippet)


def test_public_names_cover_the_package_and_its_public_modules():
  names = coverage_check.public_names("zerojax")
  assert {f"zerojax.{name}" for name in zerojax.__all__} <= set(names)
  for module in (zerojax.diagnostics, zerojax.distributed, zerojax.flax.linen, zerojax.flax.nnx):
    assert {f"{module.__name__}.{name}" for name in module.__all__} <= set(names)
  assert {"zerojax.launch.launch", "zerojax.export.main", "zerojax.estimate.main"} <= set(names)
  assert not [name for name in names if "._" in name]


def test_a_re_exported_constant_shows_its_comment_not_its_type_s_docstring():
  def shown(name, value):
    lines = int.__doc__.splitlines()  # what autodoc finds in the public module
    constant_docs.document_constant(None, "data", name, value, None, lines)
    return " ".join(lines)

  assert "preempted, after saving" in shown("zerojax.distributed.PREEMPTED_EXIT_CODE", 75)
  assert "stay replicated" in shown("zerojax.DEFAULT_MIN_SHARD_SIZE", 1024)


def test_broken_internal_links_are_found(tmp_path):
  (tmp_path / "img").mkdir()
  (tmp_path / "img" / "plot.png").write_bytes(b"png")
  (tmp_path / "a.html").write_text(
    '<h1 id="top">A</h1><a href="#top">ok</a><a href="b.html#part">ok</a>'
    '<img src="img/plot.png"><a href="https://example.org/missing">external, not followed</a>'
    '<a href="#bottom">bad</a><a href="b.html#nowhere">bad</a><a href="c.html">bad</a>'
    '<img src="img/missing.png">'
  )
  (tmp_path / "b.html").write_text('<section id="part"><a href="a.html">ok</a></section>')
  assert [link for _, link, _ in internal_links.broken_links(tmp_path)] == [
    "#bottom",
    "b.html#nowhere",
    "c.html",
    "img/missing.png",
  ]


def test_site_build_fails_on_a_gap_in_the_reference_a_lost_page_and_broken_links(tmp_path):
  # The site reads README.md (its front page) and links to the examples.
  docs = tmp_path / "docs"
  shutil.copytree(DOCS, docs, ignore=shutil.ignore_patterns("_build"))
  shutil.copytree(ROOT / "examples", tmp_path / "examples")
  shutil.copy(ROOT / "README.md", tmp_path)
  api = (docs / "api.md").read_text()
  for entry, replacement in [
    (".. autofunction:: zero2\n", ""),  # zero2 is no longer documented
    # default_shard_dim is documented, but without its docstring's example
    (".. autofunction:: default_shard_dim\n", ".. function:: default_shard_dim(shape)\n"),
  ]:
    assert entry in api
    api = api.replace(entry, replacement)
  (docs / "api.md").write_text(api)
  (docs / "new_page.md").write_text("# A page nobody put in a toctree\n")
  with (docs / "guide.md").open("a") as guide:
    guide.write(
      "\n[a page that is not there](no_such_page.md), [a heading that is not there]"
      '(precision.md#no-such-heading), <a href="api.html#zerojax.no_such_name">raw HTML</a>\n'
    )
  build = subprocess.run(
    [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", docs, docs / "_b"],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert build.returncode != 0
  for message in [
    "public name zerojax.zero2 is not documented",
    "public name zerojax.default_shard_dim has no example",
    "'no_such_page.md'",
    "'no-such-heading'",
    "broken internal link 'api.html#zerojax.no_such_name' in guide.html",
    "new_page.md: WARNING: document isn't included in any toctree",
  ]:
    assert message in build.stderr, build.stderr
  # Nothing else is wrong with the copy: every warning is about one of the breakages.
  # (Not the C++ logger's own "WARNING: All log messages before absl::InitializeLog()", which
  # the CUDA plugin of the test extra prints in every process that imports jax, whatever
  # TF_CPP_MIN_LOG_LEVEL says.)
  levels = ("WARNING", "ERROR", "CRITICAL")
  warnings = [
    line
    for line in build.stderr.splitlines()
    if any(level in line for level in levels) and "absl::InitializeLog" not in line
  ]
  culprits = ("zero2", "default_shard_dim", "no_such", "no-such-heading", "new_page")
  assert all(any(culprit in line for culprit in culprits) for line in warnings), build.stderr
