"""Transfer engines: where HiCache's byte copies run, and how their completion is known.

A host pool hands its copy work (a closure that issues the copies) to an engine with
:meth:`TransferEngine.submit` and gets a :class:`Completion` back.  Nothing may read, commit
or unpin what a copy touches before its completion is done: the transfer path waits on it
(:meth:`Completion.wait`) before ``finish_backup`` commits host copies or ``finish_load_back``
unpins the host slots it read; a consumer of loaded device data can instead make its own
stream wait (:meth:`Completion.wait_stream`), without blocking the host.

- :class:`CudaTransferEngine`: copies on two dedicated streams (``write``: device to host,
  ``load``: host to device), each ordered after the work already queued on the submitting
  thread's current stream; completion is a ``torch.cuda.Event`` recorded after the copies.
- :class:`HostTransferEngine`: the same path for pools on the CPU: the work runs at
  submission (a null stream) and its completion is already done.
- :class:`ThreadTransferEngine`: pools on the CPU, copies off the submitting thread: one
  worker thread per lane runs the work in submission order; completion is the work's
  future (a caller that does not need the bytes yet goes on meanwhile: torch's copies
  release the GIL).

:func:`engine_for` picks the engine for a device.  The work closure runs inside the stream
context, so every device tensor it makes (a device copy of its indices, a staging buffer)
belongs to the transfer stream.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from enum import Enum
from typing import Any

import torch

__all__ = [
    "DONE",
    "Completion",
    "CudaTransferEngine",
    "HostTransferEngine",
    "Lane",
    "ThreadTransferEngine",
    "TransferEngine",
    "engine_for",
]


class Lane(Enum):
    """Which dedicated stream a transfer runs on."""

    WRITE = "write"  # device -> host (backups)
    LOAD = "load"  # host -> device (load-backs)


class Completion:
    """The completion of one submitted transfer.  This base class is an already completed
    one (:data:`DONE`): work that ran synchronously at submission."""

    __slots__ = ()

    def done(self) -> bool:
        """True once every copy of the transfer has completed (never blocks)."""
        return True

    def wait(self) -> None:
        """Block the calling thread until every copy of the transfer has completed."""

    def wait_stream(self, stream: Any = None) -> None:
        """Make ``stream`` (default: the current one) wait for the transfer, device-side,
        without blocking the host; a no-op where there are no streams."""


#: The completion of work that has already run.
DONE = Completion()


class _CudaCompletion(Completion):
    __slots__ = ("_event", "_keep")

    def __init__(self, event: torch.cuda.Event, keep: tuple[Any, ...]) -> None:
        self._event = event
        # Host tensors the copies read or write: alive until the transfer is waited on.
        self._keep = keep

    def done(self) -> bool:
        if self._event.query():  # type: ignore[no-untyped-call]
            self._keep = ()
            return True
        return False

    def wait(self) -> None:
        self._event.synchronize()
        self._keep = ()

    def wait_stream(self, stream: Any = None) -> None:
        (stream or torch.cuda.current_stream()).wait_event(self._event)


class TransferEngine:
    """Runs transfer work and reports its completion (see the module docstring).  This base
    class is the contract; :class:`HostTransferEngine` and :class:`CudaTransferEngine` are
    the engines a host pool uses."""

    __slots__ = ()

    def submit(self, lane: Lane, work: Callable[[], Any]) -> Completion:
        """Issue ``work`` (a closure that issues copies) on ``lane``'s stream; returns its
        completion.  ``work``'s return value is kept alive until the completion is done
        (host buffers an asynchronous copy still reads or writes)."""
        raise NotImplementedError


class HostTransferEngine(TransferEngine):
    """Pools on the CPU: ``work`` runs at submission, its completion is :data:`DONE`."""

    __slots__ = ()

    def submit(self, lane: Lane, work: Callable[[], Any]) -> Completion:
        work()
        return DONE


class _FutureCompletion(Completion):
    __slots__ = ("_future",)

    def __init__(self, future: Future[Any]) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        self._future.result()  # re-raises the work's exception


class ThreadTransferEngine(TransferEngine):
    """Pools on the CPU, copies on a worker thread per lane (see the module docstring).

    Transfers of one lane run one at a time, in submission order; the two lanes run
    concurrently.  A work's exception is raised by its completion's ``wait``.  The threads
    exit with the interpreter once idle (``close`` stops them earlier)."""

    __slots__ = ("_lanes",)

    def __init__(self) -> None:
        self._lanes = {
            lane: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"urc-hicache-{lane.value}")
            for lane in Lane
        }

    def submit(self, lane: Lane, work: Callable[[], Any]) -> Completion:
        return _FutureCompletion(self._lanes[lane].submit(work))

    def close(self) -> None:
        """Wait for the submitted work, then stop the worker threads."""
        for pool in self._lanes.values():
            pool.shutdown(wait=True)


class CudaTransferEngine(TransferEngine):
    """Copies on a dedicated ``write`` and ``load`` stream of ``device``, with events.

    A transfer's stream first waits (device-side) for the work already queued on the
    submitting thread's current stream, so a backup sees the KV the forward pass wrote and a
    load lands after earlier writes to its slots.  Thread-safe: streams are per engine,
    events per transfer.
    """

    __slots__ = ("device", "load_stream", "write_stream")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.write_stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self.load_stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def submit(self, lane: Lane, work: Callable[[], Any]) -> Completion:
        stream = self.write_stream if lane is Lane.WRITE else self.load_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            keep = work()
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        return _CudaCompletion(event, (keep,))


def engine_for(device: torch.device) -> TransferEngine:
    """The engine for pools on ``device``: CUDA streams and events on a CUDA device, the
    synchronous host engine anywhere else."""
    if device.type == "cuda":
        return CudaTransferEngine(device)
    return HostTransferEngine()
