"""The tree shows the architecture: pipeline/ is grouped in wings and imports run one way,
cli, warm → sources → ingest → outputs → stages → lake → config (no circle)."""

from __future__ import annotations

import ast
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
