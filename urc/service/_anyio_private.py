"""The service's only contact with anyio internals, kept in one place.

Two things the service wants are not in anyio's public API:

- the running backend's own ``checkpoint_if_cancelled`` (``anyio._core._eventloop.
  get_async_backend``): calling it directly skips anyio's per-call backend lookup on every
  command (:func:`backend_checkpoint_if_cancelled`);
- whether a memory object stream's buffer holds an item (its private ``_state.buffer``):
  asked only after a native asyncio cancellation interrupted ``await send``, to learn whether
  the stream took the call (:func:`stream_buffer_holds`).

Both degrade to something correct when anyio moves them (the public checkpoint, slower;
"not buffered", which makes the caller send again) and :func:`private_api_problems` names
what moved, so a test fails loudly instead of the service silently slowing down or
double-sending (``tests/service/test_anyio_private.py``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from anyio.lowlevel import checkpoint_if_cancelled

_get_async_backend: Callable[[], Any] | None
try:
    from anyio._core._eventloop import get_async_backend as _imported

    _get_async_backend = _imported
except ImportError:  # pragma: no cover - anyio moved it; ``private_api_problems`` says so
    _get_async_backend = None

__all__ = ["backend_checkpoint_if_cancelled", "private_api_problems", "stream_buffer_holds"]

_WHERE_BACKEND = "anyio._core._eventloop.get_async_backend"
_WHERE_BUFFER = "anyio.streams.memory.MemoryObjectSendStream._state.buffer"


def backend_checkpoint_if_cancelled() -> Callable[[], Awaitable[None]]:
    """The running backend's ``checkpoint_if_cancelled`` (call inside the event loop), or
    anyio's public one when anyio no longer keeps ``get_async_backend`` where it used to."""
    if _get_async_backend is None:  # pragma: no cover - see ``private_api_problems``
        return checkpoint_if_cancelled
    fn: Callable[[], Awaitable[None]] = _get_async_backend().checkpoint_if_cancelled
    return fn


def stream_buffer_holds(send_stream: Any, item: object) -> bool:
    """Whether ``item`` (by identity) waits in the buffer of the memory object stream whose
    sending side is ``send_stream``; ``False`` when the buffer cannot be read."""
    state = getattr(send_stream, "_state", None)
    buffer = getattr(state, "buffer", ())
    return any(queued is item for queued in buffer)


def private_api_problems() -> list[str]:
    """What of the private anyio API above is no longer where this module looks (empty when
    all is in place).  Call it inside a running event loop."""
    import anyio

    problems = []
    if _get_async_backend is None:
        problems.append(f"{_WHERE_BACKEND} is gone (import failed)")
    elif not callable(getattr(_get_async_backend(), "checkpoint_if_cancelled", None)):
        problems.append(f"{_WHERE_BACKEND}() has no checkpoint_if_cancelled")
    send, recv = anyio.create_memory_object_stream[object](1)
    with send, recv:
        probe = object()
        send.send_nowait(probe)
        if not stream_buffer_holds(send, probe):
            problems.append(f"{_WHERE_BUFFER} does not hold the items sent")
    return problems
