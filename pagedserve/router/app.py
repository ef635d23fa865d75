"""The Ray Serve application: an OpenAI ingress in front of engine replicas.

``OpenAIIngress`` (one replica, FastAPI) tokenizes, hashes the prompt's blocks and calls
``EngineDeployment`` through a DeploymentHandle; the request router picks the replica (prefix
locality + load, or Ray's pow2, or round robin: ``--routing``). Each ``EngineDeployment`` replica
holds one ``AsyncEngine`` in its process and publishes its KV events and load figures to the
cluster state every ~100 ms, where the routers and /metrics read them.

Admission control, so that overload is a 503 with Retry-After and never memory growth: a replica
takes at most max_num_seqs + max_waiting_requests requests at once (``max_ongoing_requests``) and
rejects a request while its engine already has max_waiting_requests waiting (the KV pool, not the
batch size, is what limits it); the ingress's handle queues at most max_waiting_requests per
replica beyond that (``max_queued_requests``) and rejects the rest.

``build_app(ServeConfig)`` is the Python entry; ``app_builder`` takes the same options as a flat
dict for ``serve run`` / ``serve deploy`` config files (deploy/serve_config.yaml).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing, suppress
from dataclasses import fields
from typing import Any

import ray
from fastapi import FastAPI
from ray import serve
from ray.exceptions import RayActorError
from ray.serve import Application
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from pagedserve.cluster.executor import cpus_per_rank
from pagedserve.config import ConfigError, EngineConfig, ServeConfig
from pagedserve.router.api import Limits, ModelInfo, build_api
from pagedserve.router.metrics import IngressMetrics
from pagedserve.router.protocol import RETRY_AFTER_S, OpenAIError, overloaded
from pagedserve.router.telemetry import LatencyWindow, RateWindow, block_map

logger = logging.getLogger(__name__)

APP_NAME = "pagedserve"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the name the engine gives model=None
# A replica publishes its KV events and figures to the state actor every PUBLISH_PERIOD_S while it
# has requests in flight (and once more after its last one ends), else every PUBLISH_IDLE_S, and
# at once when a request arrives at an idle replica. Each publish (and each router's poll of it) is
# a Ray actor call of ~4 ms of CPU over three processes, on the cores the engine's threads run on:
# on 2 vCPUs (AMX Xeon, SmolLM2 bf16) the idle server's 0.1 s publishes and 0.05 s polls took 30%
# of a core, and a 256-token prefill on two threads took 127 ms beside it against 78 alone (the
# step waits at every barrier for the thread that was preempted); at 1 s each 101 ms.
PUBLISH_PERIOD_S = 0.25
PUBLISH_IDLE_S = 1.0
RESEND_ROUNDS = 4  # short rounds after a new state actor asked for the whole cache (the engine's
# snapshot of its blocks comes back between two of its steps)
COMPACT_EVENTS_AT = 10_000  # unpublished KV events (the state actor is unreachable) before compacting
BLOCK_MAP_PERIOD_S = 1.0  # between two block maps the dashboard draws
BLOCK_MAP_WAIT_S = 0.5  # the longest a publish waits for the engine loop to draw its block map
MAX_LISTED_REQUESTS = 200  # requests in flight a replica lists for the dashboard
ROUTING_STATS_PERIOD_S = 0.5
HEALTH_TIMEOUT_S = 10.0
# Replies of a replica that refused a request which streamed nothing yet: their error code -> how
# often the request is sent again (a lost tensor-parallel rank: once; a draining replica: until
# the routers hear of the drain, within two seconds: PUBLISH_IDLE_S, then a router's idle poll)
RETRIES_ON_REFUSAL = {"engine_restarting": 1, "replica_draining": 20}
DRAIN_RETRY_BACKOFF_S = 0.1
# A request whose replica died (process killed, node lost) before it streamed anything is sent
# again, after a pause that lets Serve's routers learn the replica is gone.
RETRIES_ON_REPLICA_LOSS = 3
REPLICA_LOSS_BACKOFF_S = 0.5
# Fractional CPUs: two engine replicas and the ingress fit on a 2-core machine. The engine's
# torch threads are sized separately (see build_app), from the cores there are.
ENGINE_NUM_CPUS = 0.5
ENGINE_TP_NUM_CPUS = 0.1  # a tensor-parallel replica only schedules; its ranks hold the cores
INGRESS_NUM_CPUS = 0.1
HEAD_RESOURCE = "node:__internal_head__"  # Ray's resource of the head node (1.0 there, none elsewhere)
HEAD_SHARE = 0.001


def served_model_name(config: EngineConfig) -> str:
    """The model id clients send: --served-model-name, else --model, else the default model's name."""
    return config.model.served_model_name or config.model.model or DEFAULT_MODEL_NAME


