"""The /metrics text: per-replica figures from the cluster state, ingress histograms, router decisions."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.router.metrics import COUNTERS, GAUGES, IngressMetrics

STATS = {
    "r1": {
        "num_running": 2,
        "num_waiting": 1,
        "kv_cache_usage": 0.25,
        "prefix_cache_queries": 100,
        "prefix_cache_hits": 40,
        "num_preemptions": 3,
        "prompt_tokens": 100,
        "generation_tokens": 50,
        "num_blocks": 64,
        "free_blocks": 48,
        "cached_blocks": 8,
        "num_group_restarts": 1,
        "beam_blocks_physical": 5,
        "beam_blocks_logical": 12,
        "beam_block_steps_physical": 50,
        "beam_block_steps_logical": 120,
        "num_steps": 70,
        "step_model_s": 2.5,
        "step_sample_s": 0.125,
        "step_schedule_s": 0.25,
        "step_other_s": 0.0625,
    },
    "r2": {
        "num_running": 0,
        "num_waiting": 0,
        "kv_cache_usage": 0.0,
        "prefix_cache_queries": 10,
        "prefix_cache_hits": 0,
        "num_preemptions": 0,
        "prompt_tokens": 10,
        "generation_tokens": 5,
        "num_blocks": 64,
        "free_blocks": 64,
        "cached_blocks": 0,
        "num_group_restarts": 0,
        "beam_blocks_physical": 0,
        "beam_blocks_logical": 0,
        "beam_block_steps_physical": 0,
        "beam_block_steps_logical": 0,
    },
}


def parse(text: bytes) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_replica_figures_and_decisions() -> None:
    metrics = IngressMetrics("m")
    samples = parse(metrics.render(STATS, {("prefix", "hit"): 7, ("prefix", "load"): 2}))
    for name, key, _ in GAUGES:
        for rid in STATS:
            assert samples[name][(("model_name", "m"), ("replica", rid))] == STATS[rid][key]
    for name, key, _ in COUNTERS:
        assert samples[f"{name}_total"][(("model_name", "m"), ("replica", "r1"))] == STATS["r1"][key]
    decisions = samples["pagedserve:router_decisions_total"]
    assert decisions == {
        (("outcome", "hit"), ("policy", "prefix")): 7,
        (("outcome", "load"), ("policy", "prefix")): 2,
    }


def test_histograms_count_observations_and_replicas_can_leave() -> None:
    metrics = IngressMetrics("m")
    metrics.observe_ttft(0.05)
    metrics.observe_itl(0.02)
    metrics.observe_itl(0.03)
    metrics.observe_e2e(1.2)
    samples = parse(metrics.render({"r1": STATS["r1"]}, {}))
    label = (("model_name", "m"),)
    assert samples["pagedserve:time_to_first_token_seconds_count"][label] == 1
    assert samples["pagedserve:inter_token_latency_seconds_sum"][label] == pytest.approx(0.05)
    buckets = samples["pagedserve:e2e_request_latency_seconds_bucket"]
    assert buckets[(("le", "1.5"),) + label] == 1 and buckets[(("le", "1.0"),) + label] == 0
    # a replica that is gone from the cluster state is gone from the next scrape
    assert all(key[1] == ("replica", "r1") for key in samples["pagedserve:num_requests_running"])
    assert "pagedserve:num_requests_running" not in parse(metrics.render({}, {}))
