"""Request routing on the handle call from the ingress to the engine replicas.

``PrefixPolicy.choose`` is the whole decision, in plain Python so that the routing benchmark
runs the very code Serve runs: score every replica by how many leading blocks of the prompt it
actually holds (``PrefixIndex``, learned from the replicas' KV events: blocks stored *and*
removed, hashed with the engine's own chain, so evictions are known), send to the longest match
unless that replica's load is past a threshold over the least-loaded one, and otherwise use
power-of-two choices. A session id (``user`` or ``x-session-id``) keeps a conversation on its
replica while no other replica holds more of its prompt.

``PrefixAwareRouter`` and ``RoundRobinRouter`` are thin Ray Serve ``RequestRouter`` adapters.
Serve pickles this module by value into every handle's process, so nothing here is process-wide
state: counters and the replica-state actor client live in ``pagedserve/router/state.py``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedserve.router import state
from pagedserve.router.state import decision_counts

__all__ = [
    "Load",
    "PrefixAwareRouter",
    "PrefixIndex",
    "PrefixPolicy",
    "PowerOfTwoRouter",
    "PrefixRouterConfig",
    "RoundRobinRouter",
    "accepting",
    "decision_counts",
    "router_class_for",
]

logger = logging.getLogger(__name__)

# A router keeps polling at its short interval this long after its last decision: the request's
# KV events reach the state actor with its replica's publishes after it ends (within ~0.5 s), and
# the next request of a conversation should find them.
RECENT_REQUEST_S = 2.0


@dataclass(slots=True)
class Load:
    """One replica's load as the router sees it.

    ``prefill_blocks`` is the router's own estimate of the work it has sent there: the uncached
    prompt blocks of its requests in flight to that replica. Request counts say how many; this
    says how much, which is what a newcomer's first token waits on when prompt lengths vary.
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks referenced by requests (cached-free excluded)
    prefill_blocks: int = 0

    @property
    def num_requests(self) -> int:
        return self.num_running + self.num_waiting


@dataclass(slots=True)
class PrefixRouterConfig:
    """When a prefix match yields to load. Names and the rule follow SGLang's cache-aware router.

    The longest-match replica is passed over when it carries more than ``balance_abs_threshold``
    requests above the least-loaded replica *and* more than ``balance_rel_threshold`` times its
    requests, or when its KV usage is at ``kv_usage_limit`` while the least-loaded one's is not.
    """

    balance_abs_threshold: float = 16.0
    balance_rel_threshold: float = 1.5
    kv_usage_limit: float = 0.95
    max_sessions: int = 100_000
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.balance_abs_threshold < 0:
            raise ValueError("balance_abs_threshold must be >= 0")
        if self.balance_rel_threshold < 1:
            raise ValueError("balance_rel_threshold must be >= 1")
        if not 0 < self.kv_usage_limit <= 1:
            raise ValueError("kv_usage_limit must be in (0, 1]")
        if self.max_sessions < 0:
            raise ValueError("max_sessions must be >= 0")


