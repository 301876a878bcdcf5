"""A ``DevicelessProcess`` runs functions by name where the target's compiler is loaded."""

import importlib.util

import pytest

from zerojax.diagnostics import DevicelessProcess, find_by_name


def test_a_function_runs_in_the_target_s_process_and_its_errors_come_back():
  with DevicelessProcess("v5e-8") as process:
    environment = process.call("os:getenv", "TPU_SKIP_MDS_QUERY")
    assert environment == "1"  # the compiler's environment, not this process's
    with pytest.raises(RuntimeError, match="ValueError: 'no_such_module:f'"):
      process.call("zerojax.diagnostics:find_by_name", "no_such_module:f")
    assert process.call("math:comb", 5, 2) == 10  # an error does not end the process


def test_a_process_that_dies_says_its_last_words():
  with DevicelessProcess("h100x8") as process, pytest.raises(RuntimeError, match="died in os"):
    process.call("os:_exit", 3)


def test_names_that_find_nothing_are_refused_with_how_to_name_them(tmp_path):
  with pytest.raises(ValueError, match=r"'module:name' or 'path/to/file\.py:name'"):
    find_by_name("no colon")
  with pytest.raises(ValueError, match="there is no file"):
    find_by_name(str(tmp_path / "missing.py") + ":f")
  (tmp_path / "helper.py").write_text("VALUE = 7\n")
  (tmp_path / "script.py").write_text("import helper\nTOTAL = helper.VALUE * 6\n")
  assert find_by_name(f"{tmp_path}/script.py:TOTAL") == 42  # beside it, as a script has it
  with pytest.raises(ValueError, match="has no 'OTHER'"):
    find_by_name(f"{tmp_path}/script.py:OTHER")


def test_a_target_whose_compiler_is_missing_says_how_to_install_it(monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(
    importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a)
  )
  with pytest.raises(ValueError, match=r"pip install \"zerojax\[accelerators\]\""):
    DevicelessProcess("v5e-64")
  with pytest.raises(ValueError, match="unknown target"):
    DevicelessProcess("v5e-9")
