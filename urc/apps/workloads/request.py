"""The request record every workload source yields (traces and synthetic generators alike)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TraceRequest"]


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One prefill request of a workload, in arrival order.

    Attributes:
        index: 0-based position of the request in its workload (the order it is yielded in; for
            a trace file this is not the line number, since blank lines are skipped).
        timestamp_ms: arrival time in milliseconds from the start of the workload; non-decreasing
            along a workload.
        input_ids: the prompt's token ids. A tuple, so the record is truly immutable and can be
            shared between the replay loop, the ideal-hit oracle and reports without defensive
            copies; the cache consumes ``list[int]``, and ``list(request.input_ids)`` is a single
            C-level copy (about 1 ns per token), negligible next to a cache operation.
        output_length: number of tokens the request generates (not part of the prompt).
        input_length: ``len(input_ids)``, checked on construction.
        namespace: the cache ``extra_key`` as a typed tuple (tenant, LoRA id, ...), or ``None``
            for the default namespace. Requests in different namespaces never share prefixes.
        hash_ids: for Mooncake traces, the block hash ids the tokens were expanded from (one per
            block of ``block_size`` tokens, the last one possibly partial); ``None`` for
            synthetic workloads.
        session_id: the session (agent flow) the request belongs to, for workloads that have
            them (:mod:`urc.apps.workloads.agentic`); ``None`` otherwise.
        stop: why the request's generation stopped, as the trace records it (``"tool_use"``,
            ``"end_turn"``, ``""``), or ``None`` when the workload does not say.
        model_time_ms: how long the model took to answer (the finish is at
            ``timestamp_ms + model_time_ms``); 0 when unknown.
        parent_session_id: for a sub-agent's request, the session that started it;
            ``None`` otherwise.

    Raises:
        ValueError: if ``input_length != len(input_ids)`` or a length or time is negative.
    """

    index: int
    timestamp_ms: int
    input_ids: tuple[int, ...]
    output_length: int
    input_length: int
    namespace: tuple[str, ...] | None = None
    hash_ids: tuple[int, ...] | None = None
    session_id: str | None = None
    stop: str | None = None
    model_time_ms: int = 0
    parent_session_id: str | None = None

    def __post_init__(self) -> None:
        # Cheap O(1) checks only: the record is built once per request on the hot path.
        if self.input_length != len(self.input_ids):
            raise ValueError(
                f"request {self.index}: input_length {self.input_length} != "
                f"len(input_ids) {len(self.input_ids)}"
            )
        if self.index < 0 or self.timestamp_ms < 0 or self.output_length < 0:
            raise ValueError(
                f"request {self.index}: index, timestamp_ms and output_length must be >= 0"
            )
