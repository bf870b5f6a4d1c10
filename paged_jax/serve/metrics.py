"""The server's Prometheus metrics (``/metrics``), in a registry of their own (so several
servers in one process, as in the tests, do not collide). Names follow vLLM's with the
``paged_jax:`` prefix.

- gauges read from ``LLM.usage()`` as of the last step: ``num_requests_running``,
  ``num_requests_waiting`` (waiting + swapped + submitted), ``num_requests_swapped``,
  ``kv_cache_blocks_used``, ``kv_cache_blocks_total``, ``kv_cache_usage_perc``,
  ``prefix_cache_queries`` / ``prefix_cache_hits`` (prompt tokens, counters) and
  ``prefix_cache_hit_rate``;
- histograms measured by the async engine when outputs reach it:
  ``time_to_first_token_seconds`` (submission to the first token), ``inter_token_latency_seconds``
  (between two outputs of a request that brought tokens), ``e2e_request_latency_seconds``;
- counters: ``request_success`` (by finish reason), ``prompt_tokens``, ``generation_tokens``,
  ``request_aborted`` (the client left), ``request_rejected`` (back-pressure).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

P = "paged_jax:"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


class _UsageCollector:
    def __init__(self):
        self.engine = None

    def collect(self):
        if self.engine is None:
            return
        u = self.engine.usage()
        running = GaugeMetricFamily(P + "num_requests_running", "Requests running (holding rows) in the engine.")
        running.add_metric([], u.running)
        waiting = GaugeMetricFamily(P + "num_requests_waiting", "Requests submitted and not running.")
        waiting.add_metric([], self.engine.num_waiting)
        swapped = GaugeMetricFamily(P + "num_requests_swapped", "Requests swapped out to host memory.")
        swapped.add_metric([], u.swapped)
        used = GaugeMetricFamily(P + "kv_cache_blocks_used", "KV blocks held by sequences.")
        used.add_metric([], u.blocks_used)
        total = GaugeMetricFamily(P + "kv_cache_blocks_total", "KV blocks in the pool(s).")
        total.add_metric([], u.num_blocks)
        perc = GaugeMetricFamily(P + "kv_cache_usage_perc", "Fraction of KV blocks held by sequences (0-1).")
        perc.add_metric([], u.blocks_used / u.num_blocks if u.num_blocks else 0.0)
        queries = CounterMetricFamily(P + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        queries.add_metric([], u.prefix_query_tokens)
        hits = CounterMetricFamily(P + "prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        hits.add_metric([], u.prefix_hit_tokens)
        rate = GaugeMetricFamily(P + "prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries.")
        rate.add_metric([], u.prefix_hit_tokens / u.prefix_query_tokens if u.prefix_query_tokens else 0.0)
        yield from (running, waiting, swapped, used, total, perc, queries, hits, rate)


class ServerMetrics:
    """The metrics of one server; ``render()`` is the ``/metrics`` body."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self._usage = _UsageCollector()
        self.registry.register(self._usage)
        r = self.registry
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Submission to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Between outputs of a request that brought tokens.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Submission to finish.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.success = Counter(P + "request_success", "Finished requests.", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated for finished requests.",
                                         registry=r)
        self.aborted = Counter(P + "request_aborted", "Requests aborted because their client left.", registry=r)
        self.rejected = Counter(P + "request_rejected", "Requests refused by back-pressure (503).", registry=r)

    def bind(self, engine) -> None:
        """Read the engine's counts (``AsyncEngine.usage()``) at every scrape."""
        self._usage.engine = engine

    def finished(self, reasons: list, generated: int, prompt_tokens: int, seconds: float) -> None:
        """A request ended after ``seconds``: each completion's finish reason, the tokens
        generated (all completions) and the prompt's length."""
        self.e2e.observe(seconds)
        for reason in reasons:
            self.success.labels(finish_reason=str(reason)).inc()
        self.generation_tokens.inc(generated)
        self.prompt_tokens.inc(prompt_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
