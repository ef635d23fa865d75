"""Request routing policies replayed on a Mooncake-format trace: prefix hit rate, load balance, TTFT.

Simulated part (the default). N engine replicas, each with its own real BlockManager (prefix
caching on, sized so that the trace does not fit), take requests at the trace's timestamps
(scaled). Every policy routes through its real Ray Serve RequestRouter class, driven as Serve's
router drives it (``choose_replicas``, then Serve's own pick by queue length within each rank,
then the sent / routed / completed callbacks):

- round_robin: pagedserve's RoundRobinRouter;
- pow2: Ray's PowerOfTwoChoicesRequestRouter (by queue length);
- ray_prefix: Ray's PrefixCacheAffinityRouter with its defaults and its real prefix-tree actor in
  a private local Ray; it sees a text rendering of the token ids (one character per token);
- prefix: pagedserve's PrefixAwareRouter, fed the replicas' real KV events through the same
  ReplicaStateLog the Serve app uses, in batches every --event-lag-ms;
- oracle: one replica holding the whole cache (N x the blocks) and N x the speed.

The model's forward is stood in for by a timing model (printed with the results): a step costs
a fixed overhead, plus a time per prefilled (uncached) prompt token, plus a time per decoding
sequence. Each replica runs continuous batching over its BlockManager: running requests decode
first, waiting requests are admitted FIFO under a token budget and a 1% free-block watermark, and
the newest request is preempted (recompute) when a decode step cannot get a slot.

Reported: the prefix hit rate in prompt tokens (first admission of each request), the load
imbalance (max / mean over replicas of the time-averaged number of running requests), the same for
running + waiting, and TTFT. The last line is one JSON object.

--e2e: the real model behind pagedserve's Serve app (2 replicas, a shared-prefix workload over
HTTP), TTFT and throughput for --routing prefix vs pow2.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import math
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata  # noqa: E402
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica  # noqa: E402

from benchmarks.workloads import DEFAULT_TRACE, Request, mooncake_trace  # noqa: E402
from pagedserve.cluster.block_manager import BlockManager  # noqa: E402
from pagedserve.cluster.hashing import hash_blocks  # noqa: E402
from pagedserve.router.prefix_router import (  # noqa: E402
    Load,
    PrefixAwareRouter,
    PrefixPolicy,
    PrefixRouterConfig,
    RoundRobinRouter,
)
from pagedserve.router.state import ReplicaStateLog, decision_counts  # noqa: E402

POLICIES = ("round_robin", "pow2", "ray_prefix", "prefix")
VOCAB = 32000


# ---- the simulated replicas --------------------------------------------------------------------


@dataclass(slots=True)
class TimingModel:
    """Stand-in for the model's forward: seconds per engine step."""

    step_overhead_s: float = 0.015
    prefill_s_per_token: float = 0.0005
    decode_s_per_seq: float = 0.0002

    def step_s(self, prefill_tokens: int, decode_seqs: int) -> float:
        return (
            self.step_overhead_s
            + prefill_tokens * self.prefill_s_per_token
            + decode_seqs * self.decode_s_per_seq
        )

    def describe(self) -> str:
        return (
            f"step = {self.step_overhead_s * 1e3:g} ms + {self.prefill_s_per_token * 1e3:g} ms per uncached "
            f"prompt token + {self.decode_s_per_seq * 1e3:g} ms per decoding sequence"
        )


@dataclass(slots=True, eq=False)
class SimRequest:
    idx: int
    prompt_len: int
    output_len: int
    arrival: float
    tokens: list[int]  # prompt + sampled tokens
    hashes: list[int]
    generated: int = 0
    first_token: float | None = None
    admitted: bool = False  # first admission done (prefix stats count only that one)
    running: bool = False