def compact_kv_events(events: list[tuple[str, list[int]]]) -> list[tuple[str, list[int]]]:
    """The same effect in at most two events: each hash ends as its last event left it.

    Applying the result to any state gives what applying ``events`` in order gives, so a replica
    that cannot publish for a while keeps one entry per block hash, not its whole history.
    """
    last: dict[int, str] = {}
    for kind, hashes in events:
        for h in hashes:
            last[h] = kind
    removed = [h for h, kind in last.items() if kind == "removed"]
    stored = [h for h, kind in last.items() if kind == "stored"]
    return [(kind, hashes) for kind, hashes in (("removed", removed), ("stored", stored)) if hashes]


@serve.deployment
class EngineDeployment:
    """One engine replica: an EngineProcess (the engine in a child process) or, for a tensor-parallel
    group or --no-engine-process, an AsyncEngine in this process; streamed to the ingress as deltas."""

    async def __init__(self, engine_flags: dict[str, Any], max_waiting_requests: int, torch_threads: int,
                       engine_process: bool = True) -> None:  # fmt: skip
        config = EngineConfig.from_flags(**engine_flags)
        if engine_process and not config.parallel.uses_ray:
            from pagedserve.cluster.engine_process import EngineProcess

            # the scheduler and model in a process of their own: no GIL shared with Serve's loops
            self.engine: Any = await EngineProcess.start(engine_flags, torch_threads=torch_threads)
        else:  # a tensor-parallel group's ranks are processes already: the loop stays in a thread
            import torch

            from pagedserve.cluster.engine import AsyncEngine

            torch.set_num_threads(torch_threads)
            self.engine = await asyncio.to_thread(AsyncEngine, config)
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.max_waiting_requests = max_waiting_requests
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._node_id = ray.get_runtime_context().get_node_id()
        self._inflight = 0
        self._unpublished: list = []
        self._state_epoch: str | None = None  # of the cluster state log we publish to
        # for the admin dashboard: requests in flight, latency windows, drain mark, command results
        self._requests: dict[str, dict[str, Any]] = {}
        self._ttft, self._itl = LatencyWindow(), LatencyWindow()
        self._output_rate = RateWindow()
        self._draining = False
        self._results: dict[str, Any] = {}
        self._commands: set[asyncio.Task] = set()  # admin commands running
        self._block_map: dict[str, Any] | None = None
        self._wake = asyncio.Event()  # a request arrived: publish now, not at the next idle beat
        self._publisher = asyncio.get_running_loop().create_task(self._publish_forever())

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream one request's deltas (``protocol.OutputDeltas``), or yield one {"error": ...} dict.

        ``request`` is the ingress's dict: request_id, prompt_token_ids, params
        (SamplingParams.to_dict()), block_hashes, session_id, priority, cache_salt. Cancelling the
        call (the client left) aborts the request and frees its blocks.
        """
        from pagedserve.cluster.block_manager import RequestTooLong
        from pagedserve.cluster.engine import InvalidPrompt
        from pagedserve.cluster.engine_process import EngineProcessDied
        from pagedserve.cluster.executor import RankFailure
        from pagedserve.sampling import SamplingParams, SamplingParamsError

        if self._draining:  # the router had not heard yet: the ingress sends it elsewhere
            yield OpenAIError(503, f"engine replica {self.replica_id} is draining", code="replica_draining",
                              headers={"Retry-After": str(RETRY_AFTER_S)}).to_dict()  # fmt: skip
            return
        if self._num_waiting() >= self.max_waiting_requests:
            yield overloaded(f"engine replica {self.replica_id} has {self.max_waiting_requests} requests "
                             "waiting; retry later").to_dict()  # fmt: skip
            return
        self._inflight += 1
        self._wake.set()
        request_id = request["request_id"]
        started = time.monotonic()
        seen = {"prompt_tokens": len(request["prompt_token_ids"]), "output_tokens": 0,
                "started": time.time()}  # fmt: skip
        self._requests[request_id] = seen
        last = started
        try:
            params = SamplingParams.from_dict(request["params"])
            outputs = self.engine.generate_deltas(
                {"prompt_token_ids": request["prompt_token_ids"]}, params, request_id,
                priority=request.get("priority", 0), cache_salt=request.get("cache_salt"),
            )  # fmt: skip
            async with aclosing(outputs):
                async for delta in outputs:
                    new_tokens = sum(len(o["token_ids"]) for o in delta["outputs"])
                    if new_tokens:
                        now = time.monotonic()
                        if seen["output_tokens"] == 0:
                            self._ttft.add(now - started, now)
                        else:  # the gap, per token when one delta carries several
                            self._itl.add((now - last) / new_tokens, now)
                        seen["output_tokens"], last = seen["output_tokens"] + new_tokens, now
                    yield delta
        except SamplingParamsError as exc:
            yield OpenAIError(400, str(exc), param=exc.param).to_dict()
        except (InvalidPrompt, RequestTooLong) as exc:
            yield OpenAIError(400, str(exc), param="prompt").to_dict()
        # A lost rank: the replica rebuilds its group and serves the next requests. A dead engine
        # process: the health check fails next and Serve replaces this replica.
        except (RankFailure, EngineProcessDied) as exc:
            yield OpenAIError(
                503, f"engine replica {self.replica_id}: {exc}", code="engine_restarting",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ).to_dict()  # fmt: skip
        except Exception as exc:  # a failed step fails its requests, never the replica
            logger.exception("request %s failed", request.get("request_id"))
            yield OpenAIError(500, f"engine error: {exc}", code="internal_error").to_dict()
        finally:
            self._inflight -= 1
            self._requests.pop(request_id, None)

    def _num_waiting(self) -> int:
        # The engine's figure is as of its last step; requests sent since then wait too.
        stats = self.engine.stats()
        return max(stats.num_waiting, self._inflight - self.max_num_seqs)

    async def record_routing_stats(self) -> dict[str, Any]:
        """Serve's per-replica routing stats (RunningReplica.routing_stats in the router)."""
        stats = self.engine.stats()
        # a replica whose engine died is passed over until Serve replaces it (check_health)
        draining = self._draining or self.engine.failure is not None
        return {"num_running": stats.num_running, "num_waiting": stats.num_waiting,
                "kv_cache_usage": stats.kv_cache_usage, "draining": draining}  # fmt: skip

    def check_health(self) -> None:
        """Serve's periodic health check: a replica whose engine is gone gets replaced."""
        if self.engine.failure is not None:
            raise RuntimeError(self.engine.failure)

    async def health(self) -> dict[str, Any]:
        """This replica's load, for the ingress's /health (proves a replica answers)."""
        return await self.record_routing_stats()

    def _stats_dict(self) -> dict[str, Any]:
        s = self.engine.stats()
        return {
            "num_running": s.num_running, "num_waiting": s.num_waiting, "kv_cache_usage": s.kv_cache_usage,
            "prefix_cache_queries": s.prefix_cache_queries, "prefix_cache_hits": s.prefix_cache_hits,
            "num_preemptions": s.num_preemptions, "prompt_tokens": s.prompt_tokens,
            "generation_tokens": s.generation_tokens, "num_blocks": s.num_blocks,
            "free_blocks": s.free_blocks, "cached_blocks": s.cached_blocks,
            "num_group_restarts": s.num_group_restarts, "beam_blocks_physical": s.beam_blocks_physical,
            "beam_blocks_logical": s.beam_blocks_logical,
            "beam_block_steps_physical": s.beam_block_steps_physical,
            "beam_block_steps_logical": s.beam_block_steps_logical, "num_steps": s.num_steps,
            **{f"step_{phase}_s": seconds for phase, seconds in s.step_time.items()},
            "node_id": self._node_id, "pid": os.getpid(),  # where it runs, for operators and tests
            **self._dashboard_stats(s),
        }  # fmt: skip

    def _dashboard_stats(self, s: Any) -> dict[str, Any]:
        """What the admin dashboard shows beyond the routers' figures (see router/dashboard)."""
        now = time.monotonic()
        ttft, itl = self._ttft.percentiles(now=now), self._itl.percentiles(now=now)
        wall = time.time()
        requests = [
            {"request_id": rid, "prompt_tokens": r["prompt_tokens"], "output_tokens": r["output_tokens"],
             "age_s": round(wall - r["started"], 3)}
            for rid, r in list(self._requests.items())[:MAX_LISTED_REQUESTS]
        ]  # fmt: skip
        executor = getattr(getattr(self.engine, "engine", None), "executor", None)  # a thread's engine
        ranks = [{"rank": rank, "node_id": node, "pid": pid}
                 for rank, (node, pid) in enumerate(zip(getattr(executor, "node_ids", []),
                                                        getattr(executor, "pids", [])))]  # fmt: skip
        return {
            "num_swapped": s.num_swapped, "block_size": s.block_size, "draining": self._draining,
            "output_tokens_per_s": self._output_rate.rate(s.generation_tokens, now),
            "ttft_p50_s": ttft[0], "ttft_p95_s": ttft[1], "itl_p50_s": itl[0], "itl_p95_s": itl[1],
            "requests": requests, "num_requests": len(self._requests), "ranks": ranks,
            "block_map": self._block_map,
        }  # fmt: skip

    async def _run_command(self, command: dict[str, Any]) -> None:
        """One admin command from the state actor; its result goes back with the next publish."""
        try:
            result = await self._command_result(command)
        except Exception as exc:
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        self._results[command["id"]] = result
        self._wake.set()

    async def _command_result(self, command: dict[str, Any]) -> dict[str, Any]:
        kind = command.get("kind")
        if kind == "reset_prefix_cache":
            dropped = await self.engine.reset_prefix_cache()
            logger.info("admin: prefix cache reset, %d cached blocks dropped", dropped)
            return {"ok": True, "dropped_blocks": dropped}
        if kind == "abort":
            request_id = str(command.get("request_id"))
            if request_id not in self._requests:
                return {"ok": False, "error": f"no request {request_id!r} in flight on this replica"}
            self.engine.abort(request_id)
            logger.info("admin: request %s aborted", request_id)
            return {"ok": True, "aborted": True}
        return {"ok": False, "error": f"unknown command {kind!r}"}

    async def _publish_forever(self) -> None:
        from pagedserve.router.state import publish_replica_state

        failures = 0
        mapped_at = -math.inf
        was_busy, resending = False, 0
        while True:
            self._wake.clear()
            busy = self._inflight > 0 or bool(self._commands)
            if time.monotonic() - mapped_at >= BLOCK_MAP_PERIOD_S:
                mapped_at = time.monotonic()
                try:  # read between two steps; a long step or a rebuilding group must not stall us
                    self._block_map = block_map(await asyncio.wait_for(self.engine.block_states(),
                                                                       BLOCK_MAP_WAIT_S))  # fmt: skip
                except Exception:  # the map comes next time
                    logger.debug("block map unavailable", exc_info=True)
            # Events stay queued until a publish succeeds: the routers' view of this cache must
            # not silently miss a stored or removed block.
            self._unpublished.extend(self.engine.take_kv_events())
            if len(self._unpublished) > COMPACT_EVENTS_AT:
                self._unpublished = compact_kv_events(self._unpublished)
            try:
                results = dict(self._results)
                reply = await publish_replica_state(self.replica_id, self._unpublished, self._stats_dict(),
                                                    results)  # fmt: skip
                self._unpublished = []
                for command_id in results:  # answered; results that came in meanwhile go next time
                    self._results.pop(command_id, None)
                failures = 0
                epoch = reply["epoch"]
                if reply["draining"] != self._draining:
                    logger.info("admin: replica %s", "draining" if reply["draining"] else "undrained")
                    self._draining = reply["draining"]
                for command in reply["commands"]:  # run beside this loop, which must keep publishing
                    task = asyncio.get_running_loop().create_task(self._run_command(command))
                    self._commands.add(task)
                    task.add_done_callback(self._commands.discard)
                if epoch != self._state_epoch:
                    if self._state_epoch is not None:
                        # the state actor was lost and made afresh: it knows none of our blocks
                        logger.warning("cluster state actor restarted; resending this replica's cache")
                        self.engine.request_kv_snapshot()
                        resending = RESEND_ROUNDS  # out within a few short rounds, not idle beats
                    self._state_epoch = epoch
            except Exception:
                failures += 1
                if failures == 1 or failures % 100 == 0:
                    logger.exception("publishing replica state failed %d times; retrying", failures)
            # busy, or idle since this round (the engine's figures lag the replica's own count by
            # a step: the next publish has the last request's end for sure): the short period;
            # idle, the long one, cut short by a request or a command's result
            if busy or was_busy or self._results or failures or resending:
                resending = max(0, resending - 1)
                await asyncio.sleep(PUBLISH_PERIOD_S)
            else:
                with suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), PUBLISH_IDLE_S)
            was_busy = busy

    async def __del__(self) -> None:
        from pagedserve.router.state import drop_replica

        if not hasattr(self, "_publisher"):  # stopped inside its constructor: nothing published yet
            if hasattr(self, "engine"):
                await asyncio.to_thread(self.engine.shutdown)
            return
        self._publisher.cancel()
        try:
            await drop_replica(self.replica_id)
        except Exception:  # the state actor may be gone already (serve.shutdown)
            logger.warning("could not drop replica %s from the cluster state", self.replica_id)
        await asyncio.to_thread(self.engine.shutdown)


