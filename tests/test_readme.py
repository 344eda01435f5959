"""The Python examples of the README and docs/*.md run as written, and so do the docstring
examples of every public function (doctest)."""
import ast
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


def _silent_expressions(code: str) -> list[str]:
    """Top-level expression statements that are no call (``occ.node``): a REPL shows them,
    a script prints nothing."""
    return [ast.get_source_segment(code, node) for node in ast.parse(code).body
            if isinstance(node, ast.Expr) and not isinstance(node.value, ast.Call)]


@pytest.mark.parametrize("path, code", BLOCKS,
                         ids=[f"{p.name}-block{i}" for i, (p, _) in enumerate(BLOCKS)])
def test_doc_example_runs(path, code, tmp_path, monkeypatch, capsys):
    """Each block runs as a script (in a scratch folder: it may write files). The README's
    are scripts a new user pastes into a file: they print what they show."""
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(path), "exec"), {"__name__": "__main__"})
    if path == README:
        assert not _silent_expressions(code), f"prints nothing as a script: {_silent_expressions(code)}"
        assert capsys.readouterr().out.strip(), "the example prints nothing"


def test_silent_expressions_are_found():
    assert _silent_expressions("x = 1\nx\nprint(x)\nx.shape\n") == ["x", "x.shape"]


DOCTEST_MODULES = ["rnnt_lattice.functional", "rnnt_lattice.fused", "rnnt_lattice.joiner", "rnnt_lattice.modules", "rnnt_lattice.pruned.simple",
                   "rnnt_lattice.pruned.windows", "rnnt_lattice.pruned.loss",
                   "rnnt_lattice.analysis.occupancy", "rnnt_lattice.analysis.alignment",
                   "rnnt_lattice.analysis.coverage", "rnnt_lattice.plot"]


@pytest.mark.parametrize("name", DOCTEST_MODULES)
def test_docstring_examples(name):
    if name.endswith("plot"):
        pytest.importorskip("matplotlib")
    module = importlib.import_module(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)     # the reference-fallback notice
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no docstring example"
    assert result.failed == 0, f"{result.failed} docstring example(s) of {name} failed"


def test_quoted_demo_output_is_the_programs():
    """The demo output the README quotes has the program's own lines: the TER meaning
    verbatim, and the first and last TER lines in the formats ``demo.run`` prints."""
    from rnnt_lattice import demo
    quoted = "\n".join(re.findall(r"```text\n(.*?)```", README.read_text(), flags=re.S))
    assert demo.TER_MEANING in quoted.splitlines()
    num = r"\d+\.\d{3}"
    assert re.search(rf"^held-out TER at initialisation {num} \(chance {num}\); training 2000 steps "
                     rf"on cpu with 2 thread\(s\)$", quoted, flags=re.M)
    last = re.search(rf"^held-out TER ({num}) \(at initialisation ({num}), chance ({num})\); \d+ s; "
                     rf"wrote rnnt_lattice_demo/$", quoted, flags=re.M)
    assert last, "the demo's last line is not quoted in its format"
    text = README.read_text()
    assert f"goes from {last.group(2)} to **{last.group(1)}**" in text
    assert f"score {last.group(3)}" in text


# The project's own files: not a virtual environment inside the checkout (the peers' venv of
# benchmarks/setup_peers.sh holds other projects' sources, in other encodings).
SOURCES = sorted(p for d in ("src", "tests", "benchmarks") for p in (ROOT / d).rglob("*.py")
                 if not any(part.startswith(".venv") for part in p.relative_to(ROOT).parts)) + DOCS
OUTSIDE = "../" + "shared"          # the spec folder next to the checkout: no user has it


def _headings(doc: str) -> set[str]:
    """Section numbers of docs/<doc> as citations write them: "9", "9.1", "A", "A.5"."""
    path = ROOT / "docs" / doc
    text = path.read_text() if path.is_file() else ""
    return {m.rstrip(".") for m in re.findall(r"^#+ ([A-Z0-9]+(?:\.[0-9]+)*\.?) ", text, flags=re.M)}


def test_citations_stay_inside_the_repository():
    """Code and docs cite only the repository's own files: no path into the folder beside
    the checkout, every ``docs/<name>.md`` named exists, every relative Markdown link of the
    docs resolves to a file of the checkout, and every section cited as "variants.md A.5"
    or "math.md section 9.1" is a heading of that file."""
    sections = {doc: _headings(doc) for doc in ("variants.md", "math.md")}
    bad = []
    for path in SOURCES:
        text = path.read_text()
        where = path.relative_to(ROOT)
        if OUTSIDE in text:
            bad.append(f"{where}: cites {OUTSIDE}")
        for name in re.findall(r"docs/([\w-]+\.md)", text):
            if not (ROOT / "docs" / name).is_file():
                bad.append(f"{where}: docs/{name} does not exist")
        if path.suffix == ".md":
            for link in re.findall(r"\]\(([^)#\s]+)", text):
                if not re.match(r"[a-z]+:", link):
                    target = (path.parent / link).resolve()
                    if ROOT not in target.parents or not target.exists():
                        bad.append(f"{where}: link {link} leads to no file of the checkout")
        for doc, cited in re.findall(r"(variants\.md|math\.md),? (?:sections? )?([A-D0-9](?:\.[0-9]+)*)\b", text):
            if cited not in sections[doc]:
                bad.append(f"{where}: {doc} has no section {cited}")
    assert not bad, "\n".join(bad)


