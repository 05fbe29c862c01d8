"""SGLang's ``--hicache-*`` launch options as urc's host-tier configuration, and the ones
urc refuses at start-up (each as one ``"--flag: why"`` line)."""

from __future__ import annotations

import logging
from typing import Any

from hicache.config import HiCacheConfig
from hicache.host_layout import HostLayout
from hicache.transfer_engine import ThreadTransferEngine, TransferEngine, engine_for
from urc.apps.sglang._l3 import STORAGE_BACKENDS, attach_storage
from urc.apps.sglang._load_back import LayerLoadCounter, layer_plan
from urc.host_protocol import WritePolicy
from urc.node import ComponentType

__all__ = [
    "HOST_LAYOUTS",
    "hicache_config",
    "hicache_refusals",
    "start_layerwise_load_back",
    "start_storage",
    "storage_refusals",
    "transfer_engine",
]

#: ``--hicache-mem-layout`` values urc's host pools hold, as urc's layouts.
HOST_LAYOUTS = {"layer_first": HostLayout.LAYER_FIRST, "page_first": HostLayout.PAGE_FIRST}


def hicache_refusals(memory: Any) -> list[str]:
    """The ``--hicache-*`` options of SGLang's published memory args (``memory``) that urc's
    host tier does not serve, one ``"--flag value: why"`` line each (empty: all served)."""
    out: list[str] = []
    if memory.hicache_mem_layout not in HOST_LAYOUTS:
        out.append(
            f"--hicache-mem-layout {memory.hicache_mem_layout}: urc's host pools hold "
            f"{' or '.join(HOST_LAYOUTS)}"
        )
    backend = memory.hicache_storage_backend
    if backend is not None and backend not in STORAGE_BACKENDS:
        out.append(
            f"--hicache-storage-backend {backend}: with urc as the tree the L3 is one of "
            f"urc's stores ({', '.join(STORAGE_BACKENDS)})"
        )
    return out


def storage_refusals(ctx: Any, memory: Any) -> list[str]:
    """What of ``--hicache-storage-backend`` urc cannot serve for this model."""
    if memory.hicache_storage_backend is None:
        return []
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm:
        return [
            "--hicache-storage-backend with a hybrid (sliding-window or Mamba) model: "
            "SGLang's page names cover Full KV pages only"
        ]
    return []


def start_storage(cache: Any, memory: Any) -> None:
    """Attach urc's L3 store for ``--hicache-storage-backend`` to the plug-in ``cache``
    (nothing when the option is unset or HiCache is off), named for this rank and model
    as SGLang names its pages."""
    if memory.hicache_storage_backend is None or cache.host is None:
        return
    from sglang.srt.runtime_context import get_parallel, get_serving

    parallel = get_parallel()
    cache.attach_l3(
        attach_storage(
            cache.urc,
            cache.host,
            memory.hicache_storage_backend,
            memory.hicache_storage_backend_extra_config,
            get_serving().served_model_name,
            memory.hicache_storage_prefetch_policy,
            parallel.tp_rank,
            parallel.tp_size,
        )
    )


def hicache_config(memory: Any, bytes_per_slot: int) -> HiCacheConfig:
    """urc's host-tier configuration for SGLang's options: ``--hicache-write-policy``;
    the host pool's size from ``--hicache-size`` (GB, over ``bytes_per_slot`` bytes per
    token of the device's Full KV), else ``--hicache-ratio`` (SGLang resolves its default,
    2.0; unset: 2.0); ``--hicache-mem-layout`` (:data:`HOST_LAYOUTS`).  Call it after
    :func:`hicache_refusals` found nothing."""
    policy = WritePolicy(memory.hicache_write_policy)
    layout = HOST_LAYOUTS[memory.hicache_mem_layout]
    if memory.hicache_size:
        tokens = int(memory.hicache_size * (1 << 30) // max(bytes_per_slot, 1))
        return HiCacheConfig(write_policy=policy, host_tokens=tokens, host_layout=layout)
    return HiCacheConfig(
        write_policy=policy, host_ratio=memory.hicache_ratio or 2.0, host_layout=layout
    )


def transfer_engine(device: Any) -> TransferEngine:
    """Where the host tier's copies run inside SGLang's scheduler: on a worker thread per
    direction for a CPU device (the scheduler thread does not wait for a backup's copy),
    on CUDA streams otherwise (``hicache.transfer_engine.engine_for``)."""
    import torch

    device = torch.device(device)
    return ThreadTransferEngine() if device.type == "cpu" else engine_for(device)


def start_layerwise_load_back(cache: Any, ctx: Any) -> None:
    """On a CPU device, run the plug-in's load-backs layer by layer on the host tier's load
    worker, as SGLang's own HiCache does on CUDA: a :class:`LayerLoadCounter` registered on
    SGLang's KV pool (``register_layer_transfer_counter``: its reads of layer ``l`` wait
    for it) and model worker (``register_hicache_layer_transfer_counter``: the batch's
    consumer slot), with the plan of SGLang's per-layer K/V buffers (an ``SWAKVPool``'s
    ``layers_mapping`` names each model layer's half).  Elsewhere (CUDA, or no model worker
    to make a batch the consumer) load-backs stay synchronous."""
    import torch

    worker = getattr(ctx, "tp_worker", None)
    if cache.host is None or worker is None:
        return
    allocator = ctx.params.token_to_kv_pool_allocator
    if torch.device(allocator.device).type != "cpu":
        return
    kv = allocator.get_kvcache()
    if ctx.is_hybrid_swa:
        layers = [
            (ComponentType.SWA if is_swa else ComponentType.FULL, i)
            for i, is_swa in (kv.layers_mapping[g] for g in range(kv.layer_num))
        ]
        layers_of = {
            ComponentType.FULL: kv.full_kv_pool.layer_num,
            ComponentType.SWA: kv.swa_kv_pool.layer_num,
        }
    else:
        layers = [(ComponentType.FULL, i) for i in range(kv.layer_num)]
        layers_of = {ComponentType.FULL: kv.layer_num}
    counter = LayerLoadCounter(len(layers))
    cache.enable_layerwise_load_back(counter, layer_plan(layers, layers_of))
    kv.register_layer_transfer_counter(counter)
    worker.register_hicache_layer_transfer_counter(counter)
    logging.getLogger(__name__).info(
        "urc HiCache: load-backs layer by layer on the host tier's load worker (%d layers)",
        len(layers),
    )