class SimReplica:
    """One engine replica: a real BlockManager under continuous batching, timed by a TimingModel."""

    def __init__(
        self, rid: str, num_blocks: int, block_size: int, timing: TimingModel, max_num_seqs: int,
        max_num_batched_tokens: int, speed: float = 1.0,
    ) -> None:  # fmt: skip
        self.rid = rid
        self.bm = BlockManager(num_blocks, block_size)
        self.timing = timing
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.speed = speed
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []  # admission order: the last is preempted first
        self.batch: list[SimRequest] = []  # requests computed in the step in progress
        self.busy = False
        self.num_preemptions = 0
        self.watermark = max(1, num_blocks // 100)

    @property
    def load(self) -> Load:
        return Load(len(self.running), len(self.waiting), self.bm.stats().usage)

    def _preempt(self, req: SimRequest) -> None:
        self.bm.free(req.idx)
        self.running.remove(req)
        req.running = False
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def start_step(self) -> float | None:
        """Schedule one step (decode slots, then admissions); its duration, or None when idle."""
        bm = self.bm
        for req in list(self.running):
            if not req.running:
                continue
            while bm.allocate(req.idx, req.tokens, 1) is None:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
        decode = [r for r in self.running if r.running]
        budget = self.max_num_batched_tokens - len(decode)
        prefill_tokens = 0
        admitted: list[SimRequest] = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hit = bm.match_prefix(req.tokens)
            new = len(req.tokens) - hit.num_tokens
            busy = bool(admitted or decode)
            if admitted and new > budget:
                break
            if busy and bm.num_free_blocks - bm.blocks_needed(new) < self.watermark:
                break
            if bm.allocate(req.idx, req.tokens, new, prefix=hit, count_prefix_stats=not req.admitted) is None:
                if not busy:
                    raise RuntimeError(f"request {req.idx} does not fit in an empty replica")
                break
            self.waiting.popleft()
            req.admitted = req.running = True
            self.running.append(req)
            admitted.append(req)
            budget -= new
            prefill_tokens += new
        self.batch = decode + admitted
        if not self.batch:
            self.busy = False
            return None
        self.busy = True
        return self.timing.step_s(prefill_tokens, len(decode)) / self.speed

    def finish_step(self, now: float) -> list[SimRequest]:
        """Every request in the step samples one token; returns the requests that finished."""
        done = []
        for req in self.batch:
            req.generated += 1
            req.tokens.append((req.idx * 7919 + req.generated * 104729) % VOCAB)
            if req.first_token is None:
                req.first_token = now
            if req.generated >= req.output_len:
                self.bm.free(req.idx)
                self.running.remove(req)
                req.running = False
                done.append(req)
        self.batch = []
        return done


# ---- driving the real Serve routers -------------------------------------------------------------


class SimRunningReplica(RunningReplica):
    """The RunningReplica a Serve router sees for a simulated replica (no actor behind it)."""

    def __init__(self, sim: SimReplica) -> None:
        self.sim = sim
        self._id = ReplicaID(sim.rid, DeploymentID(name="engine", app_name="bench"))

    replica_id = property(lambda self: self._id)
    node_id = property(lambda self: "")
    availability_zone = property(lambda self: None)
    multiplexed_model_ids = property(lambda self: set())
    max_ongoing_requests = property(lambda self: 1_000_000)

    @property
    def routing_stats(self) -> dict[str, Any]:
        load = self.sim.load
        return {"num_running": load.num_running, "num_waiting": load.num_waiting,
                "kv_cache_usage": load.kv_cache_usage}  # fmt: skip

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.sim.load.num_requests

    def push_proxy_handle(self, handle: Any) -> None:
        pass


@dataclass(slots=True)
class TextPrompt:
    """What Ray's PrefixCacheAffinityRouter reads: a ``.prompt`` string."""

    prompt: str


def render_text(token_ids: list[int]) -> str:
    """One CJK-range character per token id, so a character match is a token match."""
    return "".join(chr(0x3400 + t) for t in token_ids)


class RouterDriver:
    """Routes simulated requests through a real RequestRouter the way Serve's router does."""

    def __init__(self, name: str, router: RequestRouter, replicas: list[SimReplica]) -> None:
        self.name = name
        self.router = router
        self.fakes = [SimRunningReplica(r) for r in replicas]
        router.update_replicas(self.fakes)
        self.route_s: list[float] = []

    def request_arg(self, req: SimRequest) -> Any:
        if self.name == "ray_prefix":
            return TextPrompt(render_text(req.tokens[: req.prompt_len]))
        return {"block_hashes": req.hashes, "session_id": None}

    async def route(self, req: SimRequest) -> SimReplica:
        router = self.router
        for fake in self.fakes:  # Serve's queue-length cache: replicas report it on every request
            router.replica_queue_len_cache.update(fake.replica_id, fake.sim.load.num_requests)
        meta = RequestMetadata(request_id=str(req.idx), internal_request_id=str(req.idx))
        pr = PendingRequest(args=[self.request_arg(req)], kwargs={}, metadata=meta)
        t0 = time.perf_counter()
        chosen = None
        for rank in await router.choose_replicas(self.fakes, pr):
            chosen = await router._select_from_candidate_replicas(rank, 0)
            if chosen is not None:
                break
        self.route_s.append(time.perf_counter() - t0)
        assert chosen is not None, f"{self.name} placed no request"
        router.on_send_request(chosen.replica_id)
        router.on_request_routed(pr, chosen.replica_id, None)
        return chosen.sim

    def completed(self, replica: SimReplica, req: SimRequest) -> None:
        self.router.on_request_completed(ReplicaID(replica.rid, self.fakes[0].replica_id.deployment_id),
                                         str(req.idx))  # fmt: skip

    def publish(self, replicas: list[SimReplica], log: ReplicaStateLog | None) -> None:
        """KV events and stats from every replica; only our router reads them, through the log."""
        for r in replicas:
            events = r.bm.take_events()
            if log is not None:
                stats = SimRunningReplica(r).routing_stats
                log.publish(r.rid, "sim", events, stats)
        if log is not None:
            self.router.apply_state(log.poll(self.router.seq, self.router.epoch))


def make_router(name: str, seed: int, ray_tree_actor: Any = None) -> RequestRouter:
    kwargs: dict[str, Any] = dict(
        deployment_id=DeploymentID(name="engine", app_name="bench"),
        handle_source=DeploymentHandleSource.UNKNOWN,
        use_replica_queue_len_cache=True,
    )
    if name == "round_robin":
        router = RoundRobinRouter(**kwargs)
        router.initialize_state()
    elif name == "pow2":
        from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter

        router = PowerOfTwoChoicesRequestRouter(**kwargs)
    elif name == "ray_prefix":
        from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
            PrefixCacheAffinityRouter,
        )

        router = PrefixCacheAffinityRouter(**kwargs)
        router.initialize_state(tree_actor=ray_tree_actor)
    elif name == "prefix":
        router = PrefixAwareRouter(**kwargs)
        router.initialize_state(sync_from_actor=False, seed=seed)
    else:
        raise ValueError(name)
    return router


