"""Every Python example in the README runs as written, and every ``urc`` command line in it
parses with the current options."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from urc.apps.cli import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"
TEXT = README.read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", TEXT, re.S)
BASH = re.findall(r"```bash\n(.*?)```", TEXT, re.S)
COMMANDS = [
    part.strip()
    for block in BASH
    for line in block.replace("\\\n", " ").splitlines()
    for part in line.split("&&")
    if part.strip().startswith("urc ")
]


def _block_id(block: str) -> str:
    line = next(ln for ln in reversed(block.splitlines()) if ln.strip())
    return line.strip()[:40]


@pytest.mark.parametrize("block", BLOCKS, ids=_block_id)
def test_readme_python_example_runs_as_written(block: str) -> None:
    exec(compile(block, str(README), "exec"), {"__name__": "__readme__"})


def test_readme_has_the_documented_examples() -> None:
    # The API, the async service, HiCache and Metrics snippets.
    assert len(BLOCKS) >= 4
    assert any("hicache.attach(" in b for b in BLOCKS)
    assert any("MetricsServer" in b for b in BLOCKS)


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_urc_command_parses(command: str) -> None:
    argv = shlex.split(command)[1:]
    args = build_parser().parse_args(argv)
    assert args.command == argv[0]


def test_readme_shows_replay_commands() -> None:
    assert any(c.startswith("urc replay --trace") for c in COMMANDS)
    assert any("--sweep" in c for c in COMMANDS)
