"""The prefix-aware router: its index and decision against real BlockManagers, and its Serve adapters."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

from pagedserve.cluster.block_manager import BlockManager
from pagedserve.cluster.hashing import hash_blocks
from pagedserve.router import state
from pagedserve.router.prefix_router import (
    Load,
    PowerOfTwoRouter,
    PrefixAwareRouter,
    PrefixIndex,
    PrefixPolicy,
    PrefixRouterConfig,
    RoundRobinRouter,
    decision_counts,
    router_class_for,
)
from pagedserve.router.state import ReplicaStateLog

BS = 16


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(n)]


def run_on(bm: BlockManager, req_id: object, prompt: list[int]) -> int:
    """Admit a prompt on a replica's block manager as its scheduler would; returns cached tokens."""
    hit = bm.match_prefix(prompt)
    assert bm.allocate(req_id, prompt, len(prompt) - hit.num_tokens, prefix=hit) is not None
    return hit.num_tokens


def sync(index: PrefixIndex, replicas: dict[str, BlockManager]) -> None:
    """Deliver every replica's pending KV events to the index, as the state actor would."""
    for rid, bm in replicas.items():
        index.apply(rid, bm.take_events())


# ---- PrefixIndex ------------------------------------------------------------------------------


def test_index_matches_leading_blocks_only() -> None:
    index = PrefixIndex()
    index.apply("a", [("stored", [1, 2, 3])])
    index.apply("b", [("stored", [1, 3])])
    assert index.match([1, 2, 3, 4], ["a", "b", "c"]) == {"a": 3, "b": 1, "c": 0}
    assert index.match([9, 1], ["a", "b"]) == {"a": 0, "b": 0}
    assert index.match([], ["a"]) == {"a": 0}


def test_index_events_are_ordered_and_idempotent() -> None:
    index = PrefixIndex()
    index.apply("a", [("stored", [1, 2]), ("removed", [2]), ("stored", [2, 2]), ("removed", [7])])
    assert index.num_blocks("a") == 2
    index.apply("a", [("removed", [1]), ("removed", [1])])
    assert index.num_blocks("a") == 1
    assert index.match([1, 2], ["a"]) == {"a": 0}
    assert 1 not in index.holders
    with pytest.raises(ValueError):
        index.apply("a", [("evicted", [2])])


def test_index_reset_and_drop_reuse_the_slot() -> None:
    index = PrefixIndex()
    index.apply("a", [("stored", [1, 2])])
    index.apply("b", [("stored", [1])])
    index.reset("a")
    assert index.match([1, 2], ["a", "b"]) == {"a": 0, "b": 1}
    assert set(index.holders) == {1} and index.num_blocks("a") == 0
    index.drop("a")
    assert index.replicas() == ["b"]
    index.apply("c", [("stored", [5])])  # takes a's freed slot, with none of a's old blocks
    assert index.match([1], ["c"]) == {"c": 0} and index.match([5], ["b", "c"]) == {"b": 0, "c": 1}


# ---- the decision against real block managers -------------------------------------------------


def test_shared_prefix_goes_to_its_holder_until_it_is_evicted() -> None:
    """Two replicas: requests sharing a long prefix follow it (their hit counters show it) until
    the holder evicts it; from then on the router no longer prefers that replica."""
    replicas = {"r0": BlockManager(64, BS), "r1": BlockManager(64, BS)}
    policy = PrefixPolicy(PrefixRouterConfig(seed=0))
    prefix = tokens(1, 40 * BS)
    idle = {rid: Load() for rid in replicas}

    first = prefix + tokens(100, 20)
    holder, outcome = policy.choose(hash_blocks(first, BS), idle)
    assert outcome == "pow2"
    run_on(replicas[holder], "first", first)
    replicas[holder].free("first")
    other = next(rid for rid in replicas if rid != holder)
    sync(policy.index, replicas)

    for i in range(6):
        prompt = prefix + tokens(200 + i, 30)
        # The holder is busier, but within the balance threshold: the prefix still wins.
        loads = {holder: Load(num_running=2), other: Load(num_running=0)}
        rid, outcome = policy.choose(hash_blocks(prompt, BS), loads)
        assert (rid, outcome) == (holder, "prefix_hit")
        run_on(replicas[rid], i, prompt)
        replicas[rid].free(i)
        sync(policy.index, replicas)
    assert replicas[holder].stats().prefix_hits == 6 * 40 * BS
    assert replicas[other].stats().prefix_hits == 0

    # Unrelated traffic on the holder evicts the prefix: a prompt that needs the whole pool.
    run_on(replicas[holder], "flood", tokens(999, 64 * BS))
    replicas[holder].free("flood")
    sync(policy.index, replicas)
    assert replicas[holder].match_prefix(prefix).num_tokens == 0
    prompt = prefix + tokens(300, 30)
    loads = {holder: Load(num_running=2), other: Load(num_running=0)}
    assert policy.choose(hash_blocks(prompt, BS), loads) == (other, "pow2")
    assert run_on(replicas[other], "after", prompt) == 0


