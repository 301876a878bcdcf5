"""The documentation: its snippets print what their pages show, and the site's checks work.

Every snippet that prints is run by a test (``test_every_snippet_that_prints_is_run``), the way
its page says to run it, and shows what it prints: in a comment after each print (or in comment
lines under it, one a printed line), or, for a snippet whose prints have no comments, in the
```` ```text ```` block after it. A snippet whose first line names a file (``# train.py``)
followed by a console block (``$ command``, then its output) that runs that file is run by that
command; one whose opening comment names a deviceless target (``deviceless_environment("h100x8")``)
runs in a process started with that environment; any other on 8 CPU devices.

CI builds the real site with ``python -m sphinx -W --keep-going -b html docs docs/_build``
(.ci/run) and so shows that the site as it is passes; these tests break a copy of it on
purpose and show that the same command fails, naming what is wrong.
"""

import ast
import dataclasses
import functools
import io
import itertools
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import tokenize

import pytest

import zerojax
import zerojax.flax.linen
import zerojax.flax.nnx
from tests import environment
from tests.environment import ROOT
from zerojax.diagnostics import deviceless_environment

DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "ext"))

import constant_docs  # noqa: E402
import coverage_check  # noqa: E402
import internal_links  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Block:
  """A fenced block of a page: its info string ("python", "text", ...), first line and text."""

  page: str
  line: int
  info: str
  text: str

  def __str__(self) -> str:
    return f"{self.page}:{self.line}"


#: README.md (the site's front page) and the site's pages.
PAGES = ("README.md", *sorted(path.name for path in DOCS.glob("*.md")))
FENCE = re.compile(r"^( *)(```+)([^\n`]*)\n(.*?)^\1\2 *$", flags=re.MULTILINE | re.DOTALL)


@functools.cache
def blocks(page: str) -> tuple[Block, ...]:
  """The fenced blocks of ``page``, in order, dedented (a block may be in a list)."""
  text = (ROOT / page if page == "README.md" else DOCS / page).read_text()
  return tuple(
    Block(page, text.count("\n", 0, found.start()) + 1, found[3].strip(), textwrap.dedent(found[4]))
    for found in FENCE.finditer(text)
  )


def following(block: Block) -> Block | None:
  """The page's next block after ``block``."""
  page = blocks(block.page)
  rest = page[page.index(block) + 1 :]
  return rest[0] if rest else None


def is_console(block: Block | None) -> bool:
  """A console session: ``$ command``, then what the command prints."""
  return block is not None and block.info in ("text", "console") and block.text.startswith("$ ")


def prints(block: Block) -> bool:
  """Whether ``block`` shows something printing: Python that calls ``print``, a ``>>>``
  session, a shell command that runs Python that prints, or a console session."""
  if ">>>" in block.text or is_console(block):
    return True
  shell_python = block.info in ("bash", "sh", "shell") and re.search(
    r"\bpython3? +(-c|- *<<)", block.text
  )
  return (block.info == "python" or bool(shell_python)) and "print(" in block.text


def comments(source: str) -> dict[int, tuple[bool, str]]:
  """Each comment of Python ``source`` by its line: whether code comes before it on the line,
  and its text."""
  found = {}
  for token in tokenize.generate_tokens(io.StringIO(source).readline):
    if token.type == tokenize.COMMENT:
      code = bool(token.line[: token.start[1]].strip())
      found[token.start[0]] = (code, token.string.removeprefix("#").strip())
  return found


def shown(block: Block) -> tuple[list[str], Block | None]:
  """What a Python block's prints print, as the page shows it, and the block that shows it:
  the comment after each print, or the comment lines right under it (one a printed line); for
  a block whose prints have no comments, the ``text`` block that follows it."""
  notes = comments(block.text)
  calls = [
    node.end_lineno
    for node in ast.walk(ast.parse(block.text))
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print"
  ]
  lines, silent = [], 0
  for end in sorted(calls):
    if notes.get(end, (False,))[0]:
      lines.append(notes[end][1])
      continue
    under = list(
      itertools.takewhile(lambda n: not notes.get(n, (True,))[0], itertools.count(end + 1))
    )
    lines += [notes[n][1] for n in under]
    silent += not under
  if not silent:
    return lines, None
  output = following(block)
  assert not lines and output and output.info == "text" and not is_console(output), (
    f"{block}: show what each print prints, in a comment after it (or comment lines under it), "
    "or for all of them, in a ```text block after the snippet"
  )
  return output.text.splitlines(), output


def saved_as(block: Block) -> str | None:
  """The file a snippet names on its first line (``# train.py``): it is saved as that."""
  named = re.match(r"# (\w+\.py)\b", block.text)
  return named and named[1]