@serve.deployment
@serve.ingress()
class OpenAIIngress:
    """The HTTP entry: the OpenAI API (``router/api.py``) over a handle to the engine replicas."""

    def __init__(self, engine: DeploymentHandle, engine_flags: dict[str, Any], api_key: str | None,
                 limits: dict[str, Any] | None = None, admin_token: str | None = None,
                 routing: str = "prefix") -> None:  # fmt: skip
        from pagedserve.worker.loader import load_config, load_tokenizer, resolve_model

        config = EngineConfig.from_flags(**engine_flags)
        path = resolve_model(config.model.model)
        self.tokenizer = load_tokenizer(config.model.tokenizer or path)
        hf_config = load_config(path)
        # The same figures the engine computes from the same config.
        self.model = ModelInfo(
            name=served_model_name(config), root=str(path),
            max_model_len=config.model.max_model_len or hf_config.max_position_embeddings,
            block_size=config.cache.block_size, vocab_size=hf_config.vocab_size,
        )  # fmt: skip
        self.metrics = IngressMetrics(self.model.name)
        self._engine = engine
        self._streaming = engine.options(stream=True)
        self._api_key = api_key
        self._limits = Limits(**(limits or {}))
        self._admin_token = admin_token
        self.dashboard = None
        if admin_token:
            from pagedserve.router.dashboard import DashboardService

            self.dashboard = DashboardService(self.model.name, routing)
            self.dashboard.start()  # the charts hold the minutes before anyone opens the page

    def __serve_build_asgi_app__(self) -> FastAPI:
        dashboard = (self.dashboard, self._admin_token) if self.dashboard is not None else None
        return build_api(self.model, self.tokenizer, self, self.metrics, api_key=self._api_key,
                         limits=self._limits, dashboard=dashboard)  # fmt: skip

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """EngineClient.generate over the handle; closing early cancels the call on the replica.

        A request whose replica lost a tensor-parallel rank before it streamed anything is sent
        once more (the router may pick another replica; the same one serves it once rebuilt); one
        refused by a draining replica is sent again (the routers pass over it once they hear).
        One whose replica died before it streamed anything is sent again (up to
        RETRIES_ON_REPLICA_LOSS times, to a live replica once Serve has noticed); one that had
        streamed tokens ends with a 503 ``engine_lost`` error (in the stream when it has begun).
        """
        loss_retries = 0
        refusals: dict[str, int] = {}  # error code -> times a replica refused the request so
        while True:
            _own_internal_request_id()
            response = self._streaming.generate.remote(request)
            finished = retry = False
            streamed = False
            try:
                async for delta in response:
                    finished = "error" in delta or delta["finished"]
                    code = delta["error"].get("code") if "error" in delta else None
                    if not streamed and refusals.get(code, 0) < RETRIES_ON_REFUSAL.get(code, 0):
                        refusals[code] = refusals.get(code, 0) + 1
                        retry = True
                        why = delta["error"]["message"]
                        if code == "replica_draining":  # until the routers hear of the drain
                            await asyncio.sleep(DRAIN_RETRY_BACKOFF_S)
                        break
                    streamed = True
                    yield delta
            except (BackPressureError, DeploymentUnavailableError) as exc:
                finished = True
                raise overloaded(f"no engine replica can take the request now: {exc}") from exc
            except RayActorError as exc:  # the replica's process is gone (killed, node lost)
                finished = True
                if streamed or loss_retries >= RETRIES_ON_REPLICA_LOSS:
                    raise OpenAIError(
                        503, "the engine replica serving this request was lost"
                        f"{' after it had streamed output' if streamed else ''}; send it again",
                        code="engine_lost",
                    ) from exc  # fmt: skip
                loss_retries += 1
                retry = True
                why = f"its replica was lost ({type(exc).__name__})"
                await asyncio.sleep(REPLICA_LOSS_BACKOFF_S * loss_retries)
            finally:
                if not finished:
                    response.cancel()
            if not retry:
                return
            logger.warning("request %s: sent again after %s", request.get("request_id"), why)

    async def engine_health(self) -> None:
        try:
            await asyncio.wait_for(self._engine.health.remote(), HEALTH_TIMEOUT_S)
        except Exception as exc:
            raise OpenAIError(503, f"the engine replicas do not answer: {exc}", code="unavailable") from exc

    async def render_metrics(self) -> bytes:
        from pagedserve.router.prefix_router import decision_counts
        from pagedserve.router.state import cluster_stats

        return self.metrics.render(await cluster_stats(), decision_counts())


