"""Request-to-token pool: one row of KV slot indices per running request."""

from __future__ import annotations

import torch

from urc.errors import ConfigError, DoubleFreeError, InvalidInputError

__all__ = ["ReqToTokenPool"]


class ReqToTokenPool:
    """``req_to_token[row, pos]`` is the KV slot of token ``pos`` of the request in ``row``.

    ``alloc`` hands out rows; ``free`` takes them back (a row that is not allocated is a
    :class:`DoubleFreeError`).
    """

    __slots__ = ("_free_rows", "_used", "device", "max_context_len", "req_to_token", "size")

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu") -> None:
        if size <= 0 or max_context_len <= 0:
            raise ConfigError(
                f"size and max_context_len must be positive: {size}, {max_context_len}"
            )
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=device)
        self.clear()

    def clear(self) -> None:
        """Free every row."""
        self._free_rows = list(range(self.size - 1, -1, -1))
        self._used: set[int] = set()

    def available_size(self) -> int:
        """Number of free rows."""
        return len(self._free_rows)

    def alloc(self) -> int | None:
        """Take one row; ``None`` when all rows are in use."""
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self._used.add(row)
        return row

    def free(self, row: int) -> None:
        """Return ``row``; raises :class:`DoubleFreeError` if it is not in use."""
        if row not in self._used:
            raise DoubleFreeError(f"request row {row} is not allocated")
        self._used.remove(row)
        self._free_rows.append(row)

    def check_row(self, row: object) -> int:
        """``row`` when it is a row in use; :class:`InvalidInputError` otherwise."""
        if type(row) is not int or row not in self._used:
            raise InvalidInputError(f"request row {row!r} is not allocated")
        return row

    def write(self, row: int, start: int, indices: torch.Tensor) -> None:
        """Store ``indices`` as the slots of tokens ``[start, start + len)`` of ``row``."""
        end = start + indices.shape[0]
        if row not in self._used or end > self.max_context_len:
            raise InvalidInputError(f"cannot write [{start}, {end}) into request row {row}")
        self.req_to_token[row, start:end] = indices

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        """Slots of tokens ``[start, end)`` of ``row`` (a view)."""
        return self.req_to_token[row, start:end]