@dataclasses.dataclass(frozen=True)
class Run:
  """A snippet to run as its page says, and what the page shows it prints."""

  blocks: tuple[Block, ...]  # the Python it runs, and any block showing what that prints
  script: str
  file: str  # the script is saved as this
  command: tuple[str, ...]  # "python" is this interpreter
  devices: int | None  # CPU devices, or the command's own choice
  variables: tuple[tuple[str, str], ...]  # more environment variables

  @property
  def shown(self) -> list[str]:
    if is_console(self.blocks[-1]):
      return self.blocks[-1].text.splitlines()[1:]
    return [line for block in self.blocks if block.info == "python" for line in shown(block)[0]]


def snippet_run(block: Block) -> Run:
  """How to run one printing block: ``python`` on 8 CPU devices; by the command of the console
  block after it, if that runs the file the snippet names; or, if its opening comment names a
  deviceless target, in a process started with ``deviceless_environment(target)``."""
  file = saved_as(block) or "snippet.py"
  session = following(block)
  if file != "snippet.py" and is_console(session):
    words = shlex.split(session.text.splitlines()[0].removeprefix("$ "))
    variables = list(itertools.takewhile(lambda word: re.match(r"[A-Z_]+=", word), words))
    if file in words:
      command = tuple(words[len(variables) :])
      pairs = tuple(tuple(word.split("=", 1)) for word in variables)
      return Run((block, session), block.text, file, command, None, pairs)
  opening = "".join(itertools.takewhile(lambda line: line.startswith("#"), block.text.splitlines()))
  target = re.search(r'deviceless_environment\("([\w-]+)"\)', opening)
  output = shown(block)[1]
  runs = (block, output) if output else (block,)
  if target:
    variables = tuple(deviceless_environment(target[1]).items())
    return Run(runs, block.text, file, ("python", file), None, variables)
  return Run(runs, block.text, file, ("python", file), 8, ())


def page_runs(page: str) -> list[Run]:
  """The runs of a page of ``PRINTING_PAGES``."""
  python = [block for block in blocks(page) if block.info == "python"]
  if PRINTING_PAGES[page] == "blocks":
    return [snippet_run(block) for block in python if "print(" in block.text]
  outputs = [output for block in python if (output := shown(block)[1])]
  script = "".join(block.text for block in python)
  return [Run((*python, *outputs), script, "snippet.py", ("python", "snippet.py"), 8, ())]


#: The pages whose Python snippets that print are run: each printing block alone, as
#: ``snippet_run`` says; or, for a page whose blocks continue one another, the whole page, on
#: 8 CPU devices. README's Quickstart has a test of its own.
PRINTING_PAGES = {
  "guide.md": "blocks",
  "flax.md": "blocks",
  "checkpoints.md": "page",
  "loading.md": "blocks",
  "accounting.md": "page",
  "performance.md": "blocks",
  "multiprocess.md": "blocks",
  "troubleshooting.md": "blocks",
  "big_models.md": "page",
}
RUNS = {f"{page}-{i}": run for page in PRINTING_PAGES for i, run in enumerate(page_runs(page))}


def assert_prints_what_is_shown(printed: list[str], shown: list[str], where: object) -> None:
  """``...`` as the first line shown stands for the beginning of the output."""
  if shown[:1] == ["..."]:
    shown, printed = shown[1:], printed[len(printed) - len(shown) + 1 :]
  assert printed == shown, f"{where} prints (left) another thing than it shows (right)"


