"""Every Python example in the README and the docs pages it leads to runs as written, every
``urc`` command line in them parses with the current options, every figure comes with the
command that produced it, and the README names every page under ``docs/``."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from urc.apps.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The pages the README sends a newcomer to for what it no longer holds: held to the same rules.
PAGES = [README] + [
    ROOT / "docs" / name
    for name in ("replay.md", "api.md", "hicache.md", "eviction.md", "benchmarks.md")
]
RUNNABLE = [README, ROOT / "docs" / "api.md", ROOT / "docs" / "hicache.md"]
RUNNABLE.append(ROOT / "docs" / "kv_events.md")
README_TEXT = README.read_text()
TEXT = "\n\n".join(p.read_text() for p in PAGES)
BLOCKS = [
    (page, block)
    for page in RUNNABLE
    for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
]
BASH = re.findall(r"```bash\n(.*?)```", TEXT, re.S)
COMMANDS = [
    part.strip()
    for block in BASH
    for line in block.replace("\\\n", " ").splitlines()
    for part in line.split("&&")
    if part.strip().startswith("urc ")
]


def _block_id(item: tuple[Path, str]) -> str:
    page, block = item
    line = next(ln for ln in reversed(block.splitlines()) if ln.strip())
    return f"{page.name}: {line.strip()[:40]}"


@pytest.mark.parametrize("item", BLOCKS, ids=_block_id)
def test_readme_python_example_runs_as_written(item: tuple[Path, str]) -> None:
    page, block = item
    exec(compile(block, str(page), "exec"), {"__name__": "__readme__"})


def test_readme_has_the_documented_examples() -> None:
    # The README's tour (the core, the service with HiCache); the API, the async service,
    # HiCache, attach/detach, Metrics and KV-event snippets in the pages.
    readme = [b for page, b in BLOCKS if page == README]
    assert len(readme) >= 2 and any("hicache.attach(" in b for b in readme)
    assert len(BLOCKS) >= 6
    assert any("MetricsServer" in b for _, b in BLOCKS)
    assert any("attach_storage" in b for _, b in BLOCKS)


def test_readme_lists_every_docs_page_and_links_only_pages_that_exist() -> None:
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    layout = README_TEXT[README_TEXT.index("## Layout") :]
    assert [p for p in pages if p not in layout] == []
    linked = set(re.findall(r"\]\(((?:docs/)?[\w.-]+\.md)(?:#[\w-]*)?\)", README_TEXT))
    assert sorted(p for p in linked if not (ROOT / p).exists()) == []


def test_readme_stays_a_front_door() -> None:
    assert len(README_TEXT.splitlines()) <= 300


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_urc_command_parses(command: str) -> None:
    argv = shlex.split(command)[1:]
    args = build_parser().parse_args(argv)
    assert args.command == argv[0]


def test_readme_shows_replay_commands() -> None:
    assert any(c.startswith("urc replay --trace") for c in COMMANDS)
    assert any("--sweep" in c for c in COMMANDS)


# ---------------------------------------------------------------------- every figure's command
# Outside code blocks, the README splits into units: a paragraph, a list item, or a table
# together with the paragraph that introduces it.  A unit that quotes a measured figure must
# show the command that produced it.
_FIGURE = re.compile(
    r"(?<![\w.])\d[\d,.]*(?:-\d[\d,.]*)?\s?"
    r"(?:%|µs|us\b|ms\b|s\b|GB/s|MB/s|GB\b|MB\b|GiB\b|MiB\b|[kM]?\s?ops/s|x\b|minutes\b)"
)
# Sizes and settings the text states rather than measures (a default, a unit of a format).
_NOT_MEASURED = re.compile(r"(default \d[\d.]*\s?\w*|\d+% of the workload|\d+ MiB pages)")
_COMMAND = re.compile(r"`(?:/usr/bin/time[^`]*|OMP_NUM_THREADS=\S+ )?(?:python |urc )[^`]*`")
_RUN_COMMAND = re.compile(r"`/usr/bin/time[^`]*`|`python -m pytest[^`]*`")


def _units(text: str) -> list[str]:
    prose = re.sub(r"```.*?```", "\n\n", text, flags=re.S)
    units: list[str] = []
    for para in re.split(r"\n\s*\n", prose):
        lines = para.strip().splitlines()
        if not lines or lines[0].startswith("#"):
            continue
        if lines[0].startswith("|") and units:
            units[-1] += "\n" + para  # a table belongs to the paragraph that introduces it
            continue
        items: list[list[str]] = [[]]
        for line in lines:
            if line.startswith("- ") and items[-1]:
                items.append([])
            items[-1].append(line)
        units.extend("\n".join(item) for item in items)
    return units


def _figures(unit: str) -> list[str]:
    cleaned = _NOT_MEASURED.sub("", unit.replace("\n", " "))
    return [m.group(0) for m in _FIGURE.finditer(cleaned)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_readme_figure_comes_with_the_command_that_produced_it(page: Path) -> None:
    missing = [
        (unit[:120], figures[:3])
        for unit in _units(page.read_text())
        if (figures := _figures(unit)) and not (_COMMAND.search(unit) or _RUN_COMMAND.search(unit))
    ]
    assert missing == [], "\n".join(f"{f}: {u!r}" for u, f in missing)


def test_the_figure_check_sees_figures_without_commands() -> None:
    units = _units("Intro.\n\nIt took 18 s and 1.2 GB.\n\n- `urc replay --x`: 37.02% hit.\n")
    assert [bool(_figures(u)) for u in units] == [False, True, True]
    assert not _COMMAND.search(units[1]) and _COMMAND.search(units[2])


# ---------------------------------------------------------------------- commands and paths
_MODULES = sorted(
    m
    # (SGLang's own launcher is the user's install, not ours)
    for m in set(re.findall(r"python -m ([\w.]+)", TEXT)) - {"pytest", "sglang.launch_server"}
    if not re.search(r"\.[A-Z]$", m)  # a placeholder (urc.apps.bench.X)
)
_PATHS = sorted(
    set(re.findall(r"`((?:urc|hicache|metrics|examples|tests)/[\w/.-]+\.(?:py|c|json))`", TEXT))
)


@pytest.mark.parametrize("module", _MODULES)
def test_readme_python_m_commands_name_modules_that_exist(module: str) -> None:
    import importlib.util

    assert importlib.util.find_spec(module) is not None, module


@pytest.mark.parametrize("path", _PATHS)
def test_readme_file_references_exist(path: str) -> None:
    assert (README.parent / path).exists(), path


_INLINE = sorted(
    {
        " ".join(span.split())
        for span in re.findall(r"`(urc replay [^`]*)`", TEXT)
        # Runs only: no placeholders (N, P, ...), no --help.
        if not re.search(r"(?<![\w-])[A-Z]\b", span) and "--help" not in span
    }
)


@pytest.mark.parametrize("command", _INLINE)
def test_readme_inline_urc_commands_parse(command: str) -> None:
    argv = shlex.split(command)[1:]
    assert build_parser().parse_args(argv).command == "replay"


def test_readme_async_service_example_runs_under_asyncio_run() -> None:
    block = next(b for _, b in BLOCKS if "AsyncUnifiedRadixCache(build_cache" in b)
    assert "anyio.run(main)" in block
    code = block.replace("anyio.run(main)", "import asyncio\nasyncio.run(main())")
    exec(compile(code, "docs/api.md", "exec"), {"__name__": "__readme__"})


def test_readme_json_section_names_every_report_field(tmp_path: Path) -> None:
    import dataclasses
    import json

    from hicache.storage_worker.stats import StorageWorkerStats
    from urc.apps.cli import main

    replay_page = (ROOT / "docs" / "replay.md").read_text()
    section = replay_page[replay_page.index("### The JSON report") :]
    end = section.find("\n## ")
    section = section if end < 0 else section[:end]
    out = tmp_path / "r.json"
    assert main(["replay", "--no-progress", "--num-requests", "20", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())

    def keys(d: dict[str, object]) -> set[str]:
        found = set(d)
        for k, v in d.items():
            if isinstance(v, dict) and k not in ("evicted", "latency_us"):
                found |= keys(v)  # type: ignore[arg-type]
        return found

    names = keys(doc) | {f.name for f in dataclasses.fields(StorageWorkerStats)}
    names |= set(next(iter(doc["timings"]["latency_us"].values())))
    undocumented = sorted(n for n in names if f"`{n}`" not in section)
    assert undocumented == []
