"""Token-slot allocator: hands out KV slots in whole pages and takes them back.

Slots are token indices ``[0, size)``; page ``p`` owns tokens ``[p * page_size, (p + 1) *
page_size)``.  ``alloc(n)`` takes ``ceil(n / page_size)`` pages and returns the first ``n``
token indices of them, so an unaligned request still owns whole pages.

Freeing costs O(freed pages), independent of the pool size (SGLang's allocator concatenates
the whole free list on every free, which dominated its insert and evict phases).  A per-page
state makes double frees, frees of never-allocated slots, of slots the tree owns and of a
slot named twice in one call an error that changes nothing, instead of silent corruption.

Page states (:data:`urc.pools.pageops.FREE` / ``HELD`` / ``TREE``)::

    FREE   on the free extents (or queued by ``free_owned``: see below)
    HELD   handed out by ``alloc``: the caller's (a request's KV, a load's reserved slots);
           ``free`` takes only these
    TREE   adopted by the tree: an insert's new slots (:meth:`TokenSlotAllocator.claim_value`
           at insert), a load-back's committed slots (:meth:`TokenSlotAllocator.adopt`);
           only eviction frees them (``free_owned``)

A caller passing a tree-owned slot as its own (``free``, or as an insert's new value) gets a
:class:`~urc.errors.TreeOwnedSlotError`.

The free pages are a stack of extents (runs of consecutive pages, ``[lo, lo + len)``): a
free pushes the runs of what it frees, joining the top extent when the first run
continues it, and an allocation takes pages from the top extents, ascending within each.
Values are mostly such runs (an allocation hands out runs, a tree node frees what it was
given), so a free writes a few extents instead of one stack entry per page.  State and
extents live in host memory (numpy) because per-call torch dispatch costs more than the
bookkeeping itself.  A checked free is one pass over the indices that checks each run of
pages just before it clears it (a page repeated in the call is then already free).

Slots the tree frees (evicted nodes) go through :meth:`TokenSlotAllocator.free_owned`, which
only queues the tensor, unchecked: the tree validated those slots when it adopted them.  The
queue is merged into the free extents (:meth:`TokenSlotAllocator.flush`) when something
needs it -- an allocation the extents are short for, anything that reads page states (a
checked ``free``, ``check_owned`` at insert, ``is_allocated``, the consistency check) -- or
once it holds ``MERGE_BATCH`` spans, which bounds the tensors it keeps alive.  An eviction
thus only queues its frees; the release of their pages is paid once, by the merge, in groups
of up to ``_CAT_SLOTS`` slots (:func:`merged_groups`: one ``torch.cat`` each).

The per-page loops of ``free``, ``check_owned``, ``alloc`` and the extent pushes are
:mod:`urc.pools.pageops` primitives: compiled where built, else their numpy twins
(:meth:`TokenSlotAllocator.use_page_ops`; the cache selects them with its walk).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from urc.errors import ConfigError, DoubleFreeError, InvalidIndicesError, TreeOwnedSlotError
from urc.fastpath import WalkImpl
from urc.pools.counts import slot_count
from urc.pools.pageops import FREE, HELD, TREE, PageOps, select_page_ops

__all__ = ["MERGE_BATCH", "TokenSlotAllocator", "check_page_size", "merged_groups"]

#: At most this many :meth:`TokenSlotAllocator.free_owned` spans stay queued (the tensors a
#: queue keeps alive: a few hundred KiB of headers at most).
MERGE_BATCH = 1024

# A merge concatenates queued spans in groups of up to this many slots and releases each
# group in one pass: one torch.cat per group amortizes its fixed cost over small spans,
# while a long span is released on its own (concatenating a million cold indices would
# cost more than releasing them).
_CAT_SLOTS = 1 << 15


def check_page_size(page_size: int) -> None:
    """Raise :class:`ConfigError` unless ``page_size`` is a positive power of two."""
    if page_size < 1 or page_size & (page_size - 1):
        raise ConfigError(f"page_size must be a positive power of two, got {page_size}")


class TokenSlotAllocator:
    """Allocator of KV token slots in pages of ``page_size`` tokens.

    ``free(indices)`` accepts any concatenation of page-prefix runs, each starting on a page
    boundary (what a request or a tree node owns): the page of every run's first token is
    freed.  Sizes (``size``, ``available_size()``) are in tokens.

    Free pages sit in a host-side stack of extents (numpy; :mod:`urc.pools.pageops`): ``free``
    checks the pages' states and pushes the runs of consecutive pages it frees (a value is
    mostly such runs: a few extents, not one entry per page), ``alloc`` takes pages from the
    top extents -- no torch dispatch beyond building the returned tensor.
    """

    __slots__ = (
        "_arange",
        "_ext_len",
        "_ext_lo",
        "_free_pages",
        "_next",
        "_ops",
        "_pending",
        "_pending_pages",
        "_shift",
        "_state",
        "device",
        "num_pages",
        "page_size",
        "size",
    )

    def __init__(self, size: int, page_size: int = 1, device: str | torch.device = "cpu") -> None:
        check_page_size(page_size)
        if size <= 0 or size % page_size:
            raise ConfigError(f"size must be a positive multiple of page_size, got {size}")
        self.size = size
        self.page_size = page_size
        self._shift = page_size.bit_length() - 1
        self.device = torch.device(device)
        self.num_pages = size // page_size
        self._arange = torch.arange(page_size, dtype=torch.int64, device=self.device)
        # Per page: FREE, HELD (a caller's) or TREE (the tree's): see the module docstring.
        self._state = np.zeros(self.num_pages, dtype=np.int8)
        # The free extents: at most one per free page (disjoint, each at least a page).
        # Empty arrays: only the extents in use are ever touched.
        self._ext_lo = np.empty(self.num_pages, dtype=np.int64)
        self._ext_len = np.empty(self.num_pages, dtype=np.int64)
        self._ops: PageOps = select_page_ops(WalkImpl.AUTO)
        self.clear()

    def use_page_ops(self, impl: WalkImpl) -> None:
        """Run the page bookkeeping with ``impl`` (:func:`urc.pools.pageops.select_page_ops`); both
        implementations give the same results, so this only changes speed."""
        self._ops = select_page_ops(impl)

    def clear(self) -> None:
        """Mark every slot free (drops all outstanding allocations)."""
        # One extent: a fresh allocator hands out ascending pages.
        self._ext_lo[0] = 0
        self._ext_len[0] = self.num_pages
        self._next = 1
        self._free_pages = self.num_pages
        self._state[:] = 0
        self._pending: list[torch.Tensor] = []
        self._pending_pages = 0

    def available_size(self) -> int:
        """Number of free token slots (queued frees included)."""
        return (self._free_pages + self._pending_pages) * self.page_size

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Allocate ``num_tokens`` slots (whole pages); ``None`` when not enough are free."""
        num_tokens = slot_count(num_tokens, "num_tokens")
        ps = self.page_size
        need = -(-num_tokens // ps)
        if need > self._free_pages:
            self.flush()
            if need > self._free_pages:
                return None
        pages = np.empty(need, dtype=np.int64)
        self._next = self._ops.take(self._state, self._ext_lo, self._ext_len, self._next, pages)
        self._free_pages -= need
        out = torch.from_numpy(pages)
        if self.device.type != "cpu":
            out = out.to(self.device)
        if ps == 1:
            return out
        return (out.unsqueeze(1) * ps + self._arange).reshape(-1)[:num_tokens]

    def _pages_of(self, indices: torch.Tensor) -> np.ndarray:
        host = _host(indices)
        return host if self.page_size == 1 else host[:: self.page_size] >> self._shift

    def free(self, indices: torch.Tensor) -> None:
        """Free the pages owned by ``indices``.

        Raises :class:`InvalidIndicesError` for a non-int64 tensor, another device, or an index
        outside ``[0, size)``, :class:`TreeOwnedSlotError` for a page the tree owns, and
        :class:`DoubleFreeError` when a page is not allocated or is named twice; in every
        case nothing is freed.  O(len(indices)).
        """
        self._check_tensor(indices)
        k = indices.shape[0]
        if k == 0:
            return
        self.flush()  # a page still queued must count as free to catch a double free
        self._free_span(_host(indices), 0, k)

    def free_span(
        self, indices: torch.Tensor, start: int, end: int, checked: np.ndarray | None = None
    ) -> None:
        """``free(indices[start:end])`` without slicing the tensor (``0 <= start <= end <=
        len(indices)``); raises and frees like :meth:`free`.  ``checked``: the host view that
        :meth:`check_owned` returned for ``indices``, when it checked a span that holds this
        one and nothing was freed since: every page is then known to be allocated and in
        range, so neither the tensor nor the allocation count is checked again (what the
        free costs is the release alone)."""
        if start >= end:
            return
        if checked is None:
            self._check_tensor(indices)
            self.flush()
            self._free_span(_host(indices), start, end)
        else:
            self.flush()
            self._free_span(checked, start, end, True)

    def _check_tensor(self, indices: torch.Tensor, what: str = "indices") -> None:
        if not isinstance(indices, torch.Tensor):
            raise InvalidIndicesError(f"{what} must be a tensor, got {type(indices).__name__}")
        if indices.dtype != torch.int64 or indices.device != self.device or indices.dim() != 1:
            raise InvalidIndicesError(
                f"{what} must be a 1-D int64 tensor on {self.device}, "
                f"got {indices.dtype} {tuple(indices.shape)} on {indices.device}"
            )

    def _free_span(self, host: np.ndarray, start: int, end: int, checked: bool = False) -> None:
        ps = self.page_size
        ops = self._ops
        n = (end - start + ps - 1) >> self._shift  # the pages: every ps-th entry
        if self._free_pages + n > self.num_pages:
            # More pages than are allocated: out of range, not allocated, or a repeat.
            if not checked:
                raise self.refusal(host, start, end, "freeing")
            raise DoubleFreeError("freeing more pages than are allocated (a page repeats)")
        # Extents of page numbers (the caller may reuse its tensor); unless ``checked``, the
        # allocation check reads the same pass.
        args = (self._state, self._ext_lo, self._ext_len, self._next, host, start, end, ps)
        if checked:
            self._next = ops.release(*args, self._shift)
        else:
            try:
                nxt = ops.release_held(*args, self._shift)
            except IndexError:
                raise InvalidIndicesError(f"indices outside [0, {self.size})") from None
            if nxt < 0:
                raise self.refusal(host, start, end, "freeing")
            self._next = nxt
        self._free_pages += n

    def refusal(
        self, host: np.ndarray, start: int, end: int, doing: str, want: int = HELD
    ) -> InvalidIndicesError | DoubleFreeError:
        """The error for the page runs of ``host[start:end]`` that were refused because a
        page is not in state ``want`` (or repeats): out of range, tree-owned, free, or named
        twice (checked in that order; numpy, on the error path only)."""
        h = host[start:end]
        pages = h[:: self.page_size] >> self._shift
        if int(h.min()) < 0 or int(h.max()) >= self.size:
            return InvalidIndicesError(f"{doing} indices outside [0, {self.size})")
        states = self._state[pages]
        if want != TREE and bool((states == TREE).any()):
            page = int(pages[states == TREE][0])
            return TreeOwnedSlotError(f"{doing} slot {page * self.page_size}, owned by the tree")
        if bool((states == FREE).any()):
            page = int(pages[states == FREE][0])
            return DoubleFreeError(f"{doing} slot {page * self.page_size}, which is not allocated")
        if bool((states != want).any()):
            return InvalidIndicesError(f"{doing} a slot that is not the caller's")
        return DoubleFreeError(f"{doing} a slot named twice in one call")

    def claim_value(
        self,
        indices: torch.Tensor,
        start: int,
        held_from: int,
        tensor_checked: bool = False,
        host: np.ndarray | None = None,
        adopt_from: int | None = None,
    ) -> np.ndarray:
        """Validate an insert's value and adopt its new part: ``indices[start:held_from]``
        must be allocated (the tree's own slots a match gave the caller, or the caller's),
        ``indices[held_from:]`` held by the caller with no page named twice; those pages
        become tree-owned.  Returns the host view (for :meth:`free_span`'s ``checked``).
        Raises like :meth:`free` (:class:`InvalidIndicesError` and subclasses for every
        refusal), changing nothing.  Undo the adoption of a range with :meth:`unclaim`.
        ``start`` and ``held_from``: page boundaries.  ``tensor_checked``: the caller knows
        ``indices`` is a 1-D int64 tensor on this device; ``host``: its host view, when the
        caller has it.

        ``adopt_from`` (page 1): ``indices[held_from:adopt_from]`` duplicate cached tokens:
        they are neither read nor adopted here, and the insert frees them with
        :meth:`free_held` once nothing else can fail (one pass over them, not two); only
        ``indices[adopt_from:]`` is checked and adopted."""
        if not tensor_checked:
            self._check_tensor(indices, "value")
        if host is None:
            host = _host(indices)
        k = host.shape[0]
        if k <= start:
            return host
        self.flush()
        ps = self.page_size
        if held_from < start:  # min(k, max(start, held_from)) without the builtins' calls
            held_from = start
        if held_from > k:
            held_from = k
        bound = self.size if ps > 1 else -1
        shift = self._shift
        if held_from > start:
            held = self._ops.count_held(self._state, host, start, held_from, ps, shift, bound)
            if held < 0:
                raise InvalidIndicesError(f"value indices outside [0, {self.size})")
            if held != (held_from - start + ps - 1) >> shift:
                raise InvalidIndicesError("value holds slots that are not allocated")
        checked_from = held_from  # a refusal names what is wrong in all of it
        if adopt_from is not None and adopt_from > held_from:
            assert ps == 1, f"adopt_from {adopt_from} at page size {ps}"
            held_from = adopt_from if adopt_from < k else k
        if held_from < k:
            got = self._ops.claim(self._state, host, held_from, k, ps, shift, bound, HELD, TREE)
            if got < 0:
                raise self.value_refusal(host, checked_from, k)
        return host

    def value_refusal(self, host: np.ndarray, start: int, end: int) -> InvalidIndicesError:
        """The error :meth:`claim_value` raises when it refuses ``host[start:end]`` (page
        runs that should be the caller's, each once), for states as they were before it."""
        err = self.refusal(host, start, end, "inserting")
        if isinstance(err, DoubleFreeError):  # an insert's input error, not a free's
            return InvalidIndicesError(f"value: {err}")
        return err

    def free_held(self, host: np.ndarray, start: int, end: int) -> bool:
        """Free the page runs ``host[start:end]`` if every page is held by the caller, once
        (the checked free of :meth:`free_span`, on a host view: one pass); ``False``, with
        nothing freed, otherwise: the caller reports it (an insert raises
        :meth:`value_refusal`)."""
        if start >= end:
            return True
        self.flush()
        try:
            self._free_span(host, start, end)
        except (InvalidIndicesError, DoubleFreeError):
            return False
        return True

    def check_held(self, indices: torch.Tensor, doing: str = "passing") -> np.ndarray:
        """Raise like :meth:`free` unless ``indices`` (page runs) are a 1-D int64 tensor on
        this device whose pages are all held by the caller, each once; changes nothing.
        Returns the host view.  Two passes (a round trip through the tree-owned state)."""
        self._check_tensor(indices)
        host = _host(indices)
        k = host.shape[0]
        if k == 0:
            return host
        self.flush()
        ps, shift = self.page_size, self._shift
        if self._ops.claim(self._state, host, 0, k, ps, shift, self.size, HELD, TREE) < 0:
            raise self.refusal(host, 0, k, doing)
        self._ops.claim(self._state, host, 0, k, ps, shift, -1, TREE, HELD)
        return host

    def unclaim(self, host: np.ndarray, start: int, end: int) -> None:
        """Give the tree-owned pages of ``host[start:end]`` (page runs, adopted by
        :meth:`claim_value`) back to the caller."""
        if start >= end:
            return
        got = self._ops.claim(
            self._state, host, start, end, self.page_size, self._shift, -1, TREE, HELD
        )
        assert got >= 0, f"unclaim of [{start}, {end}): a page is not tree-owned ({got})"

    def adopt(self, indices: torch.Tensor) -> None:
        """The caller-held page runs ``indices`` become tree-owned (a load-back's slots, now
        a node's value)."""
        host = _host(indices)
        k = host.shape[0]
        if k == 0:
            return
        self.flush()
        got = self._ops.claim(self._state, host, 0, k, self.page_size, self._shift, -1, HELD, TREE)
        assert got >= 0, f"adopting {k} slots: a page is not held ({got})"

    def num_tree_slots(self) -> int:
        """Slots in tree-owned pages, queued frees merged first (O(size); for sanity checks)."""
        self.flush()
        return int(np.count_nonzero(self._state == TREE)) * self.page_size

    def _release_pages(self, pages: np.ndarray) -> None:
        """Mark ``pages`` free and push them on the free extents (no checks)."""
        n = pages.shape[0]
        self._next = self._ops.release(
            self._state, self._ext_lo, self._ext_len, self._next, pages, 0, n, 1, 0
        )
        self._free_pages += n

    def free_owned(self, indices: torch.Tensor) -> None:
        """Free whole pages the caller is known to own: slots the tree adopted after checking
        them (``check_owned`` at insert).  O(1): ``indices`` is queued (keep it unmodified)
        and merged without re-validation when an allocation runs short or page states are
        read; a bug that frees twice still shows up in :meth:`check_consistency`."""
        n = indices.shape[0]
        assert not n & (self.page_size - 1), f"free_owned of {n} slots: not whole pages"
        pending = self._pending
        pending.append(indices)
        self._pending_pages += n >> self._shift
        if len(pending) >= MERGE_BATCH:
            self.flush()

    def flush(self) -> None:
        """Merge the queued :meth:`free_owned` frees into the free extents now."""
        pending = self._pending
        if not pending:
            return
        n = self._pending_pages
        self._pending = []
        self._pending_pages = 0
        assert self._free_pages + n <= self.num_pages, (
            f"merging {n} freed pages into {self._free_pages} free of {self.num_pages}"
        )
        for indices in merged_groups(pending):
            self._release_owned(self._pages_of(indices))

    def _release_owned(self, pages: np.ndarray) -> None:
        """Release queued pages (subclasses release what they pair with them too)."""
        self._release_pages(pages)

    def is_allocated(self, indices: torch.Tensor) -> bool:
        """True when every page owned by ``indices`` is currently allocated."""
        if indices.shape[0] == 0:
            return True
        self.flush()
        pages = self._pages_of(indices)
        return bool(int(np.count_nonzero(self._state[pages])) == pages.shape[0])

    def check_owned(self, indices: torch.Tensor, start: int = 0) -> np.ndarray:
        """Raise :class:`InvalidIndicesError` unless ``indices[start:]`` is a valid allocated
        span; returns the host (numpy) view of ``indices`` it checked, for
        :meth:`free_span`'s ``host``.

        Checks dtype, device, range and allocation state without changing anything (host
        side: one pass over the indices, what ``insert`` pays to validate a value).
        """
        self._check_tensor(indices, "value")
        host = _host(indices)
        k = host.shape[0]
        if k <= start:
            return host
        self.flush()
        ps = self.page_size
        # Page 1: the page lookup is the range check; larger pages check every entry too.
        bound = self.size if ps > 1 else -1
        held = self._ops.count_held(self._state, host, start, k, ps, self._shift, bound)
        if held < 0:
            raise InvalidIndicesError(f"indices outside [0, {self.size})")
        if held != (k - start + ps - 1) >> self._shift:
            raise InvalidIndicesError("value holds slots that are not allocated")
        return host

    def check_consistency(self) -> None:
        """Assert that the free extents and the page states agree (O(size); for sanity checks).

        Also catches a page freed twice within one ``free`` call (listed twice)."""
        self.flush()
        nxt = self._next
        lo, length = self._ext_lo[:nxt], self._ext_len[:nxt]
        n_free = self._free_pages
        assert (length > 0).all(), "an empty free extent"
        assert int(length.sum()) == n_free, (
            f"{int(length.sum())} pages in extents, {n_free} counted"
        )
        free = np.repeat(lo - (np.cumsum(length) - length), length) + np.arange(n_free)
        assert int(self._state.max(initial=0)) <= TREE and int(self._state.min(initial=0)) >= 0
        n_state_free = int((self._state == 0).sum())
        assert n_state_free == n_free, f"{n_state_free} pages marked free, {n_free} listed"
        assert (self._state[free] == 0).all(), "a listed free page is marked allocated"
        assert np.unique(free).shape[0] == n_free, "a page is listed free twice"


def merged_groups(spans: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    """``spans`` in order, concatenated in groups of at least ``_CAT_SLOTS`` slots (the last
    group may be smaller; a long span is a group of its own)."""
    group: list[torch.Tensor] = []
    slots = 0
    for t in spans:
        group.append(t)
        slots += t.shape[0]
        if slots >= _CAT_SLOTS:
            yield group[0] if len(group) == 1 else torch.cat(group)
            group = []
            slots = 0
    if group:
        yield group[0] if len(group) == 1 else torch.cat(group)


def _host(t: torch.Tensor) -> np.ndarray:
    """A numpy view of an index tensor (a copy only when it lives on an accelerator)."""
    try:
        return t.numpy()  # CPU: a view (the common case, without asking for the device)
    except TypeError:  # an accelerator's tensor
        return t.cpu().numpy()
