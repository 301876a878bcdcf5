"""Builds zerojax without its private helpers' own tests (``zerojax/_src/**/*_test.py``).

Everything else is in pyproject.toml; setuptools has no setting that leaves modules out of a
package, so the build's module finder does it. Those tests import pytest and chex, which a
user's install does not have.
"""

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithoutTests(build_py):
  def find_package_modules(self, package, package_dir):
    modules = super().find_package_modules(package, package_dir)
    return [(pkg, module, path) for pkg, module, path in modules if not module.endswith("_test")]


setup(cmdclass={"build_py": BuildWithoutTests})
