"""Router state shared across processes: the replicas' KV events and stats, and decision counters.

The engine replicas publish what their prefix caches store and evict (block hashes from
``cluster/hashing.py``) and their load figures to one named actor; each request router mirrors
that log locally, so a routing decision never waits on an actor call.

This module is imported by reference everywhere. Serve pickles a request router's module by
value, so state that must be one per process (the decision counters) lives here, not beside the
router class.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import ray

logger = logging.getLogger(__name__)

NAMESPACE = "pagedserve"
STATE_ACTOR_NAME = "pagedserve_replica_state"

# A replica publishes at least once a second (app.PUBLISH_IDLE_S): one silent this long is gone
# (its process was killed, its node lost) and is dropped, so that its blocks and stats do not
# outlive it.
STALE_REPLICA_S = 10.0

# How long a command's result waits for the admin API to read it.
RESULTS_KEPT_S = 60.0

# A log entry is [seq, replica_id, kind, hashes]; kind is "stored" | "removed" (KV events), "reset"
# (the replica restarted: it holds nothing) or "drop" (the replica is gone).
Entry = list


class ReplicaStateLog:
    """The replicas' KV events as one ordered log with sequence numbers, and their last stats.

    A reader that has applied every entry up to ``seq`` asks ``poll(seq, epoch)`` and gets the
    entries after it, each once, in order. The log keeps about ``max_log_hashes`` hashes; a reader
    that fell behind the trimmed start, or that read from another incarnation of the log (another
    ``epoch``), gets a snapshot instead: each replica's current hashes. When a replica's process
    token changes (it restarted), a "reset" entry comes first: everything it held is gone.
    """

    def __init__(self, max_log_hashes: int = 2_000_000, clock: Callable[[], float] = time.monotonic,
                 stale_after_s: float = STALE_REPLICA_S) -> None:  # fmt: skip
        self.epoch = uuid.uuid4().hex
        self.stale_after_s = stale_after_s
        self._joins = 0  # replicas (re)joined: a replica dropped as stale that publishes again rejoins
        self.max_log_hashes = max_log_hashes
        self._clock = clock
        self._log: list[Entry] = []
        self._first_seq = 1  # seq of self._log[0]
        self._seq = 0  # seq of the last entry appended
        self._log_hashes = 0
        self._blocks: dict[str, set[int]] = {}  # replica id -> hashes it holds now (for snapshots)
        self._tokens: dict[str, str] = {}
        self._stats: dict[str, tuple[dict, float]] = {}  # replica id -> (stats, received at)
        self._joined: dict[str, int] = {}  # replica id -> its join number
        self._seen: dict[str, float] = {}  # replica id -> when it last published
        # admin control: replicas told to take nothing new, and commands each replica takes with
        # its next publish and answers (acks) with the one after
        self._draining: set[str] = set()
        self._commands: dict[str, list[dict]] = {}
        self._results: dict[str, tuple[Any, float]] = {}  # command id -> (its result, when)
        self._next_command = 0

    def _append(self, replica_id: str, kind: str, hashes: list[int]) -> None:
        self._seq += 1
        self._log.append([self._seq, replica_id, kind, hashes])
        self._log_hashes += len(hashes) + 1
        if self._log_hashes > self.max_log_hashes:
            # Trim to 3/4 of the cap at once so that trimming is amortized O(1) per entry.
            cut, dropped = 0, 0
            while self._log_hashes - dropped > self.max_log_hashes * 3 // 4 and cut < len(self._log) - 1:
                dropped += len(self._log[cut][3]) + 1
                cut += 1
            del self._log[:cut]
            self._log_hashes -= dropped
            self._first_seq += cut

    def _reset(self, replica_id: str) -> None:
        self._blocks[replica_id] = set()
        self._append(replica_id, "reset", [])

    def publish(self, replica_id: str, token: str, events: Sequence, stats: dict | None,
                results: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
        """Apply one replica's KV events (in its order), keep its stats as its latest, and take its
        results of the commands it ran since its last publish.

        Returns {"epoch", "draining", "commands"}. "epoch" is this log's epoch and the replica's
        join number, as one string: a replica that sees it change (the actor was lost and made
        afresh, or the replica was dropped as stale and has rejoined) sends everything its cache
        holds again (``AsyncEngine.request_kv_snapshot``). "draining": whether the replica must
        take no new requests. "commands": admin commands for it to run ({"id", "kind", ...}).
        """
        if replica_id not in self._joined:
            self._joins += 1
            self._joined[replica_id] = self._joins
        if self._tokens.get(replica_id) != token:
            if replica_id in self._tokens:
                self._reset(replica_id)
            self._tokens[replica_id] = token
        held = self._blocks.setdefault(replica_id, set())
        for kind, hashes in events:
            hashes = [int(h) for h in hashes]
            if kind == "stored":
                held.update(hashes)
            elif kind == "removed":
                held.difference_update(hashes)
            else:
                raise ValueError(f"unknown KV event kind {kind!r}")
            self._append(replica_id, kind, hashes)
        if stats is not None:
            self._stats[replica_id] = (dict(stats), self._clock())
        now = self._clock()
        self._seen[replica_id] = now
        for command_id, result in (results or {}).items():
            self._results[command_id] = (result, now)
        for command_id in [c for c, (_, at) in self._results.items() if at < now - RESULTS_KEPT_S]:
            del self._results[command_id]
        return {"epoch": f"{self.epoch}/{self._joined[replica_id]}",
                "draining": replica_id in self._draining,
                "commands": self._commands.pop(replica_id, [])}  # fmt: skip

    # -- admin control --

    def send_command(self, replica_id: str, kind: str, args: dict[str, Any] | None = None) -> str | None:
        """Queue a command for a live replica ("reset_prefix_cache", "abort" with request_id);
        returns its id (see ``command_result``), or None when no such replica publishes."""
        if replica_id not in self._seen:
            return None
        self._next_command += 1
        command_id = f"{self.epoch[:8]}-{self._next_command}"
        self._commands.setdefault(replica_id, []).append({"id": command_id, "kind": kind, **(args or {})})
        return command_id

    def command_result(self, command_id: str) -> dict[str, Any]:
        """{"done": bool, "result": what the replica answered} for a command sent earlier."""
        if command_id in self._results:
            return {"done": True, "result": self._results[command_id][0]}
        return {"done": False, "result": None}

    def set_draining(self, replica_id: str, draining: bool) -> bool:
        """Mark a live replica draining (it finishes what it has and takes nothing new) or not;
        False when no such replica publishes."""
        if replica_id not in self._seen:
            return False
        if draining:
            self._draining.add(replica_id)
        else:
            self._draining.discard(replica_id)
        return True

    def drop(self, replica_id: str) -> None:
        """Forget a replica that is gone: readers drop it and its blocks, stats no longer list it."""
        if self._blocks.pop(replica_id, None) is not None:
            self._append(replica_id, "drop", [])
        self._tokens.pop(replica_id, None)
        self._stats.pop(replica_id, None)
        self._joined.pop(replica_id, None)
        self._seen.pop(replica_id, None)
        self._draining.discard(replica_id)
        self._commands.pop(replica_id, None)

    def drop_stale(self) -> list[str]:
        """Drop every replica that has not published for ``stale_after_s``; returns their ids."""
        cutoff = self._clock() - self.stale_after_s
        stale = [rid for rid, at in self._seen.items() if at < cutoff]
        for rid in stale:
            self.drop(rid)
        return stale

    def poll(self, since: int, epoch: str | None = None) -> dict[str, Any]:
        """Entries after ``since`` (or a snapshot), the latest stats, and how old each stats dict is.

        Returns {"epoch", "seq", "entries": [...]} or {"epoch", "seq", "snapshot": {replica: [hashes]}},
        both with "stats": {replica: dict} and "stats_age_s": {replica: seconds}.
        """
        self.drop_stale()
        now = self._clock()
        out: dict[str, Any] = {
            "epoch": self.epoch,
            "seq": self._seq,
            "draining": sorted(self._draining),
            "stats": {rid: s for rid, (s, _) in self._stats.items()},
            "stats_age_s": {rid: now - t for rid, (_, t) in self._stats.items()},
        }
        if epoch != self.epoch or since + 1 < self._first_seq or since > self._seq:
            out["snapshot"] = {rid: list(held) for rid, held in self._blocks.items()}
        else:
            out["entries"] = self._log[since + 1 - self._first_seq :]
        return out

    def cluster_stats(self) -> dict[str, dict]:
        """Each live replica's last published stats."""
        self.drop_stale()
        return {rid: s for rid, (s, _) in self._stats.items()}

    def replica_view(self) -> dict[str, dict]:
        """Each live replica's last stats with "stats_age_s" (seconds since it published them)
        and "drain_requested" (the admin's mark; the stats' own "draining" says the replica has
        heard it) added: the admin dashboard's view."""
        self.drop_stale()
        now = self._clock()
        return {rid: {**s, "stats_age_s": now - at, "drain_requested": rid in self._draining}
                for rid, (s, at) in self._stats.items()}  # fmt: skip


