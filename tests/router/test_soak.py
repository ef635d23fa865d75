"""Soak: mixed traffic against the served cluster (tests/router/conftest.py) for a while.

Six clients loop until the time is up, each request one of: a streamed completion read to the end,
a stream the client drops after a few events (an abort), n = 3 samples of a long prompt (the
pool is small enough that these preempt), a chat, prompts behind one of three shared prefixes
(prefix-cache hits), a non-streamed completion, and a deliberately bad request; and at the start
a burst of long requests that overflows each replica's pool (preemption). Every request
must end as expected: 200 with all its tokens, 400 for the bad ones, or 503 with Retry-After when
the cluster is full; never another status, an exception or a hang. At the end nothing runs,
every KV block of both replicas is free, preemptions and prefix hits happened, and the resident
memory of the engine replicas, the ingress and the HTTP proxy is reported per 1,000 requests
(and bounded). ``PAGEDSERVE_SOAK_S`` sets the duration (40 s; ``make test-reliability``: 600).
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections import Counter

import httpx2
import pytest

from tests.router.conftest import NUM_REPLICAS, Server, rss_mb
from tests.router.test_api import total, wait_until_idle

pytestmark = pytest.mark.slow

SOAK_S = float(os.environ.get("PAGEDSERVE_SOAK_S", "40"))
CLIENTS = 6
# a leak of a few KB per request shows as MBs per 1,000; allocator noise stays under this
MAX_RSS_GROWTH_MB = 150.0


class Client:
    def __init__(self, server: Server, seed: int, deadline: float) -> None:
        self.server, self.rng, self.deadline = server, random.Random(seed), deadline
        self.outcomes: Counter[str] = Counter()
        self.failures: list[str] = []
        self.http = httpx2.Client(base_url=server.base_url, timeout=120,
                                  headers={"Authorization": f"Bearer {server.api_key}"})  # fmt: skip

    def words(self, n: int) -> str:
        vocab = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "cloud"]
        return " ".join(self.rng.choice(vocab) for _ in range(n))

    def run(self) -> None:
        kinds = ["stream", "drop", "samples", "chat", "prefix", "plain", "bad"]
        while time.monotonic() < self.deadline:
            if self.one(self.rng.choice(kinds)) == "503":
                time.sleep(0.25)  # backs off as a client told Retry-After would, a little
        self.http.close()

    def one(self, kind: str) -> str | None:
        try:
            outcome = getattr(self, kind)()
        except Exception as exc:  # a client error, timeout or broken stream: a failure
            self.failures.append(f"{kind}: {type(exc).__name__}: {exc}")
            return None
        self.outcomes[f"{kind} {outcome}"] += 1
        return outcome

    def body(self, prompt: str, max_tokens: int, **extra) -> dict:
        return {"model": self.server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8,
                "seed": self.rng.randrange(1 << 30), "ignore_eos": True, **extra}  # fmt: skip

    def expect(self, r: httpx2.Response, tokens: int | None) -> str:
        if r.status_code == 503:
            assert "retry-after" in r.headers, r.headers
            return "503"
        assert r.status_code == 200, (r.status_code, r.text[:300])
        if tokens is not None:
            out = r.json()
            assert all(c["finish_reason"] == "length" for c in out["choices"]), out
            assert out["usage"]["completion_tokens"] == tokens * len(out["choices"]), out["usage"]
        return "200"

    def stream(self) -> str:
        n = self.rng.randrange(8, 40)
        with self.http.stream("POST", "/v1/completions", json=self.body(self.words(12), n, stream=True)) as r:
            if r.status_code != 200:
                r.read()
                return self.expect(r, None)
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]", events[-3:]
        finals = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]]
        assert finals[-1] == "length" and "error" not in events[-2], events[-2:]
        return "200"

    def drop(self) -> str:
        body = self.body(self.words(12), 200, stream=True)
        with self.http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                return self.expect(r, None)
            for i, _ in enumerate(r.iter_lines()):
                if i >= self.rng.randrange(1, 6):
                    break  # leave: the server must abort the request and free its blocks
        return "dropped"

    def samples(self) -> str:
        r = self.http.post("/v1/completions", json=self.body(self.words(300), 150, n=3))
        return self.expect(r, 150)

    def long(self) -> str:
        """300 prompt tokens and 200 out: 32 blocks at the end, so three at once overflow a
        replica's 91-block pool (the burst at the start of the soak: six of them, so one replica
        runs at least three: preemption, whatever the machine's speed)."""
        return self.expect(self.http.post("/v1/completions", json=self.body(self.words(300), 200)), 200)

    def chat(self) -> str:
        body = {"model": self.server.model, "messages": [{"role": "user", "content": self.words(20)}],
                "max_tokens": 24, "temperature": 0.7}  # fmt: skip
        r = self.http.post("/v1/chat/completions", json=body)
        if r.status_code == 200:
            assert r.json()["choices"][0]["message"]["role"] == "assistant"
        return self.expect(r, None)

    def prefix(self, which: int | None = None) -> str:
        systems = ["You are a terse assistant. " * 12, "Translate to French, keep names. " * 10,
                   "Answer in one word only. " * 14]  # fmt: skip
        system = systems[self.rng.randrange(3) if which is None else which]
        return self.expect(self.http.post("/v1/completions", json=self.body(system + self.words(6), 16)), 16)

    def plain(self) -> str:
        return self.expect(self.http.post("/v1/completions", json=self.body(self.words(30), 32)), 32)

    def bad(self) -> str:
        body = self.rng.choice([self.body("x", -1), self.body("x", 8, n=0), self.body("x", 8, top_p=2.0),
                                self.body("x", 8, logprobs=99), {"model": self.server.model}])  # fmt: skip
        r = self.http.post("/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["message"], (r.status_code, r.text[:200])
        return "400"


@pytest.mark.timeout(int(SOAK_S) + 600)
def test_soak_mixed_traffic_loses_nothing_and_leaks_nothing(server: Server) -> None:
    with httpx2.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {server.api_key}"},
                       timeout=60) as http:  # fmt: skip
        start_metrics = wait_until_idle(http, timeout=60)
        deadline = time.monotonic() + SOAK_S
        clients = [Client(server, seed, deadline) for seed in range(CLIENTS)]
        # one prefix shared by two requests in a row (a hit, however little traffic the machine's
        # speed lets through), then a burst of long requests, three per replica at once (preemption)
        opener = Client(server, 99, deadline)
        for _ in range(2):
            opener.outcomes[f"prefix {opener.prefix(0)}"] += 1
        opener.http.close()
        burst = [Client(server, 100 + i, deadline) for i in range(3 * NUM_REPLICAS)]
        threads = [threading.Thread(target=c.one, args=("long",), daemon=True) for c in burst]
        threads += [threading.Thread(target=c.run, daemon=True) for c in clients]
        for t in threads:
            t.start()
        # memory is measured from the end of a warm-up (first shapes, caches filling) to the end
        time.sleep(SOAK_S / 4)
        rss_before, warm_requests = rss_mb(), sum(sum(c.outcomes.values()) for c in clients)
        for t in threads:
            t.join(SOAK_S + 300)
            assert not t.is_alive(), "a client hangs"
        end_metrics = wait_until_idle(http, timeout=120)  # nothing runs; every block is free
        rss_after = rss_mb()
    for c in burst:
        c.http.close()
    clients += [*burst, opener]
    failures = [f for c in clients for f in c.failures]
    assert not failures, failures[:10]
    outcomes = sum((c.outcomes for c in clients), Counter())
    requests = sum(outcomes.values())
    assert len(end_metrics["pagedserve:num_gpu_blocks"]) == NUM_REPLICAS
    preempted = total(end_metrics, "pagedserve:num_preemptions", "pagedserve:num_preemptions_total") - total(
        start_metrics, "pagedserve:num_preemptions", "pagedserve:num_preemptions_total")
    hits = total(end_metrics, "pagedserve:prefix_cache_hits", "pagedserve:prefix_cache_hits_total") - total(
        start_metrics, "pagedserve:prefix_cache_hits", "pagedserve:prefix_cache_hits_total")
    assert outcomes["samples 200"] > 0 and outcomes["drop dropped"] > 0, outcomes
    assert preempted > 0 and hits > 0, (preempted, hits, outcomes)
    growth = {name: rss_after[name] - mb for name, mb in rss_before.items() if name in rss_after}
    measured = requests - warm_requests
    per_1000 = {name: g * 1000 / measured for name, g in growth.items()}
    print(f"\nsoak {SOAK_S:.0f} s, {requests} requests: {dict(sorted(outcomes.items()))}; {preempted:.0f} "
          f"preemptions, {hits:.0f} prefix-hit tokens; RSS growth over the last {measured} requests (after "
          f"{warm_requests} of warm-up), MB per 1,000 requests: "
          + ", ".join(f"{k} {v:+.1f} (now {rss_after[k]:.0f})" for k, v in sorted(per_1000.items())))
    assert len(growth) >= NUM_REPLICAS + 1, rss_before
    assert all(g < MAX_RSS_GROWTH_MB for g in growth.values()), growth
