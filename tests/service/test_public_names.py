"""Every public module of the service package (and the command and request modules it
applies) exports exactly these names, and each of them exists."""

from __future__ import annotations

import importlib

import pytest

EXPORTS: dict[str, set[str]] = {
    "urc.service": {
        "AsyncUnifiedRadixCache",
        "BackgroundWorker",
        "CommandKind",
        "InsertOutcome",
        "Lease",
        "LoadBackPolicy",
        "MatchOutcome",
        "NodeHandle",
        "ServiceState",
        "TraceHook",
    },
    "urc.service.facade": {"AsyncUnifiedRadixCache"},
    "urc.service.transport": {"Transport"},
    "urc.service.actor": {"Actor"},
    "urc.service.workers": {"BackgroundWorker", "WorkerSupervisor"},
    "urc.service.lifecycle": {"Lifecycle"},
    "urc.service.base": {"LoadBackPolicy", "ServiceBase", "ServiceState", "TraceHook"},
    "urc.service.call": {"ON_CANCEL", "OnCancel", "ServiceCall"},
    "urc.service.anyio_private": {
        "backend_checkpoint_if_cancelled",
        "private_api_problems",
        "stream_buffer_holds",
    },
    "urc.request_ops": {
        "PendingLoad",
        "alloc_req_mamba",
        "alloc_req_row",
        "finish_req_load",
        "match_req",
        "slide_req_window",
        "start_req_load",
        "write_req_slots",
    },
    "urc.commands": {
        "Alloc",
        "AllocMamba",
        "AllocReqMamba",
        "AllocReqRow",
        "CacheFinishedReq",
        "CacheUnfinishedReq",
        "Call",
        "Command",
        "CommandKind",
        "Evict",
        "FinishReqLoad",
        "Free",
        "FreeMamba",
        "Insert",
        "InsertOutcome",
        "Lock",
        "Match",
        "MatchOutcome",
        "MatchReq",
        "Release",
        "SanityCheck",
        "SlideReqWindow",
        "StartReqLoad",
        "Stats",
        "WriteReqSlots",
    },
    "urc.executor": {"CommandExecutor", "give_back"},
    "urc.lease": {"Lease", "LeaseOwner", "NodeHandle"},
}


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_module_exports_exactly_its_public_names(name: str) -> None:
    module = importlib.import_module(name)
    assert set(module.__all__) == EXPORTS[name]
    assert len(module.__all__) == len(set(module.__all__)), "a name is listed twice"
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, f"{name} lists names it does not define: {missing}"


def test_every_command_has_a_cancellation_rule_and_a_handler() -> None:
    from urc.commands import Command
    from urc.executor import CommandExecutor
    from urc.service.call import ON_CANCEL

    commands = set(Command.__args__)  # type: ignore[attr-defined]
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
