"""The applications built on the library: the ``urc`` command (:mod:`urc.apps.cli`), trace
replay (:mod:`urc.apps.replay`), workload generators (:mod:`urc.apps.workloads`), the
benchmarks (:mod:`urc.apps.bench`) and the SGLang plug-in (:mod:`urc.apps.sglang`).  Nothing
in ``urc``, ``hicache`` or ``metrics`` imports this package."""

__all__: list[str] = []