class PrefixIndex:
    """Which replicas hold which KV blocks, from their ordered ("stored" | "removed", hashes) events.

    ``holders`` maps a block hash to a bitmask of replica slots, so matching a prompt is one dict
    lookup and one AND per block, whatever the number of replicas or cached blocks. Events are
    idempotent per (hash, replica): a repeated "stored" or a "removed" of an absent block is a no-op.
    """

    def __init__(self) -> None:
        self.holders: dict[int, int] = {}  # block hash -> bitmask of replica slots holding it
        self._slot: dict[str, int] = {}  # replica id -> its bit
        self._free_slots: list[int] = []
        self._counts: dict[str, int] = {}  # replica id -> blocks it holds

    def _bit(self, replica_id: str) -> int:
        slot = self._slot.get(replica_id)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._slot)
            self._slot[replica_id] = slot
            self._counts[replica_id] = 0
        return 1 << slot

    def apply(self, replica_id: str, events: Iterable[tuple[str, Sequence[int]]]) -> None:
        """Apply one replica's KV events in the order it emitted them."""
        bit = self._bit(replica_id)
        holders = self.holders
        count = self._counts[replica_id]
        for kind, hashes in events:
            if kind == "stored":
                for h in hashes:
                    mask = holders.get(h, 0)
                    if not mask & bit:
                        holders[h] = mask | bit
                        count += 1
            elif kind == "removed":
                for h in hashes:
                    mask = holders.get(h, 0)
                    if mask & bit:
                        count -= 1
                        if mask == bit:
                            del holders[h]
                        else:
                            holders[h] = mask & ~bit
            else:
                raise ValueError(f"unknown KV event kind {kind!r}")
        self._counts[replica_id] = count

    def reset(self, replica_id: str) -> None:
        """The replica holds nothing any more (it restarted, or it is gone). O(index size): rare."""
        slot = self._slot.get(replica_id)
        if slot is None:
            return
        bit = 1 << slot
        holders = self.holders
        for h in [h for h, mask in holders.items() if mask & bit]:
            mask = holders[h] & ~bit
            if mask:
                holders[h] = mask
            else:
                del holders[h]
        self._counts[replica_id] = 0

    def drop(self, replica_id: str) -> None:
        """Forget the replica and free its slot for reuse."""
        self.reset(replica_id)
        slot = self._slot.pop(replica_id, None)
        if slot is not None:
            self._free_slots.append(slot)
            del self._counts[replica_id]

    def apply_log(self, entries: Iterable[Sequence[Any]]) -> None:
        """Apply ``ReplicaStateLog`` entries: (seq, replica, "stored"|"removed"|"reset"|"drop", hashes)."""
        for _, rid, kind, hashes in entries:
            if kind == "reset":
                self.reset(rid)
            elif kind == "drop":
                self.drop(rid)
            else:
                self.apply(rid, [(kind, hashes)])

    def clear(self) -> None:
        self.__init__()

    def num_blocks(self, replica_id: str) -> int:
        """How many blocks the replica holds, as far as its events tell."""
        return self._counts.get(replica_id, 0)

    def replicas(self) -> list[str]:
        return list(self._slot)

    def match(self, block_hashes: Sequence[int], replica_ids: Iterable[str]) -> dict[str, int]:
        """For each replica, how many leading blocks of ``block_hashes`` it holds."""
        result = dict.fromkeys(replica_ids, 0)
        bits = {rid: 1 << self._slot[rid] for rid in result if rid in self._slot}
        alive = 0
        for bit in bits.values():
            alive |= bit
        get = self.holders.get
        depth = 0
        for h in block_hashes:
            if not alive:
                break
            held = alive & get(h, 0)
            if held != alive:
                gone = alive & ~held
                for rid, bit in bits.items():
                    if gone & bit:
                        result[rid] = depth
                alive = held
            depth += 1
        for rid, bit in bits.items():
            if alive & bit:
                result[rid] = depth
        return result


