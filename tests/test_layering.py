"""The package layering, read from the source's imports (nothing is imported here).

Three rules by package prefix, and one on cycles:

- the core (``urc`` outside ``urc.apps``) imports none of ``hicache``, ``metrics``,
  ``urc.apps``;
- ``hicache`` and ``metrics`` import ``urc`` only through its public modules and names, and
  never the applications (``urc.apps``: the CLI, replay, workloads, the benchmarks);
- within the core, only the async service (``urc.service``) imports ``anyio``: everything
  below it is synchronous;
- no import cycles among our modules, counting every import (module level, inside
  functions, under ``if TYPE_CHECKING:``), none excepted.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("urc", "hicache", "metrics")
APPLICATIONS = ("urc.apps",)
SERVICE = "urc.service"
# None: MatchPrefixParams.req is a CachingRequest (urc.request_protocol), whose TreeLock
# (urc.lock_receipts) imports no params.
ALLOWED_CYCLES: list[list[str]] = []


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


def _imports(path: Path, name: str, modules: dict[str, Path]) -> list[tuple[str, str]]:
    """``(module, imported name or "")`` for every import of ours or of anyio: module level,
    inside functions and under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out: list[tuple[str, str]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
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
    return [(m, n) for m, n in out if m.split(".")[0] in (*PACKAGES, "anyio")]


MODULES = _modules()
IMPORTS = {name: _imports(path, name, MODULES) for name, path in MODULES.items()}


def _reexports() -> dict[str, dict[str, str]]:
    """For each package face: name -> the module that defines it (its ``from X import name``
    statements, and ``urc``'s lazy ``_EXPORTS`` table)."""
    out: dict[str, dict[str, str]] = {}
    for name, path in MODULES.items():
        if path.name != "__init__.py":
            continue
        table = out.setdefault(name, {})
        for m, n in IMPORTS[name]:
            if n and m in MODULES:
                table[n] = m
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.Dict):
                for k, v in zip(node.value.keys, node.value.values, strict=True):
                    if isinstance(k, ast.Constant) and isinstance(v, ast.Constant):
                        table[k.value] = v.value
    return out


REEXPORTS = _reexports()


def _target(module: str, name: str) -> str:
    """The module an import really depends on: a name taken from a package face counts as
    an import of the module that defines it."""
    seen = 0
    while name and name in REEXPORTS.get(module, {}) and seen < 8:
        module, seen = REEXPORTS[module][name], seen + 1
    return module


def _is_app(module: str) -> bool:
    return any(module == a or module.startswith(a + ".") for a in APPLICATIONS)


def test_the_scan_sees_the_packages() -> None:
    assert {"urc.cache", "urc.tree", "hicache.controller", "metrics.exporter"} <= set(MODULES)
    assert ("urc.tree", "Tree") in IMPORTS["urc.state"]


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


@pytest.mark.parametrize(
    "module",
    sorted(
        m
        for m in MODULES
        if m.split(".")[0] == "urc" and not _is_app(m) and not m.startswith(SERVICE)
    ),
)
def test_only_the_service_imports_anyio_in_the_core(module: str) -> None:
    bad = [m for m, _ in IMPORTS[module] if m.split(".")[0] == "anyio"]
    assert not bad, f"{module} imports {bad}: the core below urc.service is synchronous"


def test_the_anyio_rule_sees_the_service_import_it() -> None:
    assert any(m.split(".")[0] == "anyio" for m, _ in IMPORTS["urc.service._transport"])


def test_no_import_cycles_but_the_allowed_pair() -> None:
    graph = {
        m: {t for t in (_target(a, n) for a, n in IMPORTS[m]) if t in MODULES and t != m}
        for m in MODULES
    }
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
    assert sorted(cycles) == ALLOWED_CYCLES, f"import cycles: {cycles}"