def _own_internal_request_id() -> None:
    """Give the handle calls of the current task an internal request id of their own.

    Serve copies the HTTP request's internal id into every handle call made while serving it, so
    the engine calls of one request (a batch of prompts) share one id. A request router that
    matches pending requests by that id (Serve's base RequestRouter, without FIFOMixin: the prefix
    and round-robin routers) then routes one call twice and never routes the other. Serve has no
    public API for this; its request context is a frozen dataclass in a contextvar, and the copy
    set here lives only in the calling task's context.
    """
    from ray.serve.context import _get_serve_request_context, _serve_request_context

    context = _get_serve_request_context()
    _serve_request_context.set(dataclasses.replace(context, _internal_request_id=str(uuid.uuid4())))


def _cluster_gpus() -> float:
    return ray.cluster_resources().get("GPU", 0.0) if ray.is_initialized() else 0.0


def engine_resources(cfg: ServeConfig, env: dict[str, str]) -> dict[str, Any]:
    """What one engine replica reserves from Ray: its actor's options and, for a tensor-parallel
    group, its placement group (the replica's bundle, then one bundle per rank).

    Ray's scheduler and autoscaler then account for replicas x ranks devices. On GPUs each rank's
    bundle is {"GPU": 1}; on CPUs each rank gets its share of the cores left by the ingress and
    the replicas' schedulers (the rank's torch threads are sized from it).
    """
    parallel = cfg.engine.parallel
    actor: dict[str, Any] = {"num_cpus": ENGINE_NUM_CPUS, "runtime_env": {"env_vars": env}}
    custom = dict(cfg.replica_resources or {})
    if custom:
        actor["resources"] = custom
    if not parallel.uses_ray:
        return {"ray_actor_options": {**actor, "num_gpus": 1 if _cluster_gpus() > 0 else 0}}
    tp = parallel.tensor_parallel_size
    options: dict[str, Any] = {"ray_actor_options": {**actor, "num_cpus": ENGINE_TP_NUM_CPUS}}
    if _cluster_gpus() > 0:
        rank_bundle = {"GPU": 1.0}
    else:
        other = INGRESS_NUM_CPUS + cfg.num_replicas * ENGINE_TP_NUM_CPUS
        rank_bundle = {"CPU": cpus_per_rank(cfg.num_replicas * tp, other)}
    bundles = [{"CPU": ENGINE_TP_NUM_CPUS, **custom}, *(dict(rank_bundle) for _ in range(tp))]
    options["placement_group_bundles"] = bundles
    options["placement_group_strategy"] = parallel.placement_group_strategy
    return options


