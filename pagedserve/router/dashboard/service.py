"""The admin dashboard's data and actions, in the ingress process.

Everything comes from where it is kept: Ray's nodes from the GCS (``ray.nodes()``) with each
node's host and GPU figures from a small probe actor pinned to it; the engine replicas' figures,
block maps and requests in flight from the cluster state actor (``router/state.py``), where each
replica publishes them every 0.25 s while busy, every second idle; the routing decisions from this
process's request router (the handle's router runs here). Actions go to a replica through the
state actor's command queue (it runs them between two engine steps and answers with its next
publish) or set its drain mark.
A sampler keeps the last minutes of each replica's figures for the charts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

import ray

from pagedserve.router import state
from pagedserve.router.protocol import OpenAIError

logger = logging.getLogger(__name__)

HISTORY_WINDOW_S = 600.0  # the charts' span
SAMPLE_PERIOD_S = 2.0
PROBE_TIMEOUT_S = 1.5
COMMAND_TIMEOUT_S = 10.0
COMMAND_POLL_S = 0.05
SERIES = ("output_tokens_per_s", "ttft_p50_s", "ttft_p95_s", "itl_p50_s", "itl_p95_s", "num_running",
          "num_waiting")  # fmt: skip
# the replica figures the dashboard lists (the stats carry more)
REPLICA_FIELDS = (
    "node_id", "pid", "draining", "drain_requested", "ranks", "num_running", "num_waiting",
    "num_swapped", "kv_cache_usage", "num_blocks", "free_blocks", "cached_blocks",
    "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "generation_tokens",
    "prompt_tokens", "output_tokens_per_s", "ttft_p50_s", "ttft_p95_s", "itl_p50_s", "itl_p95_s",
    "block_map", "num_group_restarts", "stats_age_s",
)  # fmt: skip


@ray.remote(num_cpus=0, max_restarts=0)
class NodeProbe:
    """Pinned to one Ray node: that host's CPU, memory and GPU figures (``telemetry.node_figures``)."""

    def __init__(self) -> None:
        from pagedserve.router.telemetry import node_figures

        node_figures()  # the first CPU reading starts psutil's interval

    def figures(self) -> dict[str, Any]:
        from pagedserve.router.telemetry import node_figures

        return node_figures()


def not_found(what: str) -> OpenAIError:
    return OpenAIError(404, what, code="not_found")


