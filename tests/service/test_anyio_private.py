"""The service's private anyio uses are still where ``urc.service._anyio_private`` looks.

If one of these fails after an anyio upgrade, the service still works (it falls back to the
public checkpoint, and to resending after a native cancellation) but slower or less exactly:
update ``urc/service/_anyio_private.py`` to anyio's new layout.
"""

from __future__ import annotations

from importlib.metadata import version

import anyio
import pytest
from anyio.lowlevel import checkpoint_if_cancelled

from urc.service._anyio_private import (
    backend_checkpoint_if_cancelled,
    private_api_problems,
    stream_buffer_holds,
)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_anyio_still_keeps_the_private_api_the_service_uses(backend: str) -> None:
    async def main() -> list[str]:
        with anyio.fail_after(5):
            return private_api_problems()

    problems = anyio.run(main, backend=backend)
    assert not problems, (
        f"anyio {version('anyio')} moved what urc.service._anyio_private uses: {problems}; "
        "update that module"
    )


async def _checkpoint_scenario() -> None:
    with anyio.fail_after(5):
        fn = backend_checkpoint_if_cancelled()
        assert fn is not checkpoint_if_cancelled, "fell back to anyio's public checkpoint"
        await fn()  # not cancelled: returns
        with anyio.CancelScope() as scope:
            scope.cancel()
            await fn()
            pytest.fail("a cancelled scope must be delivered")
        assert scope.cancelled_caught


async def _buffer_scenario() -> None:
    with anyio.fail_after(5):
        send, recv = anyio.create_memory_object_stream[object](2)
        with send, recv:
            a, b = object(), object()
            send.send_nowait(a)
            assert stream_buffer_holds(send, a)
            assert not stream_buffer_holds(send, b)
            assert recv.receive_nowait() is a
            assert not stream_buffer_holds(send, a)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_checkpoint_is_the_running_backends_own(backend: str) -> None:
    anyio.run(_checkpoint_scenario, backend=backend)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_stream_buffer_holds_tells_a_buffered_item_from_one_taken(backend: str) -> None:
    anyio.run(_buffer_scenario, backend=backend)
