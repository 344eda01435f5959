"""The Python examples of the README and docs/*.md run as written, and so do the docstring
examples of every public function (doctest)."""
import doctest
import importlib
import pathlib
import re
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README] + sorted((ROOT / "docs").glob("*.md"))
BLOCKS = [(p, code) for p in DOCS
          for code in re.findall(r"```python\n(.*?)```", p.read_text(), flags=re.S)]


def test_readme_has_examples():
    assert any(p == README for p, _ in BLOCKS), "README.md should show a runnable Python example"


@pytest.mark.parametrize("path, code", BLOCKS,
                         ids=[f"{p.name}-block{i}" for i, (p, _) in enumerate(BLOCKS)])
def test_doc_example_runs(path, code):
    exec(compile(code, str(path), "exec"), {"__name__": "doc_example"})


DOCTEST_MODULES = ["rnnt_lattice.functional", "rnnt_lattice.modules", "rnnt_lattice.pruned",
                   "rnnt_lattice.analysis.occupancy", "rnnt_lattice.analysis.alignment",
                   "rnnt_lattice.analysis.coverage", "rnnt_lattice.bench"]


@pytest.mark.parametrize("name", DOCTEST_MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)     # the reference-fallback notice
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no docstring example"
    assert result.failed == 0, f"{result.failed} docstring example(s) of {name} failed"