@ray.remote(num_cpus=0)
class ReplicaStateActor(ReplicaStateLog):
    """The one named ReplicaStateLog of a cluster (get-or-create; see ``state_actor``)."""


# ---- client side (one handle per process) --------------------------------------------------

# Identifies this process to the log: a replica whose token changes has restarted.
_PROCESS_TOKEN = uuid.uuid4().hex
_actor: Any = None
_actor_lock = threading.Lock()


def state_actor() -> Any:
    """The named state actor, created on first use (detached, namespace "pagedserve").

    When a Serve controller runs, the actor is registered with it so that ``serve.shutdown()``
    kills it, as Ray's own prefix-tree actor is.
    """
    global _actor
    with _actor_lock:
        if _actor is None:
            # On the head node: the one node whose loss ends the cluster anyway. Elsewhere, losing
            # that node would blind the routers and the admin API until Ray declared it dead.
            _actor = ReplicaStateActor.options(
                name=STATE_ACTOR_NAME, namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
                resources={"node:__internal_head__": 0.001},
            ).remote()  # fmt: skip
            _register_for_serve_shutdown(_actor)
        return _actor


def _register_for_serve_shutdown(actor: Any) -> None:
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:  # no Serve controller (a benchmark or test outside Serve)
        return
    controller._register_shutdown_cleanup_actor.remote(actor)  # fire and forget: no blocking wait


