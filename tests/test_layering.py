"""The map of modules in docs/design.md is the tree, and every import runs down its layers."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "zerojax" / "_src"
LAUNCHER = ROOT / "zerojax_launch"


def design_map() -> tuple[dict[str, int], list[str]]:
  """From docs/design.md's map: each folder's layer, and every module it lists."""
  text = (ROOT / "docs" / "design.md").read_text()
  block = text.split("## Data flows one way", 1)[1].split("```", 2)[1]
  layers = {m[1]: int(m[0]) for m in re.findall(r"^layer (\d+): (\w+)", block, re.M)}
  modules = re.findall(r"^(\S+\.py)\s", block, re.M)
  return layers, modules


def library_files() -> list[Path]:
  """The library's modules: a private helper's own tests (``*_test.py``, beside it) are not."""
  found = [*SOURCE.rglob("*.py"), *LAUNCHER.glob("*.py")]
  return [p for p in found if not p.name.endswith("_test.py")]


def tree_modules() -> list[str]:
  found = [
    f"zerojax_launch/{p.name}" if p.parent == LAUNCHER else str(p.relative_to(SOURCE))
    for p in library_files()
  ]
  return [m for m in found if not m.endswith(("__init__.py", "__main__.py"))]


def runtime_imports(path: Path) -> set[str]:
  """The zerojax modules ``path`` imports when it runs (not under ``if TYPE_CHECKING:``)."""
  found = set()

  def visit(node: ast.AST) -> None:
    if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
      return
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("zerojax"):
      found.update(f"{node.module}.{alias.name}" for alias in node.names)
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names if alias.name.startswith("zerojax"))
    for child in ast.iter_child_nodes(node):
      visit(child)

  visit(ast.parse(path.read_text()))
  return found


def folder_of(module: str) -> str:
  """``zerojax._src.comm.group.Group`` -> ``comm``; ``zerojax_launch.job`` -> ``zerojax_launch``."""
  parts = module.split(".")
  return parts[2] if parts[:2] == ["zerojax", "_src"] else parts[0]


def test_the_design_map_lists_every_module_once_and_nothing_else():
  layers, listed = design_map()
  assert sorted(listed) == sorted(tree_modules())
  assert len(set(listed)) == len(listed)
  folders = {p.name for p in SOURCE.iterdir() if p.is_dir() and p.name != "__pycache__"}
  assert folders == set(layers) - {"zerojax_launch"}


def test_imports_run_down_the_layers():
  layers, _ = design_map()
  upward = []
  for path in library_files():  # a test beside its module may import anything, as tests do
    here = "zerojax_launch" if path.parent == LAUNCHER else path.relative_to(SOURCE).parts[0]
    if here.endswith(".py"):
      continue  # zerojax/_src/__init__.py
    for module in runtime_imports(path):
      there = folder_of(module)
      if here == "zerojax_launch":
        ok = there == "zerojax_launch"
      else:
        ok = there == here or there == "zerojax_launch" or layers[there] < layers[here]
      if not ok:
        upward.append(f"{path.relative_to(ROOT)} imports {module}")
  assert not upward, "imports that run upward or sideways:\n" + "\n".join(upward)


def test_no_module_imports_itself_through_others():
  graph = {}
  for path in (p for p in library_files() if p.is_relative_to(SOURCE)):
    name = "zerojax._src." + ".".join(path.relative_to(SOURCE).with_suffix("").parts)
    graph[name] = {
      candidate
      for module in runtime_imports(path)
      for candidate in (module, module.rpartition(".")[0])
      if (SOURCE.parent.parent / (candidate.replace(".", "/") + ".py")).exists()
    }
  for start in graph:
    seen, frontier = set(), list(graph[start])
    while frontier:
      module = frontier.pop()
      assert module != start, f"{start} imports itself through others"
      if module not in seen:
        seen.add(module)
        frontier.extend(graph.get(module, ()))


def test_a_detour_upward_fails_the_layering_check(tmp_path, monkeypatch):
  # The check itself can fail: a comm module importing the core is caught.
  fake = tmp_path / "comm"
  fake.mkdir()
  (fake / "bad.py").write_text("from zerojax._src.core import settings\n")
  layers, _ = design_map()
  imported = runtime_imports(fake / "bad.py")
  assert any(layers[folder_of(m)] > layers["comm"] for m in imported)


def test_no_module_reaches_into_jax_privates():
  # A private import breaks on the next JAX release; pyproject.toml requires the JAX whose
  # public API has what zerojax needs.
  private = [
    f"{path.relative_to(ROOT)} imports {name}"
    for path in [*SOURCE.rglob("*.py"), *LAUNCHER.glob("*.py")]
    for node in ast.walk(ast.parse(path.read_text()))
    if isinstance(node, ast.Import | ast.ImportFrom)
    for name in (
      [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
    )
    if name.startswith("jax._src")
  ]
  assert not private, private
