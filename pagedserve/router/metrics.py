"""Prometheus metrics at /metrics, named after vLLM's with the ``pagedserve:`` prefix.

Three sources, rendered together by the ingress:

- engine figures, from the cluster state every engine replica publishes (``router/state.py``):
  one series per replica (label ``replica``), so sum() or max() over replicas is a query away;
- latency histograms measured at the ingress, which sees every stream: time to first token,
  inter-token latency (per streamed step) and end-to-end latency, from the ingress's own clock;
- the request router's decisions, counted in the ingress process, where the router runs.

``kv_cache_usage_perc`` is a fraction in [0, 1], as vLLM's is despite its name.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)  # fmt: skip

# (name, stats key, help); gauges are levels now, counters are cumulative since the replica started.
GAUGES = (
    ("pagedserve:num_requests_running", "num_running", "Requests in the running batch."),
    ("pagedserve:num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
    ("pagedserve:kv_cache_usage_perc", "kv_cache_usage", "Fraction of KV blocks in use (0 to 1)."),
    ("pagedserve:num_gpu_blocks", "num_blocks", "KV blocks in the pool."),
    ("pagedserve:num_free_blocks", "free_blocks", "KV blocks free or cached-free."),
    ("pagedserve:num_cached_blocks", "cached_blocks", "Cached-free KV blocks (evictable prefix cache)."),
    ("pagedserve:beam_kv_blocks", "beam_blocks_physical",
     "Distinct KV blocks the live beams of beam searches hold."),
    ("pagedserve:beam_kv_blocks_unshared", "beam_blocks_logical",
     "KV blocks the live beams would hold without sharing (their block-table entries)."),
)
COUNTERS = (
    (
        "pagedserve:prefix_cache_queries",
        "prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
    ),
    ("pagedserve:prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    ("pagedserve:num_preemptions", "num_preemptions", "Preemptions of running requests."),
    ("pagedserve:prompt_tokens", "prompt_tokens", "Prompt tokens processed."),
    ("pagedserve:generation_tokens", "generation_tokens", "Tokens generated."),
    ("pagedserve:engine_group_restarts", "num_group_restarts",
     "Tensor-parallel groups rebuilt after a rank died or hung."),
    ("pagedserve:engine_steps", "num_steps", "Engine steps (schedule, run the model, sample) taken."),
    ("pagedserve:engine_step_model_seconds", "step_model_s",
     "Time engine steps spent in the model's forward pass (the ranks' own clock)."),
    ("pagedserve:engine_step_sample_seconds", "step_sample_s", "Time engine steps spent sampling."),
    ("pagedserve:engine_step_schedule_seconds", "step_schedule_s",
     "Time engine steps spent scheduling and turning tokens into outputs."),
    ("pagedserve:engine_step_other_seconds", "step_other_s",
     "Time engine steps spent elsewhere: step inputs, the plan's trip to the ranks and back."),
    ("pagedserve:beam_kv_block_steps", "beam_block_steps_physical",
     "Distinct KV blocks held by beams, summed over engine steps."),
    ("pagedserve:beam_kv_block_steps_unshared", "beam_block_steps_logical",
     "Block-table entries of beams, summed over engine steps (1 - shared/unshared: the saving)."),
)


class _Snapshot:
    """A collector that renders the figures it was given last (set just before each scrape)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.cluster: Mapping[str, Mapping[str, float]] = {}
        self.decisions: Mapping[tuple[str, str], int] = {}

    def collect(self) -> Iterator[Metric]:
        replicas = sorted(self.cluster)
        for name, key, doc in GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["model_name", "replica"])
            for rid in replicas:
                if key in self.cluster[rid]:
                    family.add_metric([self.model_name, rid], float(self.cluster[rid][key]))
            yield family
        for name, key, doc in COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["model_name", "replica"])
            for rid in replicas:
                if key in self.cluster[rid]:
                    family.add_metric([self.model_name, rid], float(self.cluster[rid][key]))
            yield family
        family = CounterMetricFamily(
            "pagedserve:router_decisions",
            "Request routing decisions by policy and outcome.",
            labels=["policy", "outcome"],
        )
        for (policy, outcome), count in sorted(self.decisions.items()):
            family.add_metric([policy, outcome], float(count))
        yield family


class IngressMetrics:
    """The ingress's histograms and the /metrics rendering (one instance per ingress process)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, ["model_name"], registry=self.registry, buckets=buckets).labels(
                model_name
            )

        self._ttft = histogram("pagedserve:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self._itl = histogram(
            "pagedserve:inter_token_latency_seconds", "Time between streamed steps.", ITL_BUCKETS
        )
        self._e2e = histogram("pagedserve:e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS)
        self._snapshot = _Snapshot(model_name)
        self.registry.register(self._snapshot)

    def observe_ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        self._e2e.observe(seconds)

    def render(
        self, cluster: Mapping[str, Mapping[str, float]], decisions: Mapping[tuple[str, str], int]
    ) -> bytes:
        """Prometheus text of the histograms plus ``cluster`` (replica id -> stats) and ``decisions``.

        Synchronous from setting the snapshot to rendering it, so concurrent scrapes on one event
        loop cannot interleave.
        """
        self._snapshot.cluster = cluster
        self._snapshot.decisions = decisions
        return generate_latest(self.registry)
