"""Load-backs off the scheduler thread, layer by layer, as SGLang 0.5.23's HiCache does them.

SGLang's own cache (``HiCacheController``) commits a load-back's device slots to the tree at
``init_load_back`` and queues the copy; ``ready_to_load_host_cache`` -- once per new prefill
batch -- starts the queued copies as one transfer that signals each model layer as it lands
(``LayerDoneCounter``: three rotating producer slots of per-layer events) and returns the
slot; the batch carries it (``hicache_consumer_index``), the model worker makes it the
consumer (``set_hicache_consumer``), and the attention's reads of layer ``l``
(``get_key_buffer`` / ``get_value_buffer`` of the KV pool, which calls
``layer_transfer_counter.wait_until(l)``) wait for that layer only.  The pins are released
when the transfer has completed (``loading_check``, at a later HiCache turn).

Here the same, with urc's host tier: :class:`LayerLoadCounter` is the counter (threading
events: the copies run on the host tier's load worker thread,
:class:`~hicache.transfer_engine.ThreadTransferEngine`), :func:`layer_plan` says which host
buffers hold each model layer, :func:`commit_load_back` commits a ticket's slots with its
pins kept (:class:`PendingLoad`), and :func:`load_work` is the transfer.  One difference
from SGLang: a batch that starts no copy while an earlier one is still in flight waits for
that one (its requests may have matched the slots it fills; SGLang's forward stream orders
them, a worker thread does not).

This module imports no SGLang.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from urc.host import transfers as host_transfers
from urc.node import ComponentType

if TYPE_CHECKING:
    from hicache.host_tier import HostMemoryTier
    from hicache.transfer_engine import Completion
    from urc.cache import UnifiedRadixCache
    from urc.host_protocol import LoadTicket
    from urc.params import IncLockRefResult

__all__ = [
    "LayerLoadCounter",
    "LayerPlan",
    "PendingLoad",
    "commit_load_back",
    "layer_plan",
    "load_work",
    "release_load_back",
]

#: Per model layer, the host buffers that hold it: ``(component, buffer numbers)`` pairs.
LayerPlan = tuple[tuple[tuple[ComponentType, tuple[int, ...]], ...], ...]


class LayerLoadCounter:
    """SGLang's ``LayerDoneCounter`` surface (``num_layers``, ``num_counters``,
    ``producer_index``, ``consumer_index``, ``update_producer``, ``set_consumer``,
    ``wait_until``, ``reset``) over threading events, for copies on a worker thread.

    Producer slot ``i`` holds one event per layer; :meth:`complete` sets one (the copying
    thread), :meth:`wait_until` blocks the forward until the consumer slot's layer is set.
    ``blocked_s`` sums the time the forward spent waiting (for the benchmark)."""

    num_counters = 3  # SGLang's: a slot is reused three loads later

    def __init__(self, num_layers: int) -> None:
        if num_layers < 1:
            raise ValueError(f"a layer counter needs at least one layer, got {num_layers}")
        self.num_layers = num_layers
        # Every slot starts done: reusing a slot waits for its last layer.
        self.events = [[_set_event() for _ in range(num_layers)] for _ in range(self.num_counters)]
        self.producer_index = -1
        self.consumer_index = -1
        self.blocked_s = 0.0

    def update_producer(self) -> int:
        """The next producer slot, its events cleared (first waiting for the load that used
        it three loads ago, which a batch has normally waited for already)."""
        index = (self.producer_index + 1) % self.num_counters
        slot = self.events[index]
        slot[-1].wait()
        for event in slot:
            event.clear()
        self.producer_index = index
        return index

    def complete(self, index: int, layer: int) -> None:
        """Producer slot ``index``'s ``layer`` has landed (the copying thread)."""
        self.events[index][layer].set()

    def finish(self, index: int) -> None:
        """Every layer of slot ``index`` is over (landed, or the copy failed: its error is
        raised by the transfer's completion, the forward must not wait forever)."""
        for event in self.events[index]:
            event.set()

    def done(self, index: int) -> bool:
        """Whether slot ``index``'s last layer has landed (``index`` < 0: nothing to wait
        for)."""
        return index < 0 or self.events[index][-1].is_set()

    def set_consumer(self, index: int) -> None:
        """The batch about to run reads slot ``index``'s layers (-1: none)."""
        self.consumer_index = index

    def wait_until(self, layer: int) -> None:
        """Block until the consumer slot's ``layer`` has landed (no consumer: return)."""
        if self.consumer_index < 0:
            return
        event = self.events[self.consumer_index][layer]
        if not event.is_set():
            t0 = time.perf_counter()
            event.wait()
            self.blocked_s += time.perf_counter() - t0

    def reset(self) -> None:
        self.producer_index = -1
        self.consumer_index = -1