class DashboardService:
    """The dashboard's JSON (``overview``, ``history``) and its admin actions."""

    def __init__(self, model_name: str, routing: str, *, probe_nodes: bool = True,
                 history_window_s: float = HISTORY_WINDOW_S,
                 sample_period_s: float = SAMPLE_PERIOD_S) -> None:  # fmt: skip
        self.model_name, self.routing = model_name, routing
        self.probe_nodes = probe_nodes
        self.history_window_s, self.sample_period_s = history_window_s, sample_period_s
        points = int(history_window_s / sample_period_s) + 1
        self._points = points
        self._history: dict[str, dict[str, deque]] = {}
        self._probes: dict[str, Any] = {}  # node id -> its NodeProbe
        self._figures: dict[str, dict[str, Any]] = {}  # node id -> its probe's last figures
        self._sampler: asyncio.Task | None = None

    # ---- background sampling ---------------------------------------------------------------

    def start(self) -> None:
        """Start the sampler on the running event loop (idempotent)."""
        if self._sampler is None or self._sampler.done():
            self._sampler = asyncio.get_running_loop().create_task(self._sample_forever())

    async def _sample_forever(self) -> None:
        failures = 0
        while True:
            try:
                await self.sample()
                failures = 0
            except Exception:
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    logger.warning("dashboard sampling failed %d times", failures, exc_info=True)
            await asyncio.sleep(self.sample_period_s)

    async def sample(self) -> None:
        """One point of every replica's history, and fresh node figures."""
        view = await state.replica_view()
        now = time.time()
        for rid, stats in view.items():
            series = self._history.get(rid)
            if series is None:
                series = self._history[rid] = {name: deque(maxlen=self._points) for name in ("t", *SERIES)}
            series["t"].append(round(now, 3))
            for name in SERIES:
                series[name].append(stats.get(name))
        gone = [rid for rid, series in self._history.items() if series["t"][-1] < now - self.history_window_s]
        for rid in gone:
            del self._history[rid]
        if self.probe_nodes:
            await self._probe(await asyncio.to_thread(ray.nodes))

    async def _probe(self, nodes: list[dict[str, Any]]) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        alive = {n["NodeID"] for n in nodes if n.get("Alive")}
        for node_id in list(self._probes):
            if node_id not in alive:
                ray.kill(self._probes.pop(node_id), no_restart=True)
                self._figures.pop(node_id, None)
        for node_id in alive - set(self._probes):
            self._probes[node_id] = NodeProbe.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote()  # fmt: skip

        async def ask(node_id: str, probe: Any) -> None:
            try:
                self._figures[node_id] = await asyncio.wait_for(probe.figures.remote(), PROBE_TIMEOUT_S)
            except Exception:  # starting (a worker process on that node) or its node just died
                self._figures.pop(node_id, None)

        await asyncio.gather(*(ask(node_id, probe) for node_id, probe in list(self._probes.items())))

    def close(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
        for probe in self._probes.values():
            ray.kill(probe, no_restart=True)
        self._probes.clear()

    # ---- views -----------------------------------------------------------------------------

    async def nodes(self, replicas: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """Ray's nodes (alive and dead), with their probe's host and GPU figures and replicas."""
        if replicas is None:
            replicas = await self.replicas()
        on_node: dict[str, list[str]] = {}
        for r in replicas:
            on_node.setdefault(r.get("node_id") or "", []).append(r["replica_id"])
        out = []
        for n in await asyncio.to_thread(ray.nodes):
            node_id = n["NodeID"]
            resources = {k: v for k, v in n.get("Resources", {}).items() if not k.startswith("node:")}
            figures = self._figures.get(node_id, {}) if n.get("Alive") else {}
            out.append({
                "node_id": node_id, "alive": bool(n.get("Alive")),
                "is_head": "node:__internal_head__" in n.get("Resources", {}),
                "address": n.get("NodeManagerAddress"), "cpus": resources.get("CPU", 0.0),
                "gpus": resources.get("GPU", 0.0), "memory_bytes": resources.get("memory", 0.0),
                "resources": resources, "host": figures.get("host"),
                "gpu_devices": figures.get("gpu_devices", []), "replicas": sorted(on_node.get(node_id, [])),
            })  # fmt: skip
        out.sort(key=lambda n: (not n["is_head"], not n["alive"], n["node_id"]))
        return out

    async def replicas(self) -> list[dict[str, Any]]:
        """Each live engine replica's figures, block map and load."""
        view = await state.replica_view()
        out = []
        for rid, stats in sorted(view.items()):
            entry = {"replica_id": rid, **{k: stats.get(k) for k in REPLICA_FIELDS}}
            queries = stats.get("prefix_cache_queries") or 0
            entry["prefix_hit_rate"] = (stats.get("prefix_cache_hits") or 0) / queries if queries else None
            entry["ranks"] = entry["ranks"] or []
            entry["requests"] = [{**r, "replica_id": rid} for r in stats.get("requests") or []]
            out.append(entry)
        return out

    def router(self) -> dict[str, Any]:
        """This process's routing decisions by replica and outcome."""
        decisions = [{"policy": policy, "outcome": outcome, "replica_id": rid, "count": count}
                     for (policy, outcome, rid), count in sorted(state.routed_counts().items())]  # fmt: skip
        return {"policy": self.routing, "decisions": decisions}

    async def overview(self) -> dict[str, Any]:
        """Everything the page shows, in one reply (see the dashboard's JSON contract)."""
        replicas = await self.replicas()
        requests = [r for replica in replicas for r in replica.pop("requests")]
        requests.sort(key=lambda r: -r.get("age_s", 0))
        return {
            "time": time.time(), "model": self.model_name, "routing": self.routing,
            "nodes": await self.nodes(replicas), "replicas": replicas, "router": self.router(),
            "requests": requests,
        }  # fmt: skip

    def history(self) -> dict[str, Any]:
        return {
            "window_s": self.history_window_s, "period_s": self.sample_period_s,
            "replicas": {rid: {name: list(values) for name, values in series.items()}
                         for rid, series in self._history.items()},
        }  # fmt: skip

    # ---- actions ---------------------------------------------------------------------------

    async def _command(self, replica_id: str, kind: str,
                       args: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
        command_id = await state.send_command(replica_id, kind, args)
        if command_id is None:
            raise not_found(f"no engine replica {replica_id!r}")
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while time.monotonic() < deadline:
            reply = await state.command_result(command_id)
            if reply["done"]:
                return reply["result"]
            await asyncio.sleep(COMMAND_POLL_S)
        raise OpenAIError(504, f"engine replica {replica_id!r} did not answer within {COMMAND_TIMEOUT_S:g} s",
                          code="replica_timeout")  # fmt: skip

    async def reset_prefix_cache(self, replica_id: str) -> dict[str, Any]:
        result = await self._command(replica_id, "reset_prefix_cache")
        if not result.get("ok"):
            raise OpenAIError(500, result.get("error", "reset failed"), code="internal_error")
        return {"replica_id": replica_id, "dropped_blocks": result["dropped_blocks"]}

    async def set_draining(self, replica_id: str, draining: bool) -> dict[str, Any]:
        if not await state.set_draining(replica_id, draining):
            raise not_found(f"no engine replica {replica_id!r}")
        return {"replica_id": replica_id, "draining": draining}

    async def abort(self, request_id: str) -> dict[str, Any]:
        """Abort a request in flight wherever it runs; its stream ends with finish_reason "abort".

        The replica listing it is asked first; when none lists it (a listing is up to
        a second old), every replica is asked, and whichever runs it aborts it.
        """
        listed = await self.replicas()
        holders = [r["replica_id"] for r in listed
                   if any(q["request_id"] == request_id for q in r["requests"])]  # fmt: skip
        others = [r["replica_id"] for r in listed if r["replica_id"] not in holders]
        for group in (holders, others):
            asks = [self._command(rid, "abort", {"request_id": request_id}) for rid in group]
            results = await asyncio.gather(*asks, return_exceptions=True)
            for rid, result in zip(group, results):
                if isinstance(result, dict) and result.get("ok"):
                    return {"request_id": request_id, "replica_id": rid, "aborted": True}
        raise not_found(f"no request {request_id!r} in flight")