# ---- the replay ----------------------------------------------------------------------------------


@dataclass
class SimConfig:
    num_replicas: int
    blocks_per_replica: int
    block_size: int
    timing: TimingModel
    max_num_seqs: int
    max_num_batched_tokens: int
    event_lag_s: float
    seed: int


@dataclass
class SimResult:
    hit_rate: float
    imbalance: float  # running requests
    imbalance_ongoing: float  # running + waiting
    ttft: list[float]
    mean_running: list[float]
    preemptions: int
    route_ms: float
    makespan: float
    extras: dict = field(default_factory=dict)


def make_requests(trace: list[Request], block_size: int, time_scale: float) -> list[SimRequest]:
    return [
        SimRequest(i, len(r.prompt_token_ids), r.output_len, r.arrival_s * time_scale,
                   list(r.prompt_token_ids), hash_blocks(r.prompt_token_ids, block_size))
        for i, r in enumerate(trace)
    ]  # fmt: skip


async def simulate(
    policy: str, trace: list[Request], cfg: SimConfig, time_scale: float, ray_tree_actor: Any = None
) -> SimResult:
    """Replay the trace through one policy; every replica's blocks must all be free at the end."""
    random.seed(cfg.seed)  # Ray's routers draw from the global generator
    oracle = policy == "oracle"
    n = 1 if oracle else cfg.num_replicas
    scale = cfg.num_replicas if oracle else 1
    replicas = [
        SimReplica(f"replica-{i}", cfg.blocks_per_replica * scale, cfg.block_size, cfg.timing,
                   cfg.max_num_seqs * scale, cfg.max_num_batched_tokens * scale, speed=scale)
        for i in range(n)
    ]  # fmt: skip
    driver = None if oracle else RouterDriver(policy, make_router(policy, cfg.seed, ray_tree_actor), replicas)
    log = ReplicaStateLog() if policy == "prefix" else None
    reqs = make_requests(trace, cfg.block_size, time_scale)
    heap: list[tuple[float, int, str, Any]] = []
    counter = 0

    def push(t: float, kind: str, payload: Any) -> None:
        nonlocal counter
        counter += 1
        heapq.heappush(heap, (t, counter, kind, payload))

    for req in reqs:
        push(req.arrival, "arrive", req)
    push(cfg.event_lag_s, "publish", None)
    area_running = [0.0] * n
    area_ongoing = [0.0] * n
    now = 0.0
    remaining = len(reqs)

    def kick(replica: SimReplica) -> None:
        if not replica.busy:
            duration = replica.start_step()
            if duration is not None:
                push(now + duration, "step", replica)

    while heap:
        t, _, kind, payload = heapq.heappop(heap)
        dt = t - now
        for i, r in enumerate(replicas):
            area_running[i] += len(r.running) * dt
            area_ongoing[i] += (len(r.running) + len(r.waiting)) * dt
        now = t
        if kind == "arrive":
            replica = replicas[0] if driver is None else await driver.route(payload)
            replica.waiting.append(payload)
            kick(replica)
        elif kind == "step":
            for req in payload.finish_step(now):
                remaining -= 1
                if driver is not None:
                    driver.completed(payload, req)
            payload.busy = False
            kick(payload)
        elif kind == "publish":
            if driver is not None:
                driver.publish(replicas, log)
            if remaining:
                push(now + cfg.event_lag_s, "publish", None)
    for r in replicas:
        assert r.bm.stats().free_blocks == r.bm.num_blocks, "every block must be back in the pool"
    queries = sum(r.bm.stats().prefix_queries for r in replicas)
    hits = sum(r.bm.stats().prefix_hits for r in replicas)
    mean_running = [a / now for a in area_running]
    mean_ongoing = [a / now for a in area_ongoing]
    return SimResult(
        hit_rate=hits / queries,
        imbalance=max(mean_running) / statistics.mean(mean_running),
        imbalance_ongoing=max(mean_ongoing) / statistics.mean(mean_ongoing),
        ttft=[r.first_token - r.arrival for r in reqs],
        mean_running=mean_running,
        preemptions=sum(r.num_preemptions for r in replicas),
        route_ms=statistics.mean(driver.route_s) * 1e3 if driver else 0.0,
        makespan=now,
    )


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def decision_time_ms(num_replicas: int = 8, num_blocks: int = 100_000, prompt_blocks: int = 128) -> float:
    """Mean PrefixPolicy.choose time with ``num_blocks`` cached blocks spread over the replicas."""
    rng = random.Random(0)
    policy = PrefixPolicy(PrefixRouterConfig(seed=0))
    prompts = [[rng.getrandbits(64) for _ in range(prompt_blocks)] for _ in range(num_replicas)]
    per = num_blocks // num_replicas
    half = prompt_blocks // 2
    for r in range(num_replicas):
        policy.index.apply(f"r{r}", [("stored", prompts[r][:half])])
        policy.index.apply(f"r{r}", [("stored", [rng.getrandbits(64) for _ in range(per - half)])])
    loads = {f"r{r}": Load(num_running=r % 3) for r in range(num_replicas)}
    n = 2000
    t0 = time.perf_counter()
    for i in range(n):
        policy.choose(prompts[i % num_replicas], loads)
    return (time.perf_counter() - t0) / n * 1e3


