"""Prometheus metrics of the engine (registered in the daemon's registry)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvagentd.engine.job import GenerationResult

_SIZE_BUCKETS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.registry = r
        self.requests = Counter("kvagentd_engine_requests_total", "Generation requests by outcome",
                                ["priority", "outcome"], registry=r)
        self.rejected = Counter("kvagentd_engine_rejected_total",
                                "Requests refused because the queue was full", registry=r)
        self.reused_tokens = Counter("kvagentd_engine_reused_tokens_total",
                                     "Prompt tokens served from stored KV blocks", registry=r)
        self.recomputed_tokens = Counter(
            "kvagentd_engine_recomputed_tokens_total",
            "Tokens recomputed because stored blocks were missing or corrupt", registry=r)
        self.prefill_tokens = Counter("kvagentd_engine_prefill_tokens_total",
                                      "Tokens run through prefill", registry=r)
        self.generated_tokens = Counter("kvagentd_engine_generated_tokens_total",
                                        "Tokens generated", registry=r)
        self.ttft = Histogram("kvagentd_engine_ttft_seconds", "Time to first token", ["priority"],
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                              registry=r)
        self.queue_wait = Histogram("kvagentd_engine_queue_wait_seconds", "Time queued",
                                    ["priority"], registry=r)
        self.queue_depth = Gauge("kvagentd_engine_queue_depth", "Requests waiting", registry=r)
        self.batch_size = Histogram("kvagentd_engine_batch_size", "Sequences per model step",
                                    buckets=_SIZE_BUCKETS, registry=r)
        self.step_seconds = Histogram(
            "kvagentd_engine_step_seconds", "Wall time of one batched model step",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5), registry=r)
        self.step_tokens = Counter("kvagentd_engine_step_tokens_total",
                                   "Tokens run through batched steps", registry=r)
        self.preemptions = Counter("kvagentd_engine_preemptions_total",
                                   "Sequences preempted (blocks given back to the store)",
                                   ["priority"], registry=r)
        self.batch_memory = Gauge("kvagentd_engine_batch_memory_bytes",
                                  "Memory running sequences hold beyond the hot pool", registry=r)

    def observe(self, priority: str, result: GenerationResult) -> None:
        outcome = result.finish_reason or "stop"
        self.requests.labels(priority, outcome).inc()
        self.reused_tokens.inc(result.reused_tokens)
        self.prefill_tokens.inc(result.prefill_tokens)
        self.generated_tokens.inc(result.new_tokens)
        self.ttft.labels(priority).observe(result.ttft_s)
        self.queue_wait.labels(priority).observe(result.queue_wait_s)