def test_overloaded_holder_yields_to_the_least_loaded() -> None:
    policy = PrefixPolicy(PrefixRouterConfig(balance_abs_threshold=4, balance_rel_threshold=1.5, seed=0))
    hashes = [11, 12, 13, 14]
    policy.index.apply("a", [("stored", hashes)])
    policy.index.apply("b", [("stored", hashes[:2])])
    loads = {"a": Load(num_running=8), "b": Load(num_running=7), "c": Load(num_running=5)}
    assert policy.choose(hashes, loads) == ("a", "prefix_hit")  # 8 - 5 is within the threshold of 4
    loads["a"] = Load(num_running=8, num_waiting=4)  # 12 requests: more than 5 + 4 and than 1.5 x 5
    # Among the replicas not overloaded, the longest match: b (2 blocks) over c (none).
    assert policy.choose(hashes, loads) == ("b", "load_balanced")
    loads["b"] = Load(num_running=12)
    assert policy.choose(hashes, loads) == ("c", "load_balanced")


def test_full_kv_cache_counts_as_overload() -> None:
    policy = PrefixPolicy(PrefixRouterConfig(kv_usage_limit=0.9, seed=0))
    policy.index.apply("a", [("stored", [1, 2])])
    loads = {"a": Load(1, 0, 0.95), "b": Load(1, 0, 0.2)}
    assert policy.choose([1, 2], loads) == ("b", "load_balanced")
    loads["b"] = Load(1, 0, 0.93)  # both full: the cache decides
    assert policy.choose([1, 2], loads) == ("a", "prefix_hit")


def test_session_affinity_until_another_replica_holds_more() -> None:
    policy = PrefixPolicy(PrefixRouterConfig(seed=0))
    loads = {"a": Load(), "b": Load(), "c": Load()}
    first, outcome = policy.choose([1, 2], loads, session_id="s1")
    assert outcome == "pow2"
    # Its KV events have not arrived yet: the session keeps it in place anyway.
    for _ in range(5):
        assert policy.choose([1, 2, 3], loads, session_id="s1") == (first, "session")
    other = next(r for r in loads if r != first)
    policy.index.apply(other, [("stored", [1, 2, 3])])
    assert policy.choose([1, 2, 3, 4], loads, session_id="s1") == (other, "prefix_hit")
    assert policy.choose([1, 2, 3, 4, 5], loads, session_id="s1") == (other, "session")
    loads[other] = Load(num_running=20)
    rid, outcome = policy.choose([1, 2, 3, 4, 5], loads, session_id="s1")
    assert rid != other and outcome == "load_balanced"


def test_pow2_spreads_requests_without_a_match() -> None:
    policy = PrefixPolicy(PrefixRouterConfig(seed=1))
    loads = {f"r{i}": Load() for i in range(4)}
    counts = dict.fromkeys(loads, 0)
    for i in range(400):
        rid, outcome = policy.choose([i], loads)
        assert outcome == "pow2"
        counts[rid] += 1
        loads[rid].num_running += 1
    assert max(counts.values()) - min(counts.values()) <= 2
    with pytest.raises(ValueError):
        policy.choose([1], {})