def start_private_ray() -> str:
    """A private local Ray for Ray's prefix-tree actor (never joins another cluster); its temp dir."""
    import ray

    tmp = tempfile.mkdtemp(prefix="psbench-", dir="/tmp")  # short: Ray's socket paths live under it
    ray.init(address="local", num_cpus=1, include_dashboard=False, _temp_dir=tmp, log_to_driver=False,
             logging_level="ERROR")  # fmt: skip
    return tmp


def run_simulation(args: argparse.Namespace) -> dict:
    trace = mooncake_trace(args.trace, num_requests=args.num_requests, block_tokens=args.block_size)
    bs = args.block_size
    unique = len({h for r in trace for h in hash_blocks(r.prompt_token_ids, bs)})
    largest = max(-(-(len(r.prompt_token_ids) + r.output_len) // bs) for r in trace)
    per_replica = max(int(unique * args.cache_fraction / args.replicas), 2 * largest)
    timing = TimingModel(
        args.step_overhead_ms / 1e3, args.prefill_us_per_token / 1e6, args.decode_us_per_seq / 1e6
    )
    cfg = SimConfig(args.replicas, per_replica, bs, timing, args.max_num_seqs, args.max_num_batched_tokens,
                    args.event_lag_ms / 1e3, args.seed)  # fmt: skip
    span = trace[-1].arrival_s * args.time_scale
    mean_in = statistics.mean(len(r.prompt_token_ids) for r in trace)
    mean_out = statistics.mean(r.output_len for r in trace)
    print(f"trace {Path(args.trace).name}: {len(trace)} requests over {span:.0f} s (time x "
          f"{args.time_scale:g}), mean prompt {mean_in:.0f} tokens, mean output {mean_out:.1f} "
          f"(512-token trace blocks -> {bs} tokens)")  # fmt: skip
    print(f"{args.replicas} replicas x {per_replica} blocks of {bs} tokens ({per_replica * bs} tokens each); "
          f"the prompts hold {unique} distinct full blocks: the cluster caches "
          f"{args.replicas * per_replica / unique:.0%} of them")  # fmt: skip
    print(f"timing model (stands in for the model's forward): {timing.describe()}; max_num_seqs "
          f"{args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}; KV events reach our "
          f"router every {args.event_lag_ms:g} ms")  # fmt: skip
    ray_dir = tree_actor = None
    policies = [p for p in args.policies.split(",") if p]
    unknown = set(policies) - set(POLICIES)
    if unknown:
        raise SystemExit(f"unknown policies {sorted(unknown)}; choose from {POLICIES}")
    if "ray_prefix" in policies:
        ray_dir = start_private_ray()
        from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTreeActor

        tree_actor = PrefixTreeActor.remote()
    results: dict[str, SimResult] = {}
    try:
        for policy in [*policies, "oracle"]:
            before = decision_counts()
            results[policy] = asyncio.run(simulate(policy, trace, cfg, args.time_scale, tree_actor))
            after = decision_counts()
            results[policy].extras["decisions"] = {
                outcome: n - before.get((p, outcome), 0) for (p, outcome), n in after.items() if p == policy
            }
    finally:
        if ray_dir is not None:
            import ray

            ray.shutdown()
            shutil.rmtree(ray_dir, ignore_errors=True)
    print(f"{'policy':<13}{'hit rate':>9}{'vs oracle':>10}{'imbalance':>10}{'imb r+w':>9}{'TTFT mean':>10}"
          f"{'p50':>8}{'p99':>8}{'preempt':>8}{'route ms':>9}{'running/replica':>24}")  # fmt: skip
    oracle = results["oracle"].hit_rate
    for name, r in results.items():
        per = " ".join(f"{x:.1f}" for x in r.mean_running)
        print(f"{name:<13}{r.hit_rate:>9.3f}{r.hit_rate / oracle:>10.3f}{r.imbalance:>10.3f}"
              f"{r.imbalance_ongoing:>9.3f}{statistics.mean(r.ttft):>10.3f}{percentile(r.ttft, 0.5):>8.3f}"
              f"{percentile(r.ttft, 0.99):>8.3f}{r.preemptions:>8}{r.route_ms:>9.3f}{per:>24}")  # fmt: skip
    print(
        "hit rate: prompt tokens served from the prefix cache at first admission; imbalance: max/mean over "
        "replicas of the time-averaged running requests (imb r+w: running + waiting); TTFT in seconds of "
        "the timing model; route ms: wall time of one routing call (Ray's prefix router makes actor calls)"
    )
    if "prefix" in results:
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(results["prefix"].extras["decisions"].items()))
        print(f"our router's decisions: {outcomes}")
    dt = decision_time_ms()
    print(f"PrefixPolicy decision time, 8 replicas, 100k cached blocks, 128-block prompt: {dt:.3f} ms")
    sim = {name: r for name, r in results.items() if name != "oracle"}
    return {
        "hit_rate": {name: round(r.hit_rate, 4) for name, r in sim.items()},
        "oracle_hit_rate": round(oracle, 4),
        "imbalance": {name: round(r.imbalance, 4) for name, r in sim.items()},
        "imbalance_running_waiting": {name: round(r.imbalance_ongoing, 4) for name, r in sim.items()},
        "ttft_mean_s": {name: round(statistics.mean(r.ttft), 4) for name, r in results.items()},
        "ttft_p99_s": {name: round(percentile(r.ttft, 0.99), 4) for name, r in results.items()},
        "decision_ms_8x100k": round(dt, 4),
        "timing_model": timing.describe(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(DEFAULT_TRACE), help="a Mooncake-format trace (.jsonl[.gz])")
    ap.add_argument("--num-requests", type=int, default=None, help="the trace's first N (default: all)")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated subset of {POLICIES}")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block and per trace block")
    ap.add_argument("--cache-fraction", type=float, default=0.25,
                    help="cluster KV cache as a fraction of the trace's distinct prompt blocks")  # fmt: skip
    ap.add_argument("--time-scale", type=float, default=0.2, help="multiplies the trace's arrival times")
    ap.add_argument("--step-overhead-ms", type=float, default=15.0)
    ap.add_argument("--prefill-us-per-token", type=float, default=500.0)
    ap.add_argument("--decode-us-per-seq", type=float, default=200.0)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--event-lag-ms", type=float, default=150.0, help="KV events reach our router in batches")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--e2e", action="store_true", help="also run the real model: 2 replicas, prefix vs pow2")
    ap.add_argument("--e2e-prefixes", type=int, default=8)
    ap.add_argument("--e2e-prefix-len", type=int, default=256)
    ap.add_argument("--e2e-rounds", type=int, default=4)
    ap.add_argument("--e2e-max-tokens", type=int, default=16)
    ap.add_argument("--e2e-concurrency", type=int, default=4)
    ap.add_argument("--e2e-cache-blocks", type=int, default=96, help="KV blocks per replica (16 tokens each)")
    ap.add_argument("--e2e-dtype", default="bfloat16")
    ap.add_argument("--skip-sim", action="store_true", help="run only the end-to-end part (with --e2e)")
    args = ap.parse_args()
    if not math.isfinite(args.time_scale) or args.time_scale <= 0:
        ap.error("--time-scale must be positive")
    result = {} if args.skip_sim else run_simulation(args)
    if args.e2e:
        result["e2e"] = run_e2e(args)
    print(json.dumps(result))


