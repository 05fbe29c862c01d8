"""The README's self-contained Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
# A block is self-contained when it imports what it uses and runs at top level.
RUNNABLE = [b for b in BLOCKS if b.startswith(("import", "from")) and "\nasync with" not in b]


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.splitlines()[-1][:40])
def test_readme_example_runs(block: str) -> None:
    exec(compile(block, str(README), "exec"), {})


def test_readme_has_runnable_examples() -> None:
    assert len(RUNNABLE) >= 2