class PrefixPolicy:
    """The routing decision: longest actual prefix match, bounded by load; else power of two."""

    def __init__(self, config: PrefixRouterConfig | None = None, index: PrefixIndex | None = None) -> None:
        self.config = config or PrefixRouterConfig()
        self.index = index if index is not None else PrefixIndex()
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session id -> replica id, LRU
        self._rng = random.Random(self.config.seed)

    def _key(self, load: Load) -> tuple[int, int, float, float]:
        """Least loaded first: prefill work sent, then requests, then KV usage; random breaks ties."""
        return (load.prefill_blocks, load.num_requests, load.kv_cache_usage, self._rng.random())

    def _overloaded(self, load: Load, least: Load) -> bool:
        cfg = self.config
        if load.kv_cache_usage >= cfg.kv_usage_limit > least.kv_cache_usage:
            return True
        n, m = load.num_requests, least.num_requests
        return n - m > cfg.balance_abs_threshold and n > cfg.balance_rel_threshold * m

    def choose(
        self, block_hashes: Sequence[int], loads: Mapping[str, Load], session_id: str | None = None
    ) -> tuple[str, str]:
        """Pick a replica among ``loads``' keys; returns (replica id, outcome).

        Outcomes: "session" (the session's replica, which holds as much of the prompt as any),
        "prefix_hit" (the longest match, not overloaded), "load_balanced" (the longest match was
        overloaded: the longest match among the others that are not), "pow2" (no replica holds
        any of the prompt: the less loaded of two random replicas).
        """
        if not loads:
            raise ValueError("no replicas to choose from")
        ids = list(loads)
        keys = {rid: self._key(loads[rid]) for rid in ids}
        least = loads[min(ids, key=keys.__getitem__)]
        matched = self.index.match(block_hashes, ids)
        best = max(matched.values())
        sticky = self._sessions.get(session_id) if session_id is not None else None
        if sticky in loads and matched[sticky] >= best and not self._overloaded(loads[sticky], least):
            choice, outcome = sticky, "session"
        elif best > 0:
            choice = min((rid for rid in ids if matched[rid] == best), key=keys.__getitem__)
            outcome = "prefix_hit"
            if self._overloaded(loads[choice], least):
                fit = [rid for rid in ids if not self._overloaded(loads[rid], least)]
                choice = min(fit, key=lambda rid: (-matched[rid], keys[rid]))
                outcome = "load_balanced"
        else:
            pair = self._rng.sample(ids, 2) if len(ids) > 1 else ids
            choice, outcome = min(pair, key=keys.__getitem__), "pow2"
        if session_id is not None and self.config.max_sessions:
            self._sessions[session_id] = choice
            self._sessions.move_to_end(session_id)
            if len(self._sessions) > self.config.max_sessions:
                self._sessions.popitem(last=False)
        return choice, outcome


# ---- Ray Serve adapters ---------------------------------------------------------------------


def accepting(candidates: list[RunningReplica], draining: set[str] | frozenset[str] = frozenset()
              ) -> list[RunningReplica]:  # fmt: skip
    """The candidates not draining: by the state log's marks (``draining``) or the replica's own
    routing stats. All of them when every one drains: the replicas then turn the request away
    (503 ``replica_draining``) rather than the router hiding it."""
    open_ = [
        r for r in candidates
        if r.replica_id.unique_id not in draining and not (r.routing_stats or {}).get("draining")
    ]  # fmt: skip
    return open_ or candidates


def request_keys(pending_request: PendingRequest | None) -> tuple[list[int], str | None]:
    """(block hashes, session id) from the ingress's request dict in ``args[0]``; empty if absent."""
    if pending_request is None or not pending_request.args:
        return [], None
    arg = pending_request.args[0]
    if not isinstance(arg, dict):
        return [], None
    return arg.get("block_hashes") or [], arg.get("session_id")


