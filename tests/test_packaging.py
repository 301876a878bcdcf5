"""The wheel a user installs: every module of the package, its data, and none of its tests."""

import pathlib
import shutil
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("zerojax", "zerojax_launch")


def test_the_wheel_ships_the_package_without_its_tests(tmp_path):
  # Built from a copy of what the build reads: a stale build/ of the working tree would leak in.
  source = tmp_path / "source"
  source.mkdir()
  for name in ("pyproject.toml", "setup.py", "README.md"):
    shutil.copy(ROOT / name, source / name)
  for package in PACKAGES:
    shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
  subprocess.run(
    [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir", str(tmp_path), "."],
    check=True,
    cwd=source,
  )
  (wheel,) = tmp_path.glob("zerojax-*.whl")
  shipped = set(zipfile.ZipFile(wheel).namelist())
  sources = {
    str(path.relative_to(ROOT)) for package in PACKAGES for path in (ROOT / package).rglob("*.py")
  }
  tests = {name for name in sources if name.endswith("_test.py")}
  assert tests  # the private helpers' own tests exist beside their modules...
  assert not tests & shipped  # ...and are not installed: they import pytest and chex
  assert sources - tests <= shipped
  assert any(name.endswith(".txtpb") for name in shipped)  # deviceless compilation's targets
