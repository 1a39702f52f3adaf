"""Prometheus metrics of the server (names follow vLLM's, under picovllm:): the server's own
counters and histograms, updated per request, and the engine's gauges and KV-transfer histogram,
read from the engine's metrics when /metrics is scraped (nothing per step). A server of several
HTTP processes (`--api-server-count`) keeps its counters and histograms in prometheus_client's
multiprocess mode, as vLLM's does, the processes' summed; PROMETHEUS_MULTIPROC_DIR is set before
this module is first imported. The engine's values are the same in every process."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, multiprocess
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

from picovllm.engine.kv_handoff import GAUGES, METRICS, TRANSFER_TIME_BUCKETS
from picovllm.engine.stats import OFFLOAD_METRICS
from picovllm.outputs import RequestOutput

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class ServerMetrics:
    """engine_metrics: the engine's metrics as of its last step (LLMEngine.get_metrics' dict)."""

    def __init__(self, engine_metrics: Callable[[], dict]):
        r = self.registry = CollectorRegistry()
        self.engine = _EngineMetrics(engine_metrics)
        r.register(self.engine)
        self.prompt_tokens = Counter("picovllm:prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("picovllm:generation_tokens", "Tokens generated.", registry=r)
        self.requests = Counter("picovllm:request_success", "Finished requests.", ["finished_reason"], registry=r)
        self.rejected = Counter(
            "picovllm:request_rejected", "Requests refused (503) because max_num_waiting were waiting.", registry=r
        )
        self.ttft = Histogram(
            "picovllm:time_to_first_token_seconds", "Time to first token.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "picovllm:inter_token_latency_seconds",
            "Time between tokens of a request.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "picovllm:e2e_request_latency_seconds",
            "Request latency, arrival to last token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def exposition(self) -> CollectorRegistry:
        """The registry /metrics shows: this one, or every HTTP process's (multiprocess mode)."""
        if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
            return self.registry
        r = CollectorRegistry()
        multiprocess.MultiProcessCollector(r)
        r.register(self.engine)
        return r

    def snapshot(self, m: dict) -> dict:
        """What the dashboard plots (entrypoints/web), from the engine's metrics m and the counters
        (every HTTP process's)."""
        samples: dict[str, float] = {}
        for metric in self.exposition().collect():
            for sample in metric.samples:  # (summed over their labels)
                samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
        value = samples.get
        finished = value("picovllm:request_success_total") or 0.0
        host = m.get("kv_offload_blocks_total")
        return {
            "running": m["num_running"],
            "waiting": m["num_waiting"],
            "kv_usage": _kv_usage(m),
            "hit_rate": _hit_rate(m),
            "host_usage": 1 - m["kv_offload_blocks_free"] / host if host else None,
            "preemptions": m["num_preemptions"],
            "requests": finished,
            "prompt_tokens": value("picovllm:prompt_tokens_total") or 0.0,
            "generation_tokens": value("picovllm:generation_tokens_total") or 0.0,
            "ttft_sum": value("picovllm:time_to_first_token_seconds_sum") or 0.0,
            "ttft_count": value("picovllm:time_to_first_token_seconds_count") or 0.0,
            "itl_sum": value("picovllm:inter_token_latency_seconds_sum") or 0.0,
            "itl_count": value("picovllm:inter_token_latency_seconds_count") or 0.0,
        }

    def track(self) -> RequestTracker:
        return RequestTracker(self)


def _kv_usage(m: dict) -> float:
    return 1 - m["kv_blocks_free"] / m["kv_blocks_total"]


def _hit_rate(m: dict) -> float:
    return m["prefix_cache_hit_tokens"] / max(m["prefix_cache_queried_tokens"], 1)


class _EngineMetrics:
    """The engine's gauges, and picovllm:kv_transfer_time_seconds, its histogram of completed KV
    pulls (kept by the engine, engine/kv_handoff.py), from its metrics at collection time."""

    DERIVED = {  # name -> (help, its value from the engine's metrics)
        "num_requests_running": ("Requests in the running batch.", lambda m: m["num_running"]),
        "num_requests_waiting": ("Requests waiting to be scheduled.", lambda m: m["num_waiting"]),
        "kv_cache_usage_perc": ("Fraction of KV-cache blocks in use.", _kv_usage),
        "prefix_cache_hit_rate": ("Prefix-cache hits / queried prompt tokens.", _hit_rate),
    }
    COUNTS = {**METRICS, **GAUGES, **OFFLOAD_METRICS}  # (a prefill or decode instance's; the host tier's)

    def __init__(self, engine_metrics: Callable[[], dict]):
        self.engine_metrics = engine_metrics

    def collect(self):
        m = self.engine_metrics()
        for name, (help_, value) in self.DERIVED.items():
            yield GaugeMetricFamily(f"picovllm:{name}", help_, value=value(m))
        for name, help_ in self.COUNTS.items():
            if name in m:
                yield GaugeMetricFamily(f"picovllm:{name}", help_, value=m[name])
        if "kv_transfer_time_buckets" in m:
            bounds = [str(b) for b in TRANSFER_TIME_BUCKETS] + ["+Inf"]
            yield HistogramMetricFamily(
                "picovllm:kv_transfer_time_seconds",
                "Time from a KV pull's start to its end, completed pulls (decode instance).",
                buckets=list(zip(bounds, itertools.accumulate(m["kv_transfer_time_buckets"]))),
                sum_value=m["kv_transfer_time_sum"],
            )


class RequestTracker:
    """Per request, from its DELTA outputs: TTFT at each completion's first token, inter-token
    latency per token, end-to-end at the end. Each of the n completions counts as a request (as
    vLLM counts its child requests), in the success counter and the latency histograms alike."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.start = self.last = time.perf_counter()
        self.tokens = 0
        self.started: set[int] = set()  # the completions (index) that have their first token

    def update(self, out: RequestOutput) -> None:
        m, now = self.metrics, time.perf_counter()
        for c in out.outputs:
            if c.token_ids and c.index not in self.started:
                self.started.add(c.index)
                m.ttft.observe(now - self.start)
        new = sum(len(c.token_ids) for c in out.outputs)
        if new > 0:
            if self.tokens:
                for _ in range(new):
                    m.itl.observe((now - self.last) / new)
            m.generation_tokens.inc(new)
            self.tokens, self.last = self.tokens + new, now
        if out.finished:
            m.prompt_tokens.inc(len(out.prompt_token_ids))
            for c in out.outputs:
                m.e2e.observe(now - self.start)
                m.requests.labels(finished_reason=c.finish_reason or "abort").inc()
