"""The package layering, read from the source's imports (nothing is imported here).

- the core (``urc`` without its applications: the CLI, ``urc.replay``) never imports
  ``hicache``, ``metrics`` or an application module;
- ``hicache`` and ``metrics`` reach ``urc`` only through its public modules and names;
- no import cycles among our modules, except imports under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("urc", "hicache", "metrics")
APPLICATIONS = ("urc.cli", "urc.replay")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {
        _module_name(p): p
        for pkg in PACKAGES
        for p in sorted((ROOT / pkg).rglob("*.py"))
        if "__pycache__" not in p.parts
    }


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(path: Path, name: str, modules: dict[str, Path]) -> list[tuple[str, str]]:
    """``(module, imported name or "")`` for every import that runs (module level or inside
    functions), skipping ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out: list[tuple[str, str]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                out.extend((a.name, "") for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = name.split(".")
                    anchor = anchor if is_pkg else anchor[:-1]
                    anchor = anchor[: len(anchor) - child.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                for a in child.names:
                    sub = f"{base}.{a.name}"
                    out.append((sub, "") if sub in modules else (base, a.name))
            visit(child)

    visit(tree)
    return [(m, n) for m, n in out if m.split(".")[0] in PACKAGES]


MODULES = _modules()
IMPORTS = {name: _runtime_imports(path, name, MODULES) for name, path in MODULES.items()}


def _is_app(module: str) -> bool:
    return any(module == a or module.startswith(a + ".") for a in APPLICATIONS)


def test_the_scan_sees_the_packages() -> None:
    assert {"urc.cache", "urc.tree", "hicache.controller", "metrics.exporter"} <= set(MODULES)
    assert ("urc.tree", "Tree") in IMPORTS["urc.cache"]


@pytest.mark.parametrize(
    "module", sorted(m for m in MODULES if m.split(".")[0] == "urc" and not _is_app(m))
)
def test_core_modules_never_import_hicache_metrics_or_the_applications(module: str) -> None:
    bad = [m for m, _ in IMPORTS[module] if m.split(".")[0] in ("hicache", "metrics") or _is_app(m)]
    assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize(
    "module", sorted(m for m in MODULES if m.split(".")[0] in ("hicache", "metrics"))
)
def test_hicache_and_metrics_use_only_the_public_core(module: str) -> None:
    bad = [
        f"{m}:{n}" if n else m
        for m, n in IMPORTS[module]
        if m.startswith("urc")
        and (any(p.startswith("_") for p in m.split(".")) or n.startswith("_") or _is_app(m))
    ]
    assert not bad, f"{module} reaches into {bad}"


def test_no_import_cycles_outside_type_checking() -> None:
    graph = {m: {t for t, _ in IMPORTS[m] if t in MODULES and t != m} for m in MODULES}
    # A package's __init__ is imported before any of its modules; its own lazy exports
    # (resolved on attribute access) are not edges.
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                cycles.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    assert not cycles, f"import cycles: {cycles}"
