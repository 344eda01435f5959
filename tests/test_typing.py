"""The package's types as users' type checkers read them (PEP 561): the ``py.typed`` marker
ships with the package, and a script over the public API whose results are annotated with
the types they have (``support/typed_use.py``) runs, and passes mypy against the installed
package. Without the marker mypy refuses the import ("missing library stubs or py.typed
marker"); with a wrong annotation (an attribute typed ``Tensor | None`` that is always a
tensor) it flags the user's line."""
from __future__ import annotations

import os
import pathlib
import runpy
import subprocess
import sys

import pytest

import rnnt_lattice

SCRIPT = pathlib.Path(__file__).resolve().parent / "support" / "typed_use.py"
ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_marker_ships_with_the_package():
    """``py.typed`` lies in the package, and the build configuration puts it in the wheel
    (setuptools' package data)."""
    assert (pathlib.Path(rnnt_lattice.__file__).parent / "py.typed").is_file()
    tomllib = pytest.importorskip("tomllib")                  # Python 3.11+
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["rnnt_lattice"]


def test_the_typed_script_runs():
    """The script is a real use of the API (else its annotations would prove nothing)."""
    runpy.run_path(str(SCRIPT), run_name="__main__")


def test_mypy_accepts_the_typed_script(tmp_path):
    """mypy finds the installed package's types and agrees with every annotation of the
    script (errors inside the package itself are not a user's: ``--follow-imports=silent``)."""
    out = subprocess.run([sys.executable, "-m", "mypy", "--follow-imports=silent",
                          "--cache-dir", str(tmp_path / "cache"), "--python-executable",
                          sys.executable, str(SCRIPT)],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={k: v for k, v in os.environ.items() if k != "MYPYPATH"})
    assert out.returncode == 0 and "Success" in out.stdout, out.stdout + out.stderr
