"""The router's Prometheus metrics (`rackserve_router:*`): requests routed per instance and
policy, the cached tokens the policy predicted against those the instance reported (usage),
KV event batches received and missed, index size, retries and healthy instances.

It owns its own CollectorRegistry and never decides anything.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "rackserve_router:"


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.registry = r = CollectorRegistry()
        self.requests = Counter(PREFIX + "requests", "Requests routed.", ["instance", "dp_rank", "policy"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens routed.", ["instance"], registry=r)
        self.predicted_cached = Counter(PREFIX + "predicted_cached_tokens",
                                        "Prompt tokens the policy expected cached where it routed.",
                                        ["instance"], registry=r)
        self.best_cached = Counter(PREFIX + "best_cached_tokens",
                                   "Prompt tokens cached on the worker that held the most of the prompt, "
                                   "at decision time: what the policy gave up for load is this minus predicted.",
                                   ["instance"], registry=r)
        self.moved_off_cache = Counter(PREFIX + "moved_off_cache", "Requests sent to a worker caching less of "
                                       "the prompt than the best-holding worker (a session leaving its cache).",
                                       ["instance"], registry=r)
        self.actual_cached = Counter(PREFIX + "actual_cached_tokens",
                                     "Prompt tokens the instance reported cached (usage).", ["instance"], registry=r)
        self.events_received = Counter(PREFIX + "kv_event_batches_received", "KV event batches applied.",
                                       ["instance"], registry=r)
        self.events_dropped = Counter(PREFIX + "kv_event_batches_dropped", "KV event batches missed.",
                                      ["instance"], registry=r)
        self.pd_decisions = Counter(PREFIX + "pd_decisions", "P/D pools: requests run whole on a decode worker "
                                    "(local) or prefilled on a prefill worker first (remote_prefill).",
                                    ["decision"], registry=r)
        self.client_disconnects = Counter(PREFIX + "client_disconnects", "Requests whose client left before "
                                          "the answer; each was aborted on its instance.", registry=r)
        self.retries = Counter(PREFIX + "retries", "Requests sent again to another instance.", registry=r)
        self.index_blocks = Gauge(PREFIX + "index_blocks", "Blocks in the KV index, all workers.", registry=r)
        self.healthy_instances = Gauge(PREFIX + "healthy_instances", "Instances in the pool.", registry=r)

    def routed(self, url: str, dp_rank: int, prompt_tokens: int, predicted_cached: int, best_cached: int) -> None:
        self.requests.labels(url, str(dp_rank), self.policy).inc()
        self.prompt_tokens.labels(url).inc(prompt_tokens)
        self.predicted_cached.labels(url).inc(predicted_cached)
        self.best_cached.labels(url).inc(best_cached)
        if best_cached > predicted_cached:
            self.moved_off_cache.labels(url).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