def _pytest_commands(text: str) -> list[str]:
    """The ``python -m pytest ...`` command lines of ``text``, comments dropped."""
    return [line.split("#")[0].strip() for line in text.splitlines()
            if line.strip().startswith("python -m pytest")]


def test_ci_runs_the_readmes_test_commands():
    """CI (``.ci/run``) runs the test commands the README's Test section gives a new user,
    word for word and in order: the suite (its time and worker settings are the ones users
    get), then the floor run, the CPU kernels' tests on the oldest Numba that
    ``pyproject.toml`` allows, installed with the same pins and kernel cache in both."""
    section = README.read_text().split("\n## Test\n", 1)[1].split("\n## ", 1)[0]
    ci = (ROOT / ".ci" / "run").read_text()
    readme = _pytest_commands(section)
    assert len(readme) == 2, f"the README's Test section should give two test commands: {readme}"
    assert _pytest_commands(ci) == readme

    def pins(text):
        return re.findall(r'"(numba|numpy)==([\d.]+)"', text)

    def exports(text):
        return [line.strip() for line in text.splitlines() if line.startswith("export ")]
    assert pins(section) == pins(ci) and len(pins(ci)) == 2
    assert exports(section) == exports(ci) == ["export NUMBA_CACHE_DIR=.venv-floor/numba-cache"]
    floor = re.search(r'"numba>=([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    pinned = dict(pins(ci))["numba"]
    assert pinned.split(".")[:2] == floor.split(".")[:2], (pinned, floor)


def _package_imports() -> dict:
    """``{module: {modules it imports}}`` of the package's own modules (dotted names), every
    import at any depth of a file counted (a function's lazy import too): a relative or
    absolute ``from ... import name`` goes to ``name``'s module where ``name`` is one, else to
    the module it is taken from."""
    src = ROOT / "src"
    files = {".".join(p.relative_to(src).with_suffix("").parts[:-1] if p.name == "__init__.py"
                      else p.relative_to(src).with_suffix("").parts): p
             for p in (src / "rnnt_lattice").rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - node.level + 1]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    edges.add(target if target in files else base)
            elif isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
        graph[name] = {e for e in edges if e in files and e != name}
    return graph


def test_package_imports_form_no_cycle():
    """docs/architecture.md: the package's imports go one way. No module reaches itself
    through the modules it imports, counting the imports made inside functions (the device
    check's of ``gpu``, a backend's of ``torch_backend``): the checks may call a backend
    because no backend imports the checks, and the rules every backend applies to its
    results (``_rules``) sit below them all."""
    graph = _package_imports()
    assert "rnnt_lattice.gpu" in graph["rnnt_lattice._validate"]     # the device check's kernel
    state, path = {}, []

    def visit(m):
        state[m] = "open"
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n)
        path.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


def _oldest_python() -> tuple:
    """The oldest Python that pyproject.toml's ``requires-python`` admits, ``(3, minor)``."""
    spec = re.search(r'^requires-python\s*=\s*">=\s*3\.(\d+)"', (ROOT / "pyproject.toml").read_text(),
                     flags=re.M)
    assert spec, "pyproject.toml should state requires-python as \">=3.N\""
    return 3, int(spec.group(1))


def _evaluated_unions(tree: ast.Module) -> list:
    """The lines of annotations written ``X | Y`` that Python evaluates when the module is
    imported (a function's arguments and return, a module's or class's ``name: X``): each
    needs Python 3.10, unless the module starts with ``from __future__ import annotations``."""
    if any(isinstance(n, ast.ImportFrom) and n.module == "__future__"
           and any(a.name == "annotations" for a in n.names) for n in tree.body):
        return []
    notes = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            notes += [x.annotation for x in (*a.posonlyargs, *a.args, *a.kwonlyargs,
                                             *(v for v in (a.vararg, a.kwarg) if v))
                      if x.annotation is not None]
            notes += [node.returns] if node.returns is not None else []
        elif isinstance(node, ast.AnnAssign):
            notes.append(node.annotation)
    return sorted({n.lineno for note in notes for n in ast.walk(note)
                   if isinstance(n, ast.BinOp) and isinstance(n.op, ast.BitOr)})


def test_the_package_reads_on_the_oldest_python_it_declares():
    """pyproject.toml admits Python 3.9: every module of the package parses with that
    version's grammar, and none evaluates an ``X | Y`` annotation at import (Python 3.10's
    unions: on 3.9 that is a TypeError at the first use of the CPU backend, as
    ``cpu/_config.py`` once was). The suite itself runs on 3.11 in CI; README, "Install",
    gives the Pythons it was run on."""
    oldest = _oldest_python()
    bad = []
    for path in sorted((ROOT / "src" / "rnnt_lattice").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        try:
            tree = ast.parse(path.read_text(), filename=name, feature_version=oldest)
        except SyntaxError as err:
            bad.append(f"{name}:{err.lineno}: not Python {oldest[0]}.{oldest[1]} syntax: {err.msg}")
            continue
        bad += [f"{name}:{line}: an X | Y annotation evaluated at import (add "
                "'from __future__ import annotations')" for line in _evaluated_unions(tree)]
    assert not bad, "\n".join(bad)