async def _call(method: str, *args: Any) -> Any:
    global _actor
    for attempt in (0, 1):
        actor = state_actor()
        try:
            return await getattr(actor, method).remote(*args)
        except ray.exceptions.RayActorError:
            # serve.shutdown() killed it, or its node died: make a fresh one once.
            with _actor_lock:
                if _actor is actor:
                    _actor = None
            if attempt:
                raise
    raise AssertionError("unreachable")


async def publish_replica_state(replica_id: str, events: list, stats: dict,
                                results: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """Send one replica's KV events since its last call (in order), its current stats and the
    results of the admin commands it ran; returns ``ReplicaStateLog.publish``'s reply (a new epoch
    means the log was lost: resend the whole cache).

    ``events`` is ``BlockManager.take_events()`` / ``AsyncEngine.take_kv_events()``:
    [("stored" | "removed", [block hashes]), ...]; ``stats`` a plain dict with at least
    "num_running", "num_waiting", "kv_cache_usage". Call at least once a second from each replica with
    ``serve.get_replica_context().replica_id.unique_id`` as ``replica_id``.
    """
    plain = [[kind, [int(h) for h in hashes]] for kind, hashes in events]
    return await _call("publish", replica_id, _PROCESS_TOKEN, plain, stats, results)


async def cluster_stats() -> dict[str, dict]:
    """replica_id -> the stats dict that replica published last (replicas not dropped)."""
    return await _call("cluster_stats")


async def replica_view() -> dict[str, dict]:
    """``ReplicaStateLog.replica_view``: each live replica's stats, their age and drain mark."""
    return await _call("replica_view")


async def drop_replica(replica_id: str) -> None:
    """Forget a replica that is shutting down: routers stop counting its cache."""
    await _call("drop", replica_id)


async def send_command(replica_id: str, kind: str, args: dict[str, Any] | None = None) -> str | None:
    """Queue an admin command for a replica (``ReplicaStateLog.send_command``)."""
    return await _call("send_command", replica_id, kind, args)


async def command_result(command_id: str) -> dict[str, Any]:
    return await _call("command_result", command_id)


async def set_draining(replica_id: str, draining: bool) -> bool:
    return await _call("set_draining", replica_id, draining)


async def poll_replica_state(since: int, epoch: str | None) -> dict[str, Any]:
    """The log after ``since`` (see ``ReplicaStateLog.poll``); used by the routers' sync task."""
    return await _call("poll", since, epoch)


# ---- decision counters (per process) --------------------------------------------------------

_decisions: Counter[tuple[str, str]] = Counter()
_routed: Counter[tuple[str, str, str]] = Counter()
_decisions_lock = threading.Lock()  # routers may run on their own event-loop thread


def record_decision(policy: str, outcome: str) -> None:
    """Count one routing decision of ``policy`` that ended in ``outcome``."""
    with _decisions_lock:
        _decisions[(policy, outcome)] += 1


def record_routed(policy: str, outcome: str, replica_id: str) -> None:
    """Count one request placed on ``replica_id`` by a decision of ``policy`` that ended in
    ``outcome`` (Serve may place it on another replica than the policy's first choice)."""
    with _decisions_lock:
        _routed[(policy, outcome, replica_id)] += 1


def routed_counts() -> dict[tuple[str, str, str], int]:
    """Cumulative requests placed in this process: (policy, outcome, replica id) -> count."""
    with _decisions_lock:
        return dict(_routed)


def decision_counts() -> dict[tuple[str, str], int]:
    """Cumulative routing decisions in this process: (policy, outcome) -> count."""
    with _decisions_lock:
        return dict(_decisions)