class PrefixAwareRouter(RequestRouter):
    """Serve request router running ``PrefixPolicy`` over a local mirror of the replicas' KV events.

    A background task on the router's event loop polls the state actor (``state.py``) every
    ``sync_interval_s`` while the cluster is busy (this router has requests in flight or decided
    one in the last RECENT_REQUEST_S, the last poll brought KV events, or a replica runs or queues
    requests), else every ``idle_sync_interval_s``, and applies the new events, so
    ``choose_replicas`` never awaits anything. (Each poll is a Ray actor call on the cores the
    engines run on: see app.PUBLISH_PERIOD_S, which replicas publish at.)
    Load = the replica's last published stats (or its ``routing_stats``), raised to this router's
    own count of requests in flight to it, which is fresher, plus the uncached prompt blocks of
    those requests (tracked from routed to completed).
    """

    max_pending_choices = 10_000  # decided but never routed (cancelled) entries are dropped past this

    policy_name = "prefix"

    def initialize_state(
        self,
        sync_interval_s: float = 0.25,
        idle_sync_interval_s: float = 1.0,
        stats_max_age_s: float = 3.0,
        sync_from_actor: bool = True,
        **policy_kwargs: Any,
    ) -> None:
        """Called by Serve with ``request_router_kwargs``; the rest go to ``PrefixRouterConfig``."""
        self.policy = PrefixPolicy(PrefixRouterConfig(**policy_kwargs))
        self.sync_interval_s = sync_interval_s
        self.idle_sync_interval_s = idle_sync_interval_s
        self._last_request = -math.inf  # monotonic time of the last decision (see RECENT_REQUEST_S)
        self.stats_max_age_s = stats_max_age_s
        self.sync_from_actor = sync_from_actor
        self.in_flight: defaultdict[str, int] = defaultdict(int)
        self.prefill_blocks: defaultdict[str, int] = defaultdict(int)
        # internal request id -> (replica chosen, its uncached blocks, block hashes, outcome), until routed
        self._chosen: OrderedDict[str, tuple[str, int, list[int], str]] = OrderedDict()
        self._routed: dict[str, tuple[str, int]] = {}  # internal request id -> (replica, blocks) in flight
        self.seq = 0
        self.epoch: str | None = None
        self._stats: dict[str, tuple[dict, float]] = {}  # replica id -> (stats, monotonic time taken)
        self.draining: set[str] = set()  # replica ids the state log marks draining
        self._sync_task: asyncio.Task | None = None

    # -- mirror of the state actor --

    def apply_state(self, reply: Mapping[str, Any]) -> None:
        """Apply one ``ReplicaStateLog.poll`` reply to the local index and stats."""
        index = self.policy.index
        if "snapshot" in reply:
            index.clear()
            for rid, hashes in reply["snapshot"].items():
                index.apply(rid, [("stored", hashes)])
        else:
            index.apply_log(reply["entries"])
        self.seq, self.epoch = reply["seq"], reply["epoch"]
        self.draining = set(reply.get("draining", ()))
        now = time.monotonic()
        ages = reply.get("stats_age_s", {})
        self._stats = {rid: (s, now - ages.get(rid, 0.0)) for rid, s in reply.get("stats", {}).items()}

    def busy(self, reply: Mapping[str, Any]) -> bool:
        """Whether the cluster is busy as of this poll reply: poll again soon."""
        if reply.get("entries") or "snapshot" in reply or any(n > 0 for n in self.in_flight.values()):
            return True
        if time.monotonic() - self._last_request < RECENT_REQUEST_S:
            return True  # its KV events come with the replica's publishes after it ends
        stats = reply.get("stats", {}).values()
        return any(s.get("num_running", 0) or s.get("num_waiting", 0) for s in stats)

    async def _sync_loop(self) -> None:
        failures = 0
        while True:
            interval = self.sync_interval_s
            try:
                reply = await state.poll_replica_state(self.seq, self.epoch)
                self.apply_state(reply)
                failures = 0
                if not self.busy(reply):
                    interval = self.idle_sync_interval_s
            except Exception:  # the router keeps routing on what it knows; the state actor may return
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    logger.warning(
                        "prefix router: syncing replica state failed %d times", failures, exc_info=True
                    )
            await asyncio.sleep(min(interval * 2**failures, max(interval, 2.0)))

    def _ensure_sync(self) -> None:
        if self.sync_from_actor and (self._sync_task is None or self._sync_task.done()):
            self._sync_task = asyncio.get_running_loop().create_task(self._sync_loop())

    # -- load --

    def load_of(self, replica: RunningReplica) -> Load:
        rid = replica.replica_id.unique_id
        published = self._stats.get(rid)
        if published is not None and time.monotonic() - published[1] <= self.stats_max_age_s:
            stats = published[0]
        else:
            stats = replica.routing_stats or {}
        load = Load(
            int(stats.get("num_running", 0)),
            int(stats.get("num_waiting", 0)),
            float(stats.get("kv_cache_usage", 0.0)),
            self.prefill_blocks.get(rid, 0),
        )
        # Requests this router sent that the replica's figures do not show yet are queued there.
        load.num_waiting += max(0, self.in_flight.get(rid, 0) - load.num_requests)
        return load

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self.in_flight[replica_id.unique_id] += 1

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        iid = pending_request.metadata.internal_request_id
        chosen = self._chosen.pop(iid, None)
        if chosen is None:
            return
        rid = replica_id.unique_id
        choice, blocks, hashes, outcome = chosen
        state.record_routed(self.policy_name, outcome, rid)
        if rid != choice:  # Serve placed it from the second rank: its own match counts
            blocks = len(hashes) - self.policy.index.match(hashes, [rid])[rid]
        self._routed[iid] = (rid, blocks)
        self.prefill_blocks[rid] += blocks

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        rid = replica_id.unique_id
        if self.in_flight.get(rid, 0) > 0:
            self.in_flight[rid] -= 1
        self._chosen.pop(internal_request_id, None)
        routed = self._routed.pop(internal_request_id, None)
        if routed is not None:
            self.prefill_blocks[routed[0]] -= routed[1]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = {r.unique_id for r in self._replica_id_set}
        super().update_replicas(replicas)
        for rid in before - {r.unique_id for r in self._replica_id_set}:
            self.policy.index.drop(rid)
            self.in_flight.pop(rid, None)
            self.prefill_blocks.pop(rid, None)

    # -- the decision --

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """Rank 1: the policy's choice; rank 2: every other candidate (Serve takes the least queued)."""
        self._ensure_sync()
        self._last_request = time.monotonic()
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in accepting(candidate_replicas, self.draining)}
        loads = {rid: self.load_of(r) for rid, r in by_id.items()}
        hashes, session_id = request_keys(pending_request)
        choice, outcome = self.policy.choose(hashes, loads, session_id)
        if pending_request is not None:
            uncached = len(hashes) - self.policy.index.match(hashes, [choice])[choice]
            self._chosen[pending_request.metadata.internal_request_id] = (choice, uncached, hashes, outcome)
            if len(self._chosen) > self.max_pending_choices:
                self._chosen.popitem(last=False)
            ctx = pending_request.routing_context
            if not ctx.should_backoff:  # the first pass for this request: count it once
                state.record_decision(self.policy_name, outcome)
            # Every pass ranks all candidates; one that placed nothing means all are full: back off.
            ctx.should_backoff = True
        rest = [r for rid, r in by_id.items() if rid != choice]
        return [[by_id[choice]], rest] if rest else [[by_id[choice]]]