def test_config_is_validated() -> None:
    with pytest.raises(ValueError):
        PrefixRouterConfig(balance_rel_threshold=0.5)
    with pytest.raises(ValueError):
        PrefixRouterConfig(kv_usage_limit=0)


def test_decision_with_8_replicas_and_100k_cached_blocks() -> None:
    """Correct at the scale the issue names; prints the decision time (benchmarks/routing.py too)."""
    rng = random.Random(0)
    policy = PrefixPolicy(PrefixRouterConfig(seed=0))
    prompts = [tokens(i, 128 * BS) for i in range(8)]
    for r in range(8):
        policy.index.apply(f"r{r}", [("stored", hash_blocks(prompts[r][: (64 + 8 * r) * BS], BS))])
        policy.index.apply(f"r{r}", [("stored", [rng.getrandbits(64) for _ in range(12_500 - 64 - 8 * r)])])
    assert sum(policy.index.num_blocks(f"r{r}") for r in range(8)) == 100_000
    loads = {f"r{r}": Load(num_running=r % 3) for r in range(8)}
    queries = [(r, hash_blocks(prompts[r], BS)) for r in range(8)] * 25
    t0 = time.perf_counter()
    for r, hashes in queries:
        assert policy.choose(hashes, loads) == (f"r{r}", "prefix_hit")
    per_decision_ms = (time.perf_counter() - t0) / len(queries) * 1e3
    print(f"decision time, 8 replicas, 100k cached blocks, 128-block prompts: {per_decision_ms:.3f} ms")


# ---- the shared state log -----------------------------------------------------------------------


def test_state_log_gives_each_reader_every_event_once_in_order() -> None:
    log = ReplicaStateLog()
    a, b = PrefixIndex(), PrefixIndex()
    seq_a = seq_b = 0

    def read(index: PrefixIndex, since: int) -> int:
        reply = log.poll(since, log.epoch)
        assert "entries" in reply
        index.apply_log(reply["entries"])
        return reply["seq"]

    log.publish("r0", "t0", [("stored", [1, 2, 3])], {"num_running": 1})
    seq_a = read(a, seq_a)
    log.publish("r0", "t0", [("removed", [3]), ("stored", [4])], None)
    log.publish("r1", "t9", [("stored", [1])], {"num_running": 0})
    seq_a = read(a, seq_a)
    seq_b = read(b, seq_b)
    assert seq_a == seq_b == 4
    assert read(a, seq_a) == 4  # nothing new: nothing applied twice
    for index in (a, b):
        assert index.match([1, 2, 3], ["r0", "r1"]) == {"r0": 2, "r1": 1}
        assert index.match([4], ["r0"]) == {"r0": 1}
    assert log.cluster_stats() == {"r0": {"num_running": 1}, "r1": {"num_running": 0}}

    log.publish("r0", "t1", [("stored", [7])], {"num_running": 0})  # r0 restarted: new token
    seq_a = read(a, seq_a)
    assert a.match([1], ["r0"]) == {"r0": 0} and a.match([7], ["r0"]) == {"r0": 1}
    log.drop("r1")
    read(a, seq_a)
    assert a.match([1], ["r1"]) == {"r1": 0} and a.replicas() == ["r0"]
    assert "r1" not in log.cluster_stats()
    with pytest.raises(ValueError):
        log.publish("r0", "t1", [("evicted", [7])], None)


def test_state_log_snapshot_after_trim_or_new_epoch() -> None:
    log = ReplicaStateLog(max_log_hashes=40)
    for i in range(30):
        log.publish("r0", "t", [("stored", [i])], None)
    log.publish("r0", "t", [("removed", [0])], None)
    reply = log.poll(0, log.epoch)
    assert "snapshot" in reply and sorted(reply["snapshot"]["r0"]) == list(range(1, 30))
    assert "entries" in log.poll(reply["seq"] - 1, log.epoch)
    assert "snapshot" in log.poll(reply["seq"], "another-epoch")


