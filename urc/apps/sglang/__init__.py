"""urc as an SGLang (0.5.23) radix-cache backend: ``--radix-cache-backend urc``.

SGLang calls :func:`register` in every scheduler process (it is the
``sglang.srt.plugins`` entry point ``urc`` in this project's ``pyproject.toml``); it
registers :func:`create_cache` with SGLang's radix-cache registry.  :func:`create_cache`
builds urc's tree on SGLang's own pools from the ``TreeCacheBuildContext`` and returns an
object with SGLang's ``BasePrefixCache`` surface; a launch option urc does not serve raises
:class:`~urc.errors.ConfigError` naming the flag (:func:`unsupported_options`).

Importing this package does not import SGLang; :func:`register` and :func:`create_cache` do.
"""

from __future__ import annotations

from typing import Any

from urc.apps.sglang._factory import check_supported, create_cache, unsupported_options

__all__ = ["BACKEND_NAME", "check_supported", "create_cache", "register", "unsupported_options"]

#: The name ``--radix-cache-backend`` selects urc by.
BACKEND_NAME = "urc"


def register() -> None:
    """Register :func:`create_cache` as SGLang's radix-cache backend ``urc`` (idempotent:
    a second call in the same process changes nothing)."""
    from sglang.srt.mem_cache.registry import (
        get_radix_cache_factory,
        register_radix_cache_backend,
    )

    if get_radix_cache_factory(BACKEND_NAME) is None:
        register_radix_cache_backend(BACKEND_NAME, _factory)


def _factory(ctx: Any) -> Any:
    return create_cache(ctx)