# ---- end to end with the real model -------------------------------------------------------------


def shared_prefix_workload(
    num_prefixes: int, prefix_len: int, rounds: int, seed: int, vocab: int = 49152
) -> list[list[int]]:
    """``rounds`` questions on each of ``num_prefixes`` long shared prefixes (documents, system
    prompts), interleaved: every round asks about every prefix once, in a shuffled order."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000, vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    prompts = []
    for _ in range(rounds):
        for p in rng.sample(range(num_prefixes), num_prefixes):
            prompts.append(prefixes[p] + [rng.randrange(1000, vocab) for _ in range(rng.randrange(16, 48))])
    return prompts


async def drive_http(base_url: str, api_key: str, model: str, prompts: list[list[int]], max_tokens: int,
                     concurrency: int) -> dict[str, Any]:  # fmt: skip
    """Stream every prompt through /v1/completions, ``concurrency`` at a time: TTFT and throughput."""
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    tokens = 0

    async def one(session: aiohttp.ClientSession, prompt: list[int]) -> None:
        nonlocal tokens
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
        async with sem:
            t0 = time.perf_counter()
            first = None
            async with session.post(f"{base_url}/v1/completions", json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[len(b"data: ") :])
                    if "error" in chunk:
                        raise RuntimeError(chunk["error"])
                    if chunk.get("choices") and first is None:
                        first = time.perf_counter() - t0
                    if chunk.get("usage"):
                        tokens += chunk["usage"]["completion_tokens"]
            ttfts.append(first if first is not None else time.perf_counter() - t0)

    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {api_key}"}, timeout=timeout) as s:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(s, p) for p in prompts))
        wall = time.perf_counter() - t0
    return {"ttft_mean_s": statistics.mean(ttfts), "ttft_p50_s": percentile(ttfts, 0.5),
            "ttft_p90_s": percentile(ttfts, 0.9), "output_tok_per_s": tokens / wall,
            "req_per_s": len(prompts) / wall, "wall_s": wall}  # fmt: skip


def run_e2e(args: argparse.Namespace) -> dict:
    """The real default model, 2 replicas behind pagedserve's Serve app, --routing prefix vs pow2."""
    import socket

    import ray
    from ray import serve

    from pagedserve.cli import init_ray
    from pagedserve.config import EngineConfig, ServeConfig
    from pagedserve.router import state
    from pagedserve.router.app import deploy, served_model_name

    prompts = shared_prefix_workload(args.e2e_prefixes, args.e2e_prefix_len, args.e2e_rounds, args.seed)
    warmup = shared_prefix_workload(2, 32, 1, args.seed + 1)
    engine = EngineConfig.from_flags(
        max_model_len=512, num_gpu_blocks_override=args.e2e_cache_blocks, max_num_seqs=4, dtype=args.e2e_dtype
    )
    print(f"end to end: 2 replicas of {served_model_name(engine)} ({args.e2e_dtype}, real forward on this "
          f"machine's CPUs), {args.e2e_cache_blocks} KV blocks of 16 tokens each; {len(prompts)} requests = "
          f"{args.e2e_rounds} rounds over {args.e2e_prefixes} shared prefixes of {args.e2e_prefix_len} "
          f"tokens + a 16-47 token question, {args.e2e_max_tokens} output tokens each, "
          f"{args.e2e_concurrency} at a time, streamed over HTTP")  # fmt: skip
    temp_dir = init_ray(None, num_cpus=2, object_store_memory=200 << 20)
    results: dict[str, dict] = {}
    try:
        for routing in ("prefix", "pow2"):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            config = ServeConfig(port=port, num_replicas=2, routing=routing, api_key="bench",
                                 max_waiting_requests=args.e2e_concurrency, engine=engine)  # fmt: skip
            deploy(config)
            try:
                url, model = f"http://127.0.0.1:{port}", served_model_name(engine)
                asyncio.run(drive_http(url, "bench", model, warmup, 2, 2))
                time.sleep(0.5)
                before = asyncio.run(state.cluster_stats())
                r = asyncio.run(
                    drive_http(url, "bench", model, prompts, args.e2e_max_tokens, args.e2e_concurrency)
                )
                time.sleep(0.5)  # the replicas' last figures reach the state actor
                after = asyncio.run(state.cluster_stats())
                hits = sum(
                    after[k]["prefix_cache_hits"] - before.get(k, {}).get("prefix_cache_hits", 0)
                    for k in after
                )
                queries = sum(
                    after[k]["prefix_cache_queries"] - before.get(k, {}).get("prefix_cache_queries", 0)
                    for k in after
                )
                r["hit_rate"] = hits / max(queries, 1)
                results[routing] = r
            finally:
                serve.shutdown()
    finally:
        ray.shutdown()
        if temp_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)
    print(f"{'routing':<9}{'hit rate':>9}{'TTFT mean':>10}{'p50':>8}{'p90':>8}{'out tok/s':>10}{'req/s':>8}")
    for name, r in results.items():
        print(f"{name:<9}{r['hit_rate']:>9.3f}{r['ttft_mean_s']:>10.3f}{r['ttft_p50_s']:>8.3f}"
              f"{r['ttft_p90_s']:>8.3f}{r['output_tok_per_s']:>10.1f}{r['req_per_s']:>8.2f}")  # fmt: skip
    return {name: {k: round(v, 4) for k, v in r.items()} for name, r in results.items()}


if __name__ == "__main__":
    main()