def test_state_log_drops_a_silent_replica_and_a_returning_one_rejoins() -> None:
    """A replica killed without a goodbye (SIGKILL, a lost node) stops publishing: after
    stale_after_s its stats and blocks are gone (readers get a "drop" entry). One that was only
    slow and publishes again rejoins under a new join number, which tells it to resend its cache."""
    now = [0.0]
    log = ReplicaStateLog(clock=lambda: now[0], stale_after_s=10.0)
    first = log.publish("r0", "t", [("stored", [1, 2])], {"num_running": 1})
    log.publish("r1", "t", [("stored", [3])], {"num_running": 0})
    now[0] = 8.0
    assert log.publish("r1", "t", [], {"num_running": 0}) == log.publish("r1", "t", [], None)
    assert set(log.cluster_stats()) == {"r0", "r1"}
    now[0] = 12.0  # r0 silent for 12 s, r1 for 4 s
    reply = log.poll(0, log.epoch)
    assert set(reply["stats"]) == {"r1"} and set(log.cluster_stats()) == {"r1"}
    assert [e[1:3] for e in reply["entries"]][-1] == ["r0", "drop"]
    again = log.publish("r0", "t", [("stored", [9])], {"num_running": 0})["epoch"]
    assert again != first["epoch"] and again.startswith(log.epoch)  # the replica resends its whole cache
    assert sorted(log.poll(0, "another-epoch")["snapshot"]["r0"]) == [9]


def test_state_log_carries_admin_commands_and_drain_marks_to_live_replicas() -> None:
    """A command reaches its replica once, with its next publish; the replica's result comes back
    with the publish after; a drain mark is in every reply until lifted; dead replicas get none."""
    log = ReplicaStateLog()
    log.publish("r0", "t", [], {"num_running": 0})
    log.publish("r1", "t", [], {"num_running": 0})
    assert log.send_command("gone", "reset_prefix_cache") is None
    assert log.set_draining("gone", True) is False
    cid = log.send_command("r0", "abort", {"request_id": "req-1"})
    assert log.command_result(cid) == {"done": False, "result": None}
    assert log.publish("r1", "t", [], None)["commands"] == []
    reply = log.publish("r0", "t", [], None)
    assert reply["commands"] == [{"id": cid, "kind": "abort", "request_id": "req-1"}]
    assert log.publish("r0", "t", [], None)["commands"] == []  # handed out once
    log.publish("r0", "t", [], None, {cid: {"aborted": True}})
    assert log.command_result(cid) == {"done": True, "result": {"aborted": True}}
    assert log.set_draining("r1", True) is True
    assert log.publish("r1", "t", [], None)["draining"] is True
    assert log.publish("r0", "t", [], None)["draining"] is False
    assert log.poll(0, log.epoch)["draining"] == ["r1"]
    log.set_draining("r1", False)
    assert log.publish("r1", "t", [], None)["draining"] is False
    log.set_draining("r1", True)
    log.drop("r1")  # a replica that is gone is no longer draining
    assert log.poll(0, log.epoch)["draining"] == []


# ---- the Serve adapters -----------------------------------------------------------------------


class FakeReplica(RunningReplica):
    """A RunningReplica with fixed routing stats and queue length, no actor behind it."""

    def __init__(self, unique_id: str, stats: dict | None = None, queue_len: int = 0) -> None:
        self._id = ReplicaID(unique_id, DeploymentID(name="engine", app_name="test"))
        self.stats = stats or {}
        self.queue_len = queue_len

    replica_id = property(lambda self: self._id)
    routing_stats = property(lambda self: self.stats)
    max_ongoing_requests = property(lambda self: 100)
    node_id = property(lambda self: "")
    availability_zone = property(lambda self: None)
    multiplexed_model_ids = property(lambda self: set())

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue_len


def make_router(cls: type, **kwargs) -> object:
    router = cls(
        deployment_id=DeploymentID(name="engine", app_name="test"),
        handle_source=DeploymentHandleSource.UNKNOWN,
        use_replica_queue_len_cache=True,
    )
    router.initialize_state(**kwargs)
    return router


