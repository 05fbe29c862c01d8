"""The service package's public face exports exactly these names, and each of them exists."""

from __future__ import annotations

import importlib

import pytest

EXPORTS: dict[str, set[str]] = {
    # The service's one public face; its modules are private (``urc.service._*``) and may
    # change freely.
    "urc.service": {
        "AsyncUnifiedRadixCache",
        "AttachableWorker",
        "BackgroundWorker",
        "Call",
        "Command",
        "CommandKind",
        "InsertOutcome",
        "KVEventPublisher",
        "KVEventsConfig",
        "KVPublisherStats",
        "Lease",
        "LoadBackPolicy",
        "MatchOutcome",
        "NodeHandle",
        "PullingObserver",
        "ServiceObserver",
        "ServiceSnapshot",
        "ServiceState",
        "StatsSource",
        "TraceHook",
        "TransferKind",
    },
}


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_module_exports_exactly_its_public_names(name: str) -> None:
    module = importlib.import_module(name)
    assert set(module.__all__) == EXPORTS[name]
    assert len(module.__all__) == len(set(module.__all__)), "a name is listed twice"
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, f"{name} lists names it does not define: {missing}"


def test_every_command_has_a_cancellation_rule_and_a_handler() -> None:
    from urc.service._call import ON_CANCEL
    from urc.service._commands import COMMAND_TYPES
    from urc.service._executor import CommandExecutor

    commands = set(COMMAND_TYPES)  # the classes (``Command`` names ``Call[Any]``)
    assert set(ON_CANCEL) == commands
    from urc import CacheConfig, build_cache

    executor = CommandExecutor(build_cache(CacheConfig(kv_size=16)))
    assert set(executor._dispatch) == commands


def test_the_lazy_top_level_exports_still_resolve() -> None:
    import urc
    from urc.service import AsyncUnifiedRadixCache, BackgroundWorker, ServiceState

    assert urc.AsyncUnifiedRadixCache is AsyncUnifiedRadixCache
    assert urc.BackgroundWorker is BackgroundWorker
    assert urc.ServiceState is ServiceState