class RoundRobinRouter(RequestRouter):
    """Serve request router that cycles through the replicas (ordered by id), skipping full ones."""

    policy_name = "round_robin"

    def initialize_state(self, **kwargs: Any) -> None:
        self._next = 0

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """One rank per replica, starting at the next in turn."""
        if not candidate_replicas:
            return []
        ordered = sorted(accepting(candidate_replicas), key=lambda r: r.replica_id.unique_id)
        i = self._next % len(ordered)
        self._next += 1
        if pending_request is not None:
            ctx = pending_request.routing_context
            if not ctx.should_backoff:
                state.record_decision(self.policy_name, "round_robin")
            ctx.should_backoff = True
        return [[r] for r in ordered[i:] + ordered[:i]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        state.record_routed(self.policy_name, "round_robin", replica_id.unique_id)


class PowerOfTwoRouter(PowerOfTwoChoicesRequestRouter):
    """Serve's power-of-two-choices router, passing over draining replicas and counting where it
    places requests (for the admin dashboard)."""

    policy_name = "pow2"

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        ranks = await super().choose_replicas(candidate_replicas, pending_request)
        open_ = accepting(candidate_replicas)
        if len(open_) == len(candidate_replicas):
            return ranks
        # Serve's procedure samples from all its replicas: keep its picks that take requests, or
        # two of those that do when it picked only draining ones
        ids = {r.replica_id.unique_id for r in open_}
        kept = [r for rank in ranks for r in rank if r.replica_id.unique_id in ids]
        return [kept or random.sample(open_, min(2, len(open_)))]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        state.record_routed(self.policy_name, "pow2", replica_id.unique_id)


def router_class_for(policy: str) -> type[RequestRouter]:
    """The request router class for ``--routing``."""
    classes: dict[str, type[RequestRouter]] = {
        "prefix": PrefixAwareRouter,
        "round_robin": RoundRobinRouter,
        "pow2": PowerOfTwoRouter,
    }
    if policy not in classes:
        raise ValueError(f"unknown routing policy {policy!r}; expected one of {sorted(classes)}")
    return classes[policy]