def pending(block_hashes: list[int], session_id: str | None = None, n: int = 0) -> PendingRequest:
    meta = RequestMetadata(request_id=f"req{n}", internal_request_id=f"int{n}")
    return PendingRequest(
        args=[{"block_hashes": block_hashes, "session_id": session_id}], kwargs={}, metadata=meta
    )


def test_router_class_for_maps_the_routing_flag() -> None:
    assert router_class_for("prefix") is PrefixAwareRouter
    assert router_class_for("round_robin") is RoundRobinRouter
    assert router_class_for("pow2") is PowerOfTwoRouter
    with pytest.raises(ValueError):
        router_class_for("random")


@pytest.mark.parametrize("cls", [PrefixAwareRouter, RoundRobinRouter, PowerOfTwoRouter])
def test_routers_pass_over_draining_replicas_unless_all_drain(cls: type) -> None:
    """A replica whose routing stats say draining is never ranked while another one takes
    requests; when every replica drains the routers still rank them (the replicas refuse)."""

    async def scenario() -> None:
        kwargs = {"sync_from_actor": False, "seed": 0} if cls is PrefixAwareRouter else {}
        router = make_router(cls, **kwargs)
        draining = FakeReplica("r0", {"num_running": 0, "draining": True})
        open_ = FakeReplica("r1", {"num_running": 9})
        router.update_replicas([draining, open_])
        for n in range(20):
            ranks = await router.choose_replicas([draining, open_], pending([], n=n))
            assert [r.replica_id.unique_id for rank in ranks for r in rank] == ["r1"]
        both = [FakeReplica("r0", {"draining": True}), FakeReplica("r1", {"draining": True})]
        ranks = await router.choose_replicas(both, pending([], n=99))
        assert sorted(r.replica_id.unique_id for rank in ranks for r in rank) == ["r0", "r1"]

    asyncio.run(scenario())


def test_prefix_router_takes_drain_marks_from_the_state_log() -> None:
    """The state log's drain mark reaches the router with its next sync, before the replica's own
    routing stats (sent every 0.5 s) say so: the replica holding the prompt is passed over."""

    async def scenario() -> None:
        router = make_router(PrefixAwareRouter, sync_from_actor=False, seed=0)
        reps = [FakeReplica("r0", {"num_running": 0}), FakeReplica("r1", {"num_running": 0})]
        router.update_replicas(reps)
        log = ReplicaStateLog()
        prompt_hashes = hash_blocks(tokens(3, 4 * BS), BS)
        log.publish("r0", "t", [("stored", prompt_hashes)], {"num_running": 0})
        log.publish("r1", "t", [], {"num_running": 0})
        router.apply_state(log.poll(router.seq, router.epoch))
        ranks = await router.choose_replicas(reps, pending(prompt_hashes, n=1))
        assert ranks[0][0].replica_id.unique_id == "r0"
        log.set_draining("r0", True)
        router.apply_state(log.poll(router.seq, router.epoch))
        ranks = await router.choose_replicas(reps, pending(prompt_hashes, n=2))
        assert [r.replica_id.unique_id for rank in ranks for r in rank] == ["r1"]

    asyncio.run(scenario())


