"""How many slots an allocation asks for: the one check every allocator's ``alloc`` makes."""

from __future__ import annotations

import operator

from urc.errors import InvalidIndicesError, InvalidInputError

__all__ = ["slot_count"]


def slot_count(value: object, name: str) -> int:
    """``value`` as a number of slots (an ``int`` or anything with ``__index__``).

    Raises :class:`~urc.errors.InvalidInputError` naming ``name`` and the value as given (a
    float, a string) and :class:`~urc.errors.InvalidIndicesError` for a negative count."""
    if type(value) is int:
        count = value
    else:
        try:
            count = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            raise InvalidInputError(
                f"{name} must be an int, got {value!r} ({type(value).__name__})"
            ) from None
    if count < 0:
        raise InvalidIndicesError(f"cannot allocate a negative number of slots: {name}={count}")
    return count
