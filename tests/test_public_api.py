"""Every public module states its public surface in ``__all__``: each listed name exists,
nothing is listed twice, and every class or function the module defines without a leading
underscore is listed (a new public name is a decision, made here, not an accident)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _public_modules() -> list[str]:
    names = []
    for pkg in ("urc", "hicache", "metrics"):
        for p in sorted((ROOT / pkg).rglob("*.py")):
            rel = p.relative_to(ROOT).with_suffix("")
            parts = [x for x in rel.parts if x != "__init__"]
            if any(x.startswith("_") for x in parts) or p.name == "__main__.py":
                continue
            names.append(".".join(parts))
    return names


MODULES = _public_modules()


def test_the_scan_sees_the_public_modules() -> None:
    assert {"urc", "urc.cache", "urc.tree", "urc.service", "hicache", "metrics"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_public_module_lists_exactly_its_public_definitions(name: str) -> None:
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        # A class SGLang loads (urc.apps.sglang.hicache_storage) subclasses SGLang's own.
        if (e.name or "").split(".")[0] != "sglang":
            raise
        pytest.skip(f"{name} needs SGLang: {e}")
    exported = getattr(module, "__all__", None)
    assert exported is not None, f"{name} has no __all__"
    assert len(set(exported)) == len(exported), f"{name}: duplicates in __all__"
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ lists undefined {missing}"
    path = Path(module.__file__ or "")
    tree = ast.parse(path.read_text())
    defined = [
        node.name
        for node in tree.body
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and not node.name.startswith("_")
    ]
    unlisted = [n for n in defined if n not in exported]
    assert not unlisted, f"{name} defines public {unlisted} without listing them in __all__"


def test_the_top_level_states_one_list_of_names() -> None:
    """``urc``'s lazy ``_EXPORTS``, its ``__all__`` and its ``TYPE_CHECKING`` imports name the
    same things, each from the module that defines it."""
    import urc

    tree = ast.parse((ROOT / "urc" / "__init__.py").read_text())
    typed: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom) and stmt.module is not None
                typed.update({a.name: stmt.module for a in stmt.names})
    assert urc.__all__ == sorted(urc._EXPORTS)
    assert typed == urc._EXPORTS
