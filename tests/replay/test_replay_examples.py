"""The runnable examples: the async TCP server embedding the cache, the SGLang-style script."""

from __future__ import annotations

import importlib.util
import runpy
import sys
from pathlib import Path
from types import ModuleType

import anyio
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from urc import AsyncUnifiedRadixCache, CacheConfig

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TIMEOUT = 30


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"urc_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.asyncio
async def test_async_server_speaks_the_line_protocol() -> None:
    server = load("async_server")
    with anyio.fail_after(TIMEOUT):
        svc = AsyncUnifiedRadixCache(CacheConfig(kv_size=64))
        async with svc, anyio.create_task_group() as tg:
            port = await tg.start(server.serve, svc, "127.0.0.1", 0)
            async with await anyio.connect_tcp("127.0.0.1", port) as stream:
                reader = BufferedByteReceiveStream(stream)

                async def ask(line: str) -> str:
                    await stream.send(line.encode() + b"\n")
                    return (await reader.receive_until(b"\n", 4096)).decode()

                assert await ask("INSERT 1 2 3 4") == "OK 0 4"
                assert await ask("insert 1 2 3 4 5 6") == "OK 4 6"
                assert await ask("MATCH 1 2 3 9") == "OK 3 0"
                assert await ask("MATCH 7") == "OK 0 0"
                stats = await ask("STATS")
                assert stats.startswith("OK ") and "cached_tokens=6" in stats
                assert (await ask("FOO 1")).startswith("ERR unknown verb")
                assert (await ask("MATCH x")).startswith("ERR token ids must be integers")
                # An integer the cache cannot key (outside int64) is named as such.
                too_big = await ask(f"MATCH {1 << 63}")
                assert too_big.startswith("ERR InvalidInputError") and "int64" in too_big
                assert (await ask("INSERT " + " 9" * 100)).startswith("ERR OutOfMemoryError")
                await stream.send(b"QUIT\n")
                with pytest.raises(anyio.EndOfStream):
                    await stream.receive()
            tg.cancel_scope.cancel()
        svc.cache.sanity_check()
        svc.cache.check_pools()


def test_sglang_style_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    runpy.run_path(str(EXAMPLES / "sglang_style.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "match_prefix: 8 of 11 tokens hit" in out
    assert "cache_finished_req: the tree holds 13 tokens" in out
    assert "sanity_check and pool conservation: ok" in out
