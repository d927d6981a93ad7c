"""Prometheus metrics of one engine, named as vLLM's with the prefix `rackserve:` so dashboards
written for one read the other.

PrometheusStatLogger is a StatLogger: the engine's step loop calls `record` after every step.
It owns its own CollectorRegistry (never the global one, so several engines or test servers in
one process do not collide). It must never block or raise inside `record`.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from rackserve.core.stats import SchedulerStats
from rackserve.engine.stats import IterationStats, StatLogger

PREFIX = "rackserve:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 10.0, 20.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)


class PrometheusStatLogger(StatLogger):
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use, 0 to 1.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        # KV connectors (kv_transfer/): prompt tokens asked of the connector and found through it.
        self.external_prefix_cache_queries = counter("external_prefix_cache_queries",
                                                     "Prompt tokens looked up through the KV connector.")
        self.external_prefix_cache_hits = counter("external_prefix_cache_hits",
                                                  "Prompt tokens loaded through the KV connector.")
        self.kv_transfer_blocks = counter("kv_transfer_blocks", "KV blocks a KV connector loaded or stored.")
        self.kv_transfer_bytes = counter("kv_transfer_bytes", "Bytes a KV connector loaded or stored.")
        self.kv_transfer_load_seconds = histogram("kv_transfer_load_seconds", "Time to load one request's "
                                                  "blocks through a KV connector.", ITL_BUCKETS)
        self.kv_transfer_store_seconds = histogram("kv_transfer_store_seconds", "Time to store one block "
                                                   "through a KV connector.", ITL_BUCKETS)
        self.kv_offload_tier_bytes = Gauge(PREFIX + "kv_offload_tier_bytes", "Bytes a KV offload tier holds.",
                                           labels + ["tier"], registry=self.registry)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted to free KV cache.")
        # Speculative decoding (vLLM's spec_decode_* names): accepted / draft tokens is the acceptance rate.
        self.spec_decode_num_drafts = counter("spec_decode_num_drafts", "Decodes that computed draft tokens.")
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens computed.")
        self.spec_decode_num_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                                       "Draft tokens kept (the model sampled them itself).")
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Time to first token.",
                                             TTFT_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Time between tokens.",
                                             ITL_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds",
                                             "Time from arrival to the last token.", E2E_BUCKETS)
        # Labelled per finish reason at record time: "stop", "length", "abort", "error".
        self.request_success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                       labels + ["finished_reason"], registry=self.registry)
        # Data parallelism: each DP rank's scheduler, labelled dp_rank at record time; the gauges
        # above sum them. Busy + idle of a rank add up to the time of the steps' slowest rank.
        per_rank = labels + ["dp_rank"]
        self.dp_running = Gauge(PREFIX + "dp_rank_num_requests_running", "Requests running on a DP rank.",
                                per_rank, registry=self.registry)
        self.dp_waiting = Gauge(PREFIX + "dp_rank_num_requests_waiting", "Requests waiting on a DP rank.",
                                per_rank, registry=self.registry)
        self.dp_kv_usage = Gauge(PREFIX + "dp_rank_kv_cache_usage_perc", "Fraction of a DP rank's KV blocks in "
                                 "use, 0 to 1.", per_rank, registry=self.registry)
        self.dp_busy = Counter(PREFIX + "dp_rank_busy_seconds", "Time a DP rank computed in steps, collectives "
                               "excluded.", per_rank, registry=self.registry)
        self.dp_idle = Counter(PREFIX + "dp_rank_idle_seconds", "Time a DP rank waited in steps for the "
                               "slowest DP rank.", per_rank, registry=self.registry)
        self.dp_idle_share = gauge("dp_idle_share", "Share of the DP ranks' step time spent waiting for the "
                                   "slowest rank, since start, 0 to 1.")
        self._dp_busy_total = self._dp_idle_total = 0.0
        # MoE models: labelled per global expert (summed over the layers, to keep the series few).
        self.moe_expert_tokens = Counter(PREFIX + "moe_expert_tokens", "Tokens routed to an expert, one per "
                                         "token and chosen expert, summed over the MoE layers.",
                                         labels + ["expert"], registry=self.registry)

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self.num_requests_running.set(scheduler_stats.num_running_reqs)
        self.num_requests_waiting.set(scheduler_stats.num_waiting_reqs)
        self.kv_cache_usage_perc.set(scheduler_stats.kv_cache_usage)
        # Counters refuse negative increments; a stat logger must not raise, so only count up.
        for counter, value in ((self.prefix_cache_queries, scheduler_stats.prefix_cache_queries),
                               (self.prefix_cache_hits, scheduler_stats.prefix_cache_hits),
                               (self.num_preemptions, scheduler_stats.num_preemptions),
                               (self.spec_decode_num_drafts, scheduler_stats.num_drafts),
                               (self.spec_decode_num_draft_tokens, scheduler_stats.num_draft_tokens),
                               (self.spec_decode_num_accepted_tokens, scheduler_stats.num_accepted_tokens),
                               (self.external_prefix_cache_queries, scheduler_stats.external_prefix_cache_queries),
                               (self.external_prefix_cache_hits, scheduler_stats.external_prefix_cache_hits),
                               (self.prompt_tokens, iteration_stats.num_prompt_tokens),
                               (self.generation_tokens, iteration_stats.num_generation_tokens)):
            if value > 0:
                counter.inc(value)
        moved = scheduler_stats.kv_transfer
        if moved.blocks > 0:
            self.kv_transfer_blocks.inc(moved.blocks)
            self.kv_transfer_bytes.inc(moved.bytes)
        for seconds in moved.load_seconds:
            self.kv_transfer_load_seconds.observe(seconds)
        for seconds in moved.store_seconds:
            self.kv_transfer_store_seconds.observe(seconds)
        for tier, held in moved.tier_bytes.items():
            self.kv_offload_tier_bytes.labels(self.model_name, tier).set(held)
        for ttft in iteration_stats.time_to_first_tokens:
            self.time_to_first_token.observe(ttft)
        for itl in iteration_stats.inter_token_latencies:
            self.inter_token_latency.observe(itl)
        for finished in iteration_stats.finished_requests:
            self.e2e_request_latency.observe(finished.e2e_latency)
            self.request_success.labels(self.model_name, finished.finish_reason).inc()
        for dp_rank, rank in enumerate(scheduler_stats.dp_ranks):
            label = (self.model_name, str(dp_rank))
            self.dp_running.labels(*label).set(rank.num_running_reqs)
            self.dp_waiting.labels(*label).set(rank.num_waiting_reqs)
            self.dp_kv_usage.labels(*label).set(rank.kv_cache_usage)
            if rank.busy_seconds is not None:
                self.dp_busy.labels(*label).inc(max(rank.busy_seconds, 0.0))
                self.dp_idle.labels(*label).inc(max(rank.idle_seconds, 0.0))
                self._dp_busy_total += max(rank.busy_seconds, 0.0)
                self._dp_idle_total += max(rank.idle_seconds, 0.0)
        if self._dp_busy_total + self._dp_idle_total > 0:
            self.dp_idle_share.set(self._dp_idle_total / (self._dp_busy_total + self._dp_idle_total))
        for expert, n in enumerate(scheduler_stats.expert_token_counts or ()):
            if n > 0:
                self.moe_expert_tokens.labels(self.model_name, str(expert)).inc(n)

    def exposition(self) -> bytes:
        """The text /metrics serves."""
        return generate_latest(self.registry)