def test_prefix_router_follows_events_through_the_state_log() -> None:
    """Replica events -> ReplicaStateLog -> the router's mirror -> choose_replicas, as under Serve."""

    async def scenario() -> None:
        router = make_router(PrefixAwareRouter, sync_from_actor=False, seed=0, balance_abs_threshold=4)
        reps = [FakeReplica("r0", {"num_running": 3}), FakeReplica("r1", {"num_running": 1})]
        router.update_replicas(reps)
        log = ReplicaStateLog()
        bm = BlockManager(64, BS)
        prompt = tokens(5, 20 * BS)
        run_on(bm, "x", prompt)
        log.publish(
            "r0", "tok", bm.take_events(), {"num_running": 3, "num_waiting": 0, "kv_cache_usage": 0.3}
        )
        router.apply_state(log.poll(router.seq, router.epoch))
        before = decision_counts().get(("prefix", "prefix_hit"), 0)

        pr = pending(hash_blocks(prompt, BS))
        ranks = await router.choose_replicas(reps, pr)
        assert [[r.replica_id.unique_id for r in rank] for rank in ranks] == [["r0"], ["r1"]]
        assert pr.routing_context.should_backoff  # a pass that places nothing must back off
        await router.choose_replicas(reps, pr)  # a retry pass is not a second decision
        assert decision_counts()[("prefix", "prefix_hit")] == before + 1

        # Requests in flight to r0 that its stats do not show yet make it overloaded.
        for _ in range(6):
            router.on_send_request(reps[0].replica_id)
        assert router.load_of(reps[0]).num_requests == 6
        ranks = await router.choose_replicas(reps, pending(hash_blocks(prompt, BS), n=1))
        assert ranks[0][0].replica_id.unique_id == "r1"
        for i in range(6):
            router.on_request_completed(reps[0].replica_id, f"int{i}")
        assert router.load_of(reps[0]).num_requests == 3

        # r0 evicts the prompt: the router drops it; a replica that leaves is forgotten.
        bm.free("x")
        run_on(bm, "y", tokens(6, 64 * BS))
        log.publish("r0", "tok", bm.take_events(), None)
        router.apply_state(log.poll(router.seq, router.epoch))
        assert router.policy.index.match(hash_blocks(prompt, BS), ["r0"]) == {"r0": 0}
        router.update_replicas(reps[1:])
        assert router.policy.index.replicas() == []

    asyncio.run(scenario())


def test_prefix_router_counts_the_prefill_work_it_sends() -> None:
    """Uncached prompt blocks in flight, per replica, from routed to completed; they order the
    replicas when a prompt matches nowhere, so a long prompt's replica is not picked next."""

    async def scenario() -> None:
        router = make_router(PrefixAwareRouter, sync_from_actor=False, seed=0)
        reps = [FakeReplica("r0"), FakeReplica("r1")]
        router.update_replicas(reps)
        router.policy.index.apply("r0", [("stored", [1, 2, 3, 4])])
        long = pending(list(range(1, 11)), n=1)  # 10 blocks, 4 of them cached on r0
        ranks = await router.choose_replicas(reps, long)
        assert ranks[0][0].replica_id.unique_id == "r0"
        router.on_send_request(reps[0].replica_id)
        router.on_request_routed(long, reps[0].replica_id, None)
        assert router.load_of(reps[0]).prefill_blocks == 6 and router.load_of(reps[1]).prefill_blocks == 0
        for n in range(2, 6):  # unmatched prompts go where the least prefill work is queued
            pr = pending([100 * n + 1], n=n)
            assert (await router.choose_replicas(reps, pr))[0][0].replica_id.unique_id == "r1"
        # Serve may place a request from the second rank: that replica's own match counts.
        other = pending(list(range(1, 11)), n=9)
        await router.choose_replicas(reps, other)
        router.on_request_routed(other, reps[1].replica_id, None)
        assert router.load_of(reps[1]).prefill_blocks == 10
        router.on_request_completed(reps[0].replica_id, "int1")
        router.on_request_completed(reps[1].replica_id, "int9")
        assert router.prefill_blocks == {"r0": 0, "r1": 0}
        assert router.load_of(reps[0]).num_requests == 0

    asyncio.run(scenario())


def test_prefix_router_mirror_from_a_snapshot() -> None:
    """A router that starts late (or sees a new state actor) rebuilds its mirror from a snapshot."""
    log = ReplicaStateLog()
    log.publish("r0", "t", [("stored", [1, 2, 3]), ("removed", [3])], {"num_running": 2})
    log.publish("r1", "t", [("stored", [1])], None)
    log.drop("r1")
    router = make_router(PrefixAwareRouter, sync_from_actor=False)
    router.policy.index.apply("stale", [("stored", [1, 2, 3])])
    reply = log.poll(0, "an older epoch")
    assert "snapshot" in reply
    router.apply_state(reply)
    assert router.policy.index.replicas() == ["r0"]
    assert router.policy.index.match([1, 2, 3], ["r0"]) == {"r0": 2}
    assert (router.seq, router.epoch) == (reply["seq"], log.epoch)
    assert router.load_of(FakeReplica("r0")).num_running == 2