def _set_event() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


def layer_plan(
    layers: Sequence[tuple[ComponentType, int]], layers_of: dict[ComponentType, int]
) -> LayerPlan:
    """The plan of a KV pool whose host buffers are ``[K of each layer, V of each layer]``
    per component (urc's view of SGLang's per-layer buffers): model layer ``g`` is layer
    ``layers[g] = (component, i)`` of that component's ``layers_of[component]`` layers, so
    its buffers are ``i`` and ``layers_of[component] + i``."""
    return tuple(((ct, (i, layers_of[ct] + i)),) for ct, i in layers)


@dataclass(eq=False)
class PendingLoad:
    """A load-back committed to the tree whose copy has not completed: its nodes hold
    their device slots (a request's prefix may point at them) and are pinned -- device by
    ``receipt`` on the lowest node, host copies by a host lock on each node -- until
    :func:`release_load_back`.  ``completion`` / ``producer``: set when the copy starts."""

    ticket: LoadTicket
    receipt: IncLockRefResult
    completion: Completion | None = None
    producer: int = -1
    tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.tokens = self.ticket.tokens


def commit_load_back(core: UnifiedRadixCache, ticket: LoadTicket) -> PendingLoad:
    """Commit ``ticket``'s device slots to its nodes now (the core's ``finish_load_back``:
    counters, KV events) and keep them pinned for the copy still to come."""
    host_transfers.finish_load_back(core, ticket)
    bottom = ticket.nodes[-1]
    receipt = core.inc_lock_ref(bottom)
    for node in ticket.nodes:
        core.inc_host_lock_ref(node)
    return PendingLoad(ticket, receipt)


def release_load_back(core: UnifiedRadixCache, pending: PendingLoad) -> None:
    """Release ``pending``'s pins (its copy has completed)."""
    ticket = pending.ticket
    core.dec_lock_ref(ticket.nodes[-1], pending.receipt.to_dec_params())
    for node, length in zip(ticket.nodes, ticket.lengths, strict=True):
        host_transfers.host_unlock_pieces(core, node, length)


def load_work(
    host: HostMemoryTier,
    loads: Sequence[PendingLoad],
    plan: LayerPlan,
    counter: LayerLoadCounter,
    index: int,
) -> Callable[[], None]:
    """The transfer of ``loads`` for the host tier's load worker: the components the plan
    does not name first (whole), then layer by layer, signalling ``counter``'s slot
    ``index`` after each layer; every layer is signalled even if a copy fails."""
    items: dict[ComponentType, list[Any]] = {}
    for pending in loads:
        for _, item in pending.ticket.items:
            items.setdefault(item.component, []).append(item)
    planned = {ct for parts in plan for ct, _ in parts}

    def work() -> None:
        try:
            for ct, group in items.items():
                if ct not in planned:
                    for item in group:
                        host.load_buffers(ct, item.host, item.device)
            for layer, parts in enumerate(plan):
                for ct, buffers in parts:
                    for item in items.get(ct, ()):
                        host.load_buffers(ct, item.host, item.device, buffers)
                counter.complete(index, layer)
        finally:
            counter.finish(index)

    return work