@pytest.mark.parametrize("name", RUNS)
def test_docs_snippets_print_what_their_pages_show(name, tmp_path):
  # Run as pasted, but with the files the docs put in /tmp in a directory of the test's own.
  run = RUNS[name]
  (tmp_path / run.file).write_text(run.script.replace('"/tmp/', f'"{tmp_path}/'))
  done = subprocess.run(
    [sys.executable if word == "python" else word for word in run.command],
    cwd=tmp_path,
    env=environment.subprocess_env(devices=run.devices, **dict(run.variables)),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 0, done.stderr[-5000:]
  assert_prints_what_is_shown(done.stdout.splitlines(), run.shown, run.blocks[0])


def quickstart() -> Block:
  """README's Quickstart: the first Python block under its heading."""
  heading = (ROOT / "README.md").read_text().split("\n## Quickstart\n")[0].count("\n") + 2
  return next(b for b in blocks("README.md") if b.info == "python" and b.line > heading)


def test_readme_quickstart_runs_as_pasted_and_the_loss_falls(tmp_path):
  snippet = quickstart().text
  script = tmp_path / "quickstart.py"
  # Run as pasted, in a fresh process, under XLA's own flags rather than the tests'
  # fast-compile ones (its 100 steps run faster so); then say how many devices the mesh had.
  script.write_text(snippet + "\nprint('devices', mesh.size)\n")
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
  losses = {
    int(step): float(loss)
    for step, loss in (re.fullmatch(r"step (\d+): loss (\S+)", line).groups() for line in lines)
  }
  assert len(losses) == 5
  assert all(later < earlier for earlier, later in itertools.pairwise(losses.values()))
  assert losses[80] < losses[0] / 10
  # Its comment's "about 0.44 at step 0, 0.012 at step 80", to the significant digits it shows.
  comment = snippet.split("print(", 1)[1].splitlines()[0].split("# ", 1)[1]
  about = re.findall(r"([\d.]+) at step (\d+)", comment)
  assert len(about) == 2, comment
  for value, step in about:
    digits = len(value.lstrip("0."))
    assert float(f"{losses[int(step)]:.{digits}g}") == float(value), (comment, losses)


def offload_script() -> Block:
  """offload.md's measurement for a GPU or TPU host: Python piped to ``python -``."""
  return next(block for block in blocks("offload.md") if prints(block) and block.info == "bash")


def test_offload_s_accelerator_script_runs_here_at_a_smaller_size(tmp_path):
  # It moves 1 GiB per device and trains 268M parameters; on CPU devices, at these sizes, it
  # shows that it runs through and prints what offload.md says to expect.
  script = re.search(r"<<'EOF'\n(.*?\n)EOF\n", offload_script().text, re.DOTALL)[1]
  sizes = re.search(r"^LINK, LAYERS, WIDTH = .*$", script, re.MULTILINE)[0]
  (tmp_path / "offload.py").write_text(
    script.replace(sizes, "LINK, LAYERS, WIDTH = 2**16, 2, 256  # here")
  )
  done = subprocess.run(
    [sys.executable, "offload.py"],
    cwd=tmp_path,
    env=environment.subprocess_env(devices=8),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 0, done.stderr[-5000:]
  expected = re.search(r"Expect `(\[.*?\])` on the first line", (DOCS / "offload.md").read_text())
  number = r"\d+\.\d+"
  formats = [
    rf"cpu cpu {re.escape(expected[1])}",
    rf"per device: to host {number} GB/s, back {number} GB/s",
    rf"offload=None: {number} GiB in use",
    rf"offload=optimizer: {number} GiB in use",
    rf"step: {number} s, offloaded {number} s, ratio {number}",
  ]
  lines = done.stdout.splitlines()
  assert len(lines) == len(formats), done.stdout
  for line, form in zip(lines, formats, strict=True):
    assert re.fullmatch(form, line), (line, form)


#: Console blocks that another test module runs, by how they start (test modules do not import
#: one another): tests/test_estimate.py runs every documented ``python -m zerojax.estimate``.
RUN_ELSEWHERE = ("$ python -m zerojax.estimate ",)


def test_every_snippet_that_prints_is_run():
  ran = {block for run in RUNS.values() for block in run.blocks}
  ran |= {quickstart(), offload_script()}
  unrun = [
    block
    for page in PAGES
    for block in blocks(page)
    if prints(block) and block not in ran and not block.text.startswith(RUN_ELSEWHERE)
  ]
  assert not unrun, (
    f"no test runs these snippets that print: {', '.join(map(str, unrun))}. Add the page to "
    "PRINTING_PAGES (tests/test_docs.py's docstring says how a page shows what a snippet "
    "prints and how to run it)"
  )


def test_snippets_that_print_are_told_from_those_that_do_not():
  block = lambda info, text: Block("new.md", 1, info, text)
  assert prints(block("python", "x = 1\nprint(x)  # 1\n"))
  assert prints(block("python", ">>> 1 + 1\n2\n"))
  assert prints(block("text", "$ python -m zerojax.estimate --params 1e9\nGB per device:\n"))
  assert prints(block("bash", "python - <<'EOF'\nprint(1)\nEOF\n"))
  assert prints(block("bash", 'python -c "print(1)"\n'))
  assert not prints(block("python", "x = 1\n"))
  assert not prints(block("bash", "python examples/train_lm.py --model tiny\n"))
  assert not prints(block("text", "a diagram, or the error a command prints\n"))


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


def test_the_constants_comments_are_read_without_pytest():
  # The docs extra installs no pytest, which the *_test modules beside zerojax/_src import.
  code = "import sys; sys.modules['pytest'] = None; import constant_docs as c; "
  code += "print(len(c.source_comments()), len(c.source_modules()))"
  done = subprocess.run(
    [sys.executable, "-c", code],
    cwd=ROOT,
    env=environment.subprocess_env(PYTHONPATH=f"{ROOT}{os.pathsep}{DOCS / 'ext'}"),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  assert all(int(count) > 10 for count in done.stdout.split()), done.stdout


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
  # The site reads README.md (its front page) and CHANGELOG.md, and links to the examples.
  docs = tmp_path / "docs"
  shutil.copytree(DOCS, docs, ignore=shutil.ignore_patterns("_build"))
  shutil.copytree(ROOT / "examples", tmp_path / "examples")
  shutil.copy(ROOT / "README.md", tmp_path)
  shutil.copy(ROOT / "CHANGELOG.md", tmp_path)
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