def test_prefix_router_without_block_hashes_balances_load() -> None:
    async def scenario() -> None:
        router = make_router(PrefixAwareRouter, sync_from_actor=False, seed=0)
        reps = [FakeReplica("a", {"num_running": 5}), FakeReplica("b", {"num_running": 0})]
        router.update_replicas(reps)
        ranks = await router.choose_replicas(reps, None)
        assert ranks[0][0].replica_id.unique_id == "b"
        assert await router.choose_replicas([], None) == []

    asyncio.run(scenario())


def test_round_robin_router_cycles_and_ranks_the_rest() -> None:
    async def scenario() -> None:
        router = make_router(RoundRobinRouter)
        reps = [FakeReplica(name) for name in ("c", "a", "b")]
        router.update_replicas(reps)
        firsts = []
        for i in range(6):
            ranks = await router.choose_replicas(reps, pending([], n=i))
            assert sorted(r[0].replica_id.unique_id for r in ranks) == ["a", "b", "c"]
            firsts.append(ranks[0][0].replica_id.unique_id)
        assert firsts == ["a", "b", "c", "a", "b", "c"]

    asyncio.run(scenario())


def test_decision_counts_are_per_process_state() -> None:
    before = decision_counts().get(("prefix", "test"), 0)
    state.record_decision("prefix", "test")
    assert decision_counts()[("prefix", "test")] == before + 1


# ---- served end to end (tests/router/conftest.py: 2 replicas of the default model, --routing prefix)


def _held_blocks() -> dict[str, set[int]]:
    """What each replica holds now, according to its own KV events (the state actor's snapshot)."""
    return {
        rid: set(hashes) for rid, hashes in asyncio.run(state.poll_replica_state(0, None))["snapshot"].items()
    }


def _prefix_hits() -> dict[str, int]:
    return {rid: int(s["prefix_cache_hits"]) for rid, s in asyncio.run(state.cluster_stats()).items()}