def admin_token_of(cfg: ServeConfig) -> str:
    """The admin token: the configured one, else $PAGEDSERVE_ADMIN_TOKEN where the application is
    built, else one made now and logged (``serve deploy``: in the application build's log;
    ``pagedserve serve`` makes and prints its own first)."""
    if not cfg.admin_token:
        cfg.admin_token = os.environ.get("PAGEDSERVE_ADMIN_TOKEN") or None
    if not cfg.admin_token:
        from pagedserve.router.dashboard import new_admin_token

        cfg.admin_token = new_admin_token()
        logger.warning("pagedserve: admin dashboard token (no --admin-token given): %s", cfg.admin_token)
    return cfg.admin_token


def limits_of(cfg: ServeConfig) -> dict[str, Any]:
    """The HTTP front's request limits (api.Limits) from the serve config, as plain values."""
    return {f.name: getattr(cfg, f.name) for f in fields(Limits)}


def cpu_threads_per_replica(num_replicas: int, cpus: int | None = None, reserved: int | None = None) -> int:
    """Torch threads for each CPU engine replica on this node: its share of the cores left after
    ``$PAGEDSERVE_CPU_RESERVED_CORES`` (1 by default) for the serving stack.

    On 2 cores with one replica that is one thread: an OpenMP thread on the core the proxy, the
    ingress and Ray also use is a straggler at the end of every parallel region. Measured served
    (SmolLM2 bf16, a 256-token prompt): the forward pass took 228 ms on two threads against 186
    ms on one, where in a quiet process two threads took 125 ms and one 163 ms.
    """
    cpus = cpus or os.cpu_count() or 1
    if reserved is None:
        reserved = int(os.environ.get("PAGEDSERVE_CPU_RESERVED_CORES", "1"))
    return max(1, (cpus - reserved) // max(1, num_replicas))


# Spins an idle OpenMP thread of an engine makes before it sleeps (GNU OpenMP, torch's; ~25 ns each
# with x86's pause: ~0.25 ms). With none (OMP_WAIT_POLICY=PASSIVE alone) every parallel region of a
# step wakes the other thread through the kernel: on 2 vCPUs of a Sapphire Rapids VM a 256-token
# bf16 prefill took 103 ms on two threads against 95 on one, with 10,000 spins 67-71 ms (3,000:
# 86). In process after 0.3 s idle 30,000 did better (a median 69 against 107 ms), but served
# (make bench-peers, two prefill threads) 10,000 gave TTFT p50 784 / 1086 / 124 ms at c16 /
# shared prefix / c1 against 972 / 1172 / 130 with 30,000: the longer spin takes the core the HTTP
# stack shares. The spinning stops within ~0.25 ms of a step's end; the shell's GOMP_SPINCOUNT,
# where set, wins.
OMP_SPIN_COUNT = "10000"


def engine_env(cfg: ServeConfig, threads: int) -> dict[str, str]:
    """The environment of the engine replicas' processes (`threads`: their torch threads).

    Without GPUs each replica's torch gets its share of this machine's cores (one node), less
    the cores reserved for the HTTP proxy, the ingress and Ray's own processes (vLLM's CPU
    backend reserves one for its API server likewise). OpenMP threads spin only briefly before
    they sleep (GOMP_SPINCOUNT, which wins over OMP_WAIT_POLICY=PASSIVE): long enough to carry
    a step's back-to-back parallel regions, short enough that an idle thread leaves a shared
    core to the HTTP stack at once (see OMP_SPIN_COUNT). The CPU kernels' switches (PAGEDSERVE_CPU_*,
    listed in the README's performance section) set where `pagedserve serve` runs reach the
    engines on every node, and win over the defaults here.
    """
    env = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT", OMP_SPIN_COUNT),
           "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    if not cfg.engine.parallel.uses_ray:  # prefill steps also take the reserved cores (Worker._size_threads)
        env["PAGEDSERVE_CPU_PREFILL_THREADS"] = str(cpu_threads_per_replica(cfg.num_replicas, reserved=0))
    if "PAGEDSERVE_CACHE_DIR" in os.environ:
        env["PAGEDSERVE_CACHE_DIR"] = os.environ["PAGEDSERVE_CACHE_DIR"]
    env.update({k: v for k, v in os.environ.items() if k.startswith("PAGEDSERVE_CPU_")})
    return env


def build_app(serve_config: ServeConfig) -> Application:
    """The Serve application for ``serve_config``: ingress + ``num_replicas`` engine replicas."""
    from pagedserve.router.prefix_router import router_class_for

    cfg = serve_config
    per_replica = cfg.engine.scheduler.max_num_seqs + cfg.max_waiting_requests
    router_options: dict[str, Any] = {"request_routing_stats_period_s": ROUTING_STATS_PERIOD_S}
    router_options["request_router_class"] = router_class_for(cfg.routing)
    parallel = cfg.engine.parallel
    threads = 1 if parallel.uses_ray else cpu_threads_per_replica(cfg.num_replicas)
    env = engine_env(cfg, threads)
    engine = EngineDeployment.options(
        num_replicas=cfg.num_replicas,
        max_ongoing_requests=per_replica,
        max_queued_requests=cfg.max_waiting_requests * cfg.num_replicas,
        request_router_config=RequestRouterConfig(**router_options),
        **engine_resources(cfg, env),
    ).bind(cfg.engine.to_flags(), cfg.max_waiting_requests, threads, cfg.engine_process)
    return OpenAIIngress.options(
        num_replicas=1,
        # Room for every request the engines could hold or reject, so that rejections are ours
        # (OpenAI-shaped 503s), not the proxy's.
        max_ongoing_requests=2 * cfg.num_replicas * per_replica + 64,
        # on the head node, whose loss ends the cluster anyway: losing a worker node then loses
        # engine replicas only, never the front door
        ray_actor_options={"num_cpus": INGRESS_NUM_CPUS, "resources": {HEAD_RESOURCE: HEAD_SHARE},
                           "runtime_env": {"env_vars": env}},  # fmt: skip
    ).bind(engine, cfg.engine.to_flags(), cfg.api_key, limits_of(cfg), admin_token_of(cfg), cfg.routing)


def serve_config_from_flags(flags: dict[str, Any]) -> ServeConfig:
    """A ServeConfig from flat vLLM-named options (ServeConfig's fields and EngineConfig's flags).

    Values may be strings, as ``serve run module:app_builder key=value`` passes them; they are
    converted by the field's type. Unknown names raise ConfigError.
    """
    serve_fields = {f.name: f for f in fields(ServeConfig) if f.name != "engine"}
    engine_types = {f.name: f.type for part in fields(EngineConfig) for f in fields(_part_class(part.type))}
    serve_kwargs: dict[str, Any] = {}
    engine_kwargs: dict[str, Any] = {}
    for key, value in flags.items():
        key = key.replace("-", "_")
        if key in serve_fields:
            serve_kwargs[key] = _coerce(key, serve_fields[key].type, value)
        elif key in engine_types:
            engine_kwargs[key] = _coerce(key, engine_types[key], value)
        else:
            raise ConfigError(f"unknown option {key!r}")
    return ServeConfig(**serve_kwargs, engine=EngineConfig.from_flags(**engine_kwargs))


def _part_class(annotation: Any) -> type:
    import pagedserve.config as config_module

    return getattr(config_module, annotation) if isinstance(annotation, str) else annotation


def _coerce(name: str, annotation: Any, value: Any) -> Any:
    """Convert a string option to its field's type (annotations are strings: "int | None")."""
    if not isinstance(value, str):
        return value
    kinds = {part.strip() for part in str(annotation).split("|")}
    if "None" in kinds and value.lower() in ("none", "null", ""):
        return None
    try:
        if any(kind.startswith("dict") for kind in kinds):
            parsed = json.loads(value)
            if not isinstance(parsed, dict):
                raise ValueError(value)
            return parsed
        if "bool" in kinds:
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(value)
            return value.lower() in ("true", "1", "yes")
        if "int" in kinds:
            return int(value)
        if "float" in kinds:
            return float(value)
    except ValueError:  # json.JSONDecodeError included
        raise ConfigError(f"{name} must be {annotation}, got {value!r}") from None
    return value


def app_builder(args: dict[str, Any]) -> Application:
    """Serve's application builder: ``import_path: pagedserve.router.app:app_builder`` with ``args``
    holding the flags of ``pagedserve serve`` (model, num_replicas, routing, max_model_len, ...)."""
    return build_app(serve_config_from_flags(dict(args)))


def deploy(serve_config: ServeConfig, name: str = APP_NAME) -> DeploymentHandle:
    """Start Serve's HTTP proxy on serve_config's host and port and run the application on ``/``.

    Ray must be initialized. Returns once every replica is up.
    """
    if serve_config.proxy_location == "Direct":
        # the ingress replica listens on serve_config.port itself (direct_ingress_env, set before
        # Ray started); Serve still keeps one fallback proxy on the head, on a port of its own
        missing = {k: v for k, v in direct_ingress_env(serve_config).items() if os.environ.get(k) != v}
        if missing:
            raise ValueError(f"proxy_location Direct: start Ray with {missing} in its environment")
        from pagedserve.localcluster import free_port

        serve.start(proxy_location="HeadOnly", http_options={"host": serve_config.host, "port": free_port()})
    else:
        serve.start(proxy_location=serve_config.proxy_location,
                    http_options={"host": serve_config.host, "port": serve_config.port})  # fmt: skip
    return serve.run(build_app(serve_config), name=name, route_prefix="/", blocking=False)


# Serve's controller loop period on the private Ray of `pagedserve serve` (Serve's default 0.1 s:
# ~3% of a core on its own, idle, on the cores the engine's threads share; see PUBLISH_PERIOD_S).
# It paces deploys and replica replacement, which take seconds anyway.
SERVE_CONTROL_LOOP_INTERVAL_S = "0.5"


def private_ray_env(serve_config: ServeConfig) -> dict[str, str]:
    """The environment the processes of `pagedserve serve`'s own Ray start with: Serve's controller
    loop period (the shell's RAY_SERVE_CONTROL_LOOP_INTERVAL_S wins) and direct_ingress_env."""
    env = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": os.environ.get("RAY_SERVE_CONTROL_LOOP_INTERVAL_S",
                                                               SERVE_CONTROL_LOOP_INTERVAL_S)}  # fmt: skip
    return env | direct_ingress_env(serve_config)


def direct_ingress_env(serve_config: ServeConfig) -> dict[str, str]:
    """Ray Serve's own environment for --proxy-location Direct (Serve's RAY_SERVE_THROUGHPUT_OPTIMIZED
    profile): the ingress replica serves HTTP on serve_config.port (no proxy hop: Serve's range
    is [MIN, MAX), one port), deployments call each other over gRPC, user code and the router run
    on the replica's event loop. No load balancer deregisters the replica here, so it does not
    wait Serve's 30 s for one before it stops, nor its port 150 s before a new one may take it.
    Every Ray process must start with it: Serve reads it as its modules are imported.
    `vllm bench serve` on SmolLM2 bf16, 2 cores (Zen 5), runs alternating, against EveryNode's
    proxy: c16 390 / 412 against 368 / 352 / 392 tok/s, TTFT p50 1153 / 1142 against 1251-1335
    ms; shared prefix 348 / 372 against 302-326 tok/s."""
    if serve_config.proxy_location != "Direct":
        return {}
    return {
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(serve_config.port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(serve_config.port + 1),
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
        # Serve holds a released port out of its pool for 150 s (for HAProxy's stale server lists,
        # not used here): with one port, a replacement ingress would wait that long to serve
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
    }
