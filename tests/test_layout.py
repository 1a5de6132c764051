"""The tree shows the architecture: pipeline/ is grouped in wings and imports run one way,
cli, warm → sources → ingest → outputs → stages → lake → config (no circle)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

PIPELINE = Path(__file__).resolve().parent.parent / "pipeline"

#: Lower imports nothing higher. Modules of one wing may import each other.
RANK = {"config": 0, "names": 0, "signals": 0, "lake": 1, "stages": 2, "outputs": 3, "ingest": 4, "sources": 5, "cli": 6,
        "warm": 6}  # warm_up imports the modules the tasks call, from every wing


def _layer(module: str) -> str:
    """'pipeline.stages.parse' → 'stages'; 'pipeline.ingest' → 'ingest'."""
    return module.split(".")[1]


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PIPELINE.rglob("*.py")):
        parts = p.relative_to(PIPELINE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(module: str, path: Path) -> set[str]:
    """Every pipeline module ``module`` imports, at top level or inside a function."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("pipeline"):
                continue
            known = _modules()
            for alias in node.names:  # `from . import warehouse` names a module
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("pipeline")}
    return {m for m in found if m != "pipeline"}


MODULES = _modules()


def test_every_module_is_in_a_wing_or_at_the_top():
    for name in MODULES:
        if name == "pipeline":
            continue
        assert _layer(name) in RANK, f"{name}: not in a known wing ({', '.join(RANK)})"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "pipeline"))
def test_imports_run_one_way(module):
    mine = RANK[_layer(module)]
    for target in _imports(module, MODULES[module]):
        theirs = RANK[_layer(target)]
        assert theirs < mine or _layer(target) == _layer(module), (
            f"{module} imports {target}: {_layer(module)} may import only lower wings "
            f"({' → '.join(sorted(RANK, key=RANK.get, reverse=True))})")


def test_no_import_circle():
    graph = {m: _imports(m, p) & set(MODULES) for m, p in MODULES.items() if m != "pipeline"}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                raise AssertionError("import circle: " + " → ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


#: A module longer than this most often holds more than one concern: split it into modules of
#: one concern each, or say why it is one in its docstring's first lines ("over 600 lines: ...").
MAX_LINES = 600

#: Today's modules over MAX_LINES, each with why; one that is split leaves this list, and none
#: joins it: a new long module says why in its docstring.
KNOWN_LONG: dict[str, str] = {}


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def _says_why_it_is_long(path: Path) -> bool:
    """Whether the module's docstring says, in its first five lines, why it is over the limit."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return f"over {MAX_LINES} lines" in " ".join(doc.splitlines()[:5]).lower()


def test_every_module_is_at_most_600_lines_or_says_why():
    too_long = []
    for path in MODULES.values():
        shown = path.relative_to(PIPELINE).as_posix()
        if _lines(path) > MAX_LINES and shown not in KNOWN_LONG and not _says_why_it_is_long(path):
            too_long.append(f"{shown} ({_lines(path)} lines)")
    assert not too_long, (
        f"over {MAX_LINES} lines without saying why: {', '.join(too_long)}; split it into modules of one concern "
        f"each, or say in its docstring's first lines why it is one (\"over {MAX_LINES} lines: ...\")")


def test_the_known_long_modules_are_still_long():
    """A module that was split, or shrank, leaves KNOWN_LONG: the list says what is left to do."""
    for shown in KNOWN_LONG:
        path = PIPELINE / shown
        assert path.is_file(), f"{shown} is in KNOWN_LONG but is gone: take it off the list"
        assert _lines(path) > MAX_LINES, (
            f"{shown} is {_lines(path)} lines now: take it off KNOWN_LONG (it is at most {MAX_LINES})")


def test_the_package_lists_every_folder_and_file_it_needs():
    """A wheel of pipeline/ (`pip wheel .`, not the editable install of a checkout) holds every
    package and every file under pipeline/ the code reads. Found by splitting find.py into a
    package: the packages are listed by hand in pyproject.toml, and the web app's templates
    were not in it. (schemas/, outside pipeline/, is the package pipeline.schemas: the test below.)"""
    import tomllib

    setup = tomllib.loads((PIPELINE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {".".join(p.relative_to(PIPELINE.parent).parts) for p in [PIPELINE, *PIPELINE.rglob("*")]
                if p.is_dir() and (p / "__init__.py").exists()}
    assert set(setup["packages"]) == packages | set(setup.get("package-dir", {}))
    data = setup.get("package-data", {})
    missing = []
    for f in PIPELINE.rglob("*"):
        if f.is_dir() or f.suffix in (".py", ".pyc") or "__pycache__" in f.parts:
            continue
        owner = max((p for p in packages if f.relative_to(PIPELINE.parent).as_posix().startswith(p.replace(".", "/") + "/")),
                    key=len)
        inside = f.relative_to(PIPELINE.parent / owner.replace(".", "/"))
        if not any(inside.match(g) and len(inside.parts) == len(Path(g).parts) for g in data.get(owner, [])):
            missing.append(f.relative_to(PIPELINE.parent).as_posix())
    assert not missing, f"not in pyproject.toml's package-data (a wheel leaves them out): {missing}"


def test_an_installed_wheel_holds_every_schema_file_and_finds_it():
    """A wheel installs schemas/ as ``pipeline/schemas`` (pyproject's package-dir): every file
    there matches the package data it ships, and config looks there when no checkout is around
    the package (an ingest from a wheel found no migrations before)."""
    import fnmatch
    import shutil
    import subprocess
    import sys

    import tomllib

    root = PIPELINE.parent
    conf = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert conf["package-dir"]["pipeline.schemas"] == "schemas" and "pipeline.schemas" in conf["packages"]
    patterns = conf["package-data"]["pipeline.schemas"]
    files = [p.relative_to(root / "schemas").as_posix() for p in (root / "schemas").rglob("*") if p.is_file()]
    assert files and not [f for f in files if not any(fnmatch.fnmatch(f, pat) and f.count("/") == pat.count("/")
                                                       for pat in patterns)]
    # laid out as a wheel installs it: the package, with schemas/ inside it and no checkout around
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        shutil.copytree(PIPELINE, site / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copytree(root / "schemas", site / "pipeline" / "schemas")
        code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in str(f).lower()]; "
                f"sys.path.insert(0, {str(site)!r}); import pipeline.config as c; "
                "print(c.SCHEMAS_DIR, (c.SCHEMAS_DIR / 'migrations' / '0001_lakehouse.sql').is_file())")
        env = {k: v for k, v in os.environ.items() if k != "FEATUREHOUSE_SCHEMAS"}
        got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp)
        assert got.returncode == 0, got.stderr
        assert got.stdout.split() == [str(site / "pipeline" / "schemas"), "True"], got.stdout