def _decisions(base_url: str, api_key: str) -> dict[str, float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    req = urllib.request.Request(f"{base_url}/metrics", headers={"Authorization": f"Bearer {api_key}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "pagedserve:router_decisions_total" and s.labels["policy"] == "prefix":
                out[s.labels["outcome"]] = s.value
    return out


def _settle() -> None:
    time.sleep(1.5)  # busy replicas publish every 0.25 s, routers poll as often for 2 s after a request


@pytest.mark.slow
def test_served_shared_prefix_follows_its_holder_until_evicted(server) -> None:
    """Two served replicas: requests sharing a long prefix go to the replica that holds it (its
    prefix-hit counter takes every hit, the other's none); once it has evicted the prefix the
    router no longer prefers it (a power-of-two decision, and no hits)."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    client = openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0, timeout=300
    )
    rng = random.Random(20240)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(n)]

    def complete(prompt: list[int]) -> None:
        client.completions.create(model=server.model, prompt=prompt, max_tokens=1, temperature=0)

    prefix = ids(20 * BS)
    prefix_hashes = hash_blocks(prefix, BS)
    complete(prefix + ids(2 * BS))
    _settle()
    holders = [rid for rid, held in _held_blocks().items() if set(prefix_hashes) <= held]
    assert len(holders) == 1, holders
    holder = holders[0]
    hits = _prefix_hits()
    assert len(hits) == 2
    before = _decisions(server.base_url, server.api_key).get("prefix_hit", 0)
    for _ in range(4):
        complete(prefix + ids(2 * BS))
        _settle()
    after = _prefix_hits()
    gained = {rid: after[rid] - hits[rid] for rid in after}
    assert gained[holder] == 4 * len(prefix)
    assert all(g == 0 for rid, g in gained.items() if rid != holder)
    assert _decisions(server.base_url, server.api_key).get("prefix_hit", 0) >= before + 4

    # Unrelated prompts until the holder's own events say the prefix is gone from its cache.
    with ThreadPoolExecutor(4) as pool:
        for _ in range(12):
            if prefix_hashes[0] not in _held_blocks()[holder]:
                break
            list(pool.map(complete, [ids(server.max_model_len - 2 * BS) for _ in range(4)]))
            _settle()
    assert prefix_hashes[0] not in _held_blocks()[holder], "the flood never evicted the prefix"
    assert all(prefix_hashes[0] not in held for held in _held_blocks().values())
    hits = _prefix_hits()
    decided = _decisions(server.base_url, server.api_key)
    complete(prefix + ids(2 * BS))
    _settle()
    now = _decisions(server.base_url, server.api_key)
    assert now.get("pow2", 0) == decided.get("pow2", 0) + 1
    assert now.get("prefix_hit", 0) == decided.get("prefix_hit", 0)
    assert all(_prefix_hits()[rid] == hits[rid] for rid in hits)


@pytest.mark.slow
def test_state_actor_round_trip(ray_session: None) -> None:
    """The named state actor through the client functions the replicas, routers and /metrics use."""

    async def scenario() -> None:
        rid = "test-state-replica"
        await state.publish_replica_state(rid, [("stored", [1, 2, 3])], {"num_running": 1})
        reply = await state.poll_replica_state(0, None)
        assert sorted(reply["snapshot"][rid]) == [1, 2, 3]
        await state.publish_replica_state(rid, [("removed", [2])], {"num_running": 0})
        later = await state.poll_replica_state(reply["seq"], reply["epoch"])
        assert [e[2:] for e in later["entries"] if e[1] == rid] == [["removed", [2]]]
        assert (await state.cluster_stats())[rid] == {"num_running": 0}
        await state.drop_replica(rid)
        assert rid not in await state.cluster_stats()
        last = await state.poll_replica_state(later["seq"], later["epoch"])
        assert [e[2] for e in last["entries"] if e[1] == rid] == ["drop"]

    asyncio.run(scenario())


def test_prefix_router_polls_often_while_busy_and_seldom_idle(monkeypatch) -> None:
    """The sync loop's cadence: the idle interval while nothing happens, the short one after a
    poll that brought KV events, while a replica runs requests, or while the router has requests
    in flight; back to the idle one after."""
    from pagedserve.router import prefix_router

    log = ReplicaStateLog()
    log.publish("r0", "t", [], {"num_running": 0})
    waits: list[float] = []
    script = {  # before poll n: what happens in the cluster
        3: lambda router: log.publish("r0", "t", [("stored", [1, 2])], {"num_running": 0}),
        5: lambda router: log.publish("r0", "t", [], {"num_running": 2}),
        7: lambda router: log.publish("r0", "t", [], {"num_running": 0}),
        9: lambda router: router.in_flight.__setitem__("r0", 1),
        11: lambda router: router.in_flight.__setitem__("r0", 0),
    }

    async def scenario() -> None:
        router = make_router(PrefixAwareRouter, sync_from_actor=False, sync_interval_s=0.25,
                             idle_sync_interval_s=1.0)  # fmt: skip

        async def poll(since: int, epoch: str | None) -> dict:
            n = len(waits)
            if n in script:
                script[n](router)
            return log.poll(since, epoch)

        class Clock:  # the loop's sleeps, recorded and not slept
            @staticmethod
            async def sleep(seconds: float) -> None:
                waits.append(seconds)
                if len(waits) >= 13:
                    raise asyncio.CancelledError

        monkeypatch.setattr(prefix_router.state, "poll_replica_state", poll)
        monkeypatch.setattr(prefix_router, "asyncio", Clock)
        with pytest.raises(asyncio.CancelledError):
            await router._sync_loop()

    asyncio.run(scenario())
    # polls 0-1 idle (the first brings a snapshot: busy), 3 events, 5-6 running, 9-10 in flight
    assert waits == [0.25, 1.0, 1.0, 0.25, 1.0, 0.25, 0.25, 1.0, 1.0, 0.25, 0.25, 1.0, 1.0], waits
