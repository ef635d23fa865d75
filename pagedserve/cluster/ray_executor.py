"""Runs each StepPlan on a tensor-parallel group of Ray actors, one per rank.

The group lives in one placement group: the engine replica's own (Ray Serve reserves the
replica's bundle plus one bundle per rank, so rank r takes bundle r + 1), or one this executor
creates (``LLM(tensor_parallel_size=N)`` outside Serve). Ranks rendezvous on rank 0's node
(loopback when the whole group shares a node), join one torch.distributed group (gloo on CPU,
NCCL on CUDA) and each load only their shard.

Each step the plan is serialized once (msgpack) and the same bytes reach every rank through the
plan transport (``plan_transport.py``: a socket per rank by default, or a Ray Compiled Graph, or
one plain actor call per rank per step). Rank 0's output is the step's result.

A rank that dies, or a step that does not finish within ``timeout_s``, raises ``RankFailure``;
``restart()`` then kills the group and builds it again in the same placement group (same
number of blocks, empty pools). The caller resets its scheduler with it: the old KV is gone.
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from typing import Any

import msgpack
import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pagedserve.cluster.executor import RankFailure
from pagedserve.cluster.plan_transport import make_transport
from pagedserve.config import CacheConfig, ConfigError
from pagedserve.plan import StepOutput, StepPlan
from pagedserve.worker.rank import RankActor

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # loading a large shard from a slow disk can take minutes
PLACEMENT_TIMEOUT_S = 60.0


class RayExecutor:
    """One tensor-parallel group of RankActors driven by this process's scheduler."""

    def __init__(
        self,
        model_path: str,
        *,
        tp_size: int,
        worker_kwargs: dict[str, Any],
        strategy: str = "STRICT_PACK",
        timeout_s: float = 300.0,
        transport: str = "socket",
        use_gpu: bool | None = None,
        num_cpus_per_rank: float = 1.0,
        ray_temp_dir: str | None = None,
    ) -> None:
        self.model_path, self.tp_size, self.worker_kwargs = model_path, tp_size, worker_kwargs
        self.timeout_s, self.transport_kind = timeout_s, transport
        self.ray_temp_dir = ray_temp_dir  # a private Ray started for this executor: shut down with it
        self.group_id = uuid.uuid4().hex[:8]
        want_gpu = use_gpu if use_gpu is not None else ray.cluster_resources().get("GPU", 0) > 0
        self.pg, self.bundle_offset, self._own_pg = _placement(tp_size, strategy, want_gpu, num_cpus_per_rank)
        # a Serve replica's group says itself whether its ranks have GPUs
        self.use_gpu = self.pg.bundle_specs[self.bundle_offset].get("GPU", 0) > 0
        self.ranks: list[ray.actor.ActorHandle] = []
        self.pids: list[int] = []  # of the rank processes (all on this machine in tests)
        self.node_ids: list[str] = []  # the Ray node of each rank
        self._transport = None
        self._local = True  # every rank on this process's node
        self._pool_args: tuple[int, int, int, bool] | None = None
        self.last_step_s = self.last_rank_s = 0.0
        self._start()

    # ---- the group -----------------------------------------------------------------------

    def _rank_options(self, rank: int) -> dict[str, Any]:
        bundle = self.pg.bundle_specs[self.bundle_offset + rank]
        cpus = float(bundle.get("CPU", 0.0))
        threads = max(1, round(cpus)) if not self.use_gpu else 1
        env = {"OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE",
               "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
        return {
            "name": f"pagedserve-rank-{self.group_id}-{rank}",
            "num_cpus": cpus,
            "num_gpus": float(bundle.get("GPU", 0.0)),
            "max_restarts": 0,
            "runtime_env": {"env_vars": env},
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=self.bundle_offset + rank
            ),
        }

    def _start(self) -> None:
        actor = ray.remote(RankActor)
        self.ranks = [
            actor.options(**self._rank_options(r)).remote(r, self.tp_size) for r in range(self.tp_size)
        ]
        where = ray.get([r.placement.remote() for r in self.ranks], timeout=START_TIMEOUT_S)
        self.pids = ray.get([r.pid.remote() for r in self.ranks], timeout=START_TIMEOUT_S)
        self.node_ids = [node for node, _, _ in where]
        one_node = len({node for node, _, _ in where}) == 1
        self._local = one_node and where[0][0] == ray.get_runtime_context().get_node_id()
        host = "127.0.0.1" if one_node else where[0][1]
        port = where[0][2]
        backend = "nccl" if self.use_gpu else "gloo"
        ray.get([r.init_distributed.remote(host, port, backend, self.timeout_s) for r in self.ranks],
                timeout=START_TIMEOUT_S)  # fmt: skip
        ray.get([r.init_worker.remote(self.model_path, self.worker_kwargs) for r in self.ranks],
                timeout=START_TIMEOUT_S)  # fmt: skip
        logger.info("tensor-parallel group %s: %d ranks (%s) on %s", self.group_id, self.tp_size, backend,
                    "one node" if one_node else f"{len({n for n, _, _ in where})} nodes")  # fmt: skip

    def _teardown(self) -> None:
        # Kill first: a rank stuck in a collective would keep the graph's teardown waiting.
        for r in self.ranks:
            ray.kill(r, no_restart=True)
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        self.ranks = []

    # ---- the Executor protocol -----------------------------------------------------------

    def determine_num_blocks(self, cache: CacheConfig, max_num_batched_tokens: int) -> tuple[int, int]:
        """The blocks every rank can hold: the minimum over ranks (the same block ids everywhere)."""
        from dataclasses import asdict

        sizes = ray.get([r.determine_num_blocks.remote(asdict(cache), max_num_batched_tokens)
                         for r in self.ranks], timeout=START_TIMEOUT_S)  # fmt: skip
        return min(s[0] for s in sizes), min(s[1] for s in sizes)

    def init_kv_pool(self, num_blocks: int, block_size: int, num_host_blocks: int,
                     hybrid: bool = True) -> None:
        self._pool_args = (num_blocks, block_size, num_host_blocks, hybrid)
        ray.get([r.init_kv_pool.remote(num_blocks, block_size, num_host_blocks, hybrid) for r in self.ranks],
                timeout=START_TIMEOUT_S)  # fmt: skip
        self._transport = make_transport(self.transport_kind, self.ranks, self.timeout_s, self._local)

    def execute(self, plan: StepPlan) -> StepOutput:
        start = time.perf_counter()
        wire = msgpack.packb(plan.to_wire())
        try:
            outputs = self._transport.run(wire)
        except Exception as exc:
            raise RankFailure(f"tensor-parallel group {self.group_id}: {_describe(exc)}") from exc
        result = StepOutput.from_wire(msgpack.unpackb(outputs[0], strict_map_key=False))
        # this step's wall time here and the slowest rank's time inside its step: the difference
        # is what delivering the plan and collecting the outputs cost (benchmarks/tp_step.py)
        self.last_step_s = time.perf_counter() - start
        self.last_rank_s = max([sum(result.timings), *(sum(msgpack.unpackb(o)[2]) for o in outputs[1:])])
        return result

    def restart(self) -> None:
        """Kill the group and build it again in the same placement group, with empty KV pools."""
        self._teardown()
        self.group_id = uuid.uuid4().hex[:8]
        self._start()
        if self._pool_args is not None:
            self.init_kv_pool(*self._pool_args)

    def shutdown(self) -> None:
        if self.ranks:
            self._teardown()
        if self._own_pg and self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
        if self.ray_temp_dir is not None:
            ray.shutdown()
            shutil.rmtree(self.ray_temp_dir, ignore_errors=True)
            self.ray_temp_dir = None


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _placement(tp_size: int, strategy: str, use_gpu: bool,
               num_cpus_per_rank: float) -> tuple[PlacementGroup, int, bool]:  # fmt: skip
    """(placement group, index of rank 0's bundle, whether this executor owns the group).

    Inside a Serve replica that reserved ``placement_group_bundles`` (its own bundle first, then
    one per rank), the replica's group; else a new group of one bundle per rank.
    """
    current = ray.util.get_current_placement_group()
    if current is not None and len(current.bundle_specs) >= tp_size + 1:
        return current, len(current.bundle_specs) - tp_size, False
    bundle = {"GPU": 1.0} if use_gpu else {"CPU": num_cpus_per_rank}
    pg = placement_group([dict(bundle) for _ in range(tp_size)], strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise ConfigError(
            f"cannot place {tp_size} tensor-parallel ranks of {bundle} ({strategy}) within "
            f"{PLACEMENT_TIMEOUT_S:.0f} s; the cluster has {ray.cluster_resources()}"
        ) from None
    return pg, 0, True
