"""Benchmarks, each a ``python -m`` command that prints figures:

| module | measures |
|---|---|
| :mod:`urc.apps.bench.core` | the synchronous core: insert, match, lock, unlock, evict |
| :mod:`urc.apps.bench.service` | the async service against the core, 1..N clients |
| :mod:`urc.apps.bench.chunk` | replay cost per token against the prefill chunk size |
| :mod:`urc.apps.bench.transfer` | host-tier copies (backup and load-back) |
| :mod:`urc.apps.bench.storage` | the L3 stores (local files, Valkey, Mooncake) |
| :mod:`urc.apps.bench.metrics` | the Prometheus exporter's overhead on the service |
| :mod:`urc.apps.bench.compare` | two source trees' core benchmark in one process (ratios) |
"""

__all__: list[str] = []
