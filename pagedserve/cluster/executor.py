"""Runs a StepPlan on the ranks of one engine: in this process, or on Ray worker actors.

A plan crosses the process boundary once per step as msgpack bytes; every rank receives the
same bytes, and rank 0's StepOutput (also msgpack) is the step's result. Never pickle: the
bytes are plain lists of ints and strings.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Protocol

import msgpack

from pagedserve.config import CacheConfig, ParallelConfig
from pagedserve.plan import StepOutput, StepPlan

OBJECT_STORE_BYTES = 256 << 20  # plans, requests and deltas are small; Ray's default is 30% of RAM


class RankFailure(RuntimeError):
    """A rank died or did not finish a step in time; the group must be rebuilt (``restart``)."""


class Executor(Protocol):
    def determine_num_blocks(self, cache: CacheConfig, max_num_batched_tokens: int) -> tuple[int, int]: ...
    def init_kv_pool(self, num_blocks: int, block_size: int, num_host_blocks: int,
                     hybrid: bool = True) -> None: ...
    def execute(self, plan: StepPlan) -> StepOutput: ...
    def restart(self) -> None: ...
    def shutdown(self) -> None: ...


class InProcessExecutor:
    """One rank in this process (tensor parallel size 1). The plan still goes through msgpack,
    so the in-process path exercises exactly the bytes a remote rank would receive."""

    def __init__(self, model_path: str, **worker_kwargs: Any) -> None:
        from pagedserve.worker.worker import Worker

        self.worker = Worker(model_path, **worker_kwargs)

    def determine_num_blocks(self, cache: CacheConfig, max_num_batched_tokens: int) -> tuple[int, int]:
        return self.worker.determine_num_blocks(cache, max_num_batched_tokens)

    def init_kv_pool(self, num_blocks: int, block_size: int, num_host_blocks: int,
                     hybrid: bool = True) -> None:
        self.worker.init_kv_pool(num_blocks, block_size, num_host_blocks, hybrid)

    def execute(self, plan: StepPlan) -> StepOutput:
        wire = self.worker.execute_wire(msgpack.packb(plan.to_wire()))
        return StepOutput.from_wire(msgpack.unpackb(wire, strict_map_key=False))

    def restart(self) -> None:
        """Nothing to rebuild in process: a failed step here is a bug, never a lost rank."""
        raise RuntimeError("the in-process executor cannot restart")

    def shutdown(self) -> None:
        self.worker = None



def make_executor(parallel: ParallelConfig, model_path: str, worker_kwargs: dict[str, Any]) -> Executor:
    """In this process for one rank; a group of Ray actors (starting a private Ray if none runs)
    for tensor parallelism or ``distributed_executor_backend="ray"``."""
    if not parallel.uses_ray:
        return InProcessExecutor(model_path, **worker_kwargs)
    import ray

    from pagedserve.cluster.ray_executor import RayExecutor

    temp_dir = None if ray.is_initialized() else init_ray(None)
    return RayExecutor(
        model_path, tp_size=parallel.tensor_parallel_size, worker_kwargs=worker_kwargs,
        strategy=parallel.placement_group_strategy, timeout_s=parallel.step_timeout_s,
        transport=parallel.plan_transport,
        num_cpus_per_rank=cpus_per_rank(parallel.tensor_parallel_size), ray_temp_dir=temp_dir,
    )  # fmt: skip


def cpus_per_rank(ranks: int, other_cpus: float = 0.0) -> float:
    """Each rank's share of this node's CPUs (what is left after ``other_cpus``), at most one core
    for every core a rank can use and at least a tenth; on CPU a rank's torch runs on its share."""
    cores = os.cpu_count() or 1
    share = max(0.1, (cores - other_cpus) / ranks)
    return float(int(share)) if share >= 1 else round(int(share * 20) / 20, 2)


def init_ray(address: str | None, *, num_cpus: int | None = None,
             object_store_memory: int = OBJECT_STORE_BYTES) -> str | None:  # fmt: skip
    """Join the Ray cluster at ``address``, or start a private local one in a fresh temp dir.

    Never joins a cluster by accident (address="local" ignores RAY_ADDRESS and running clusters).
    Returns the private cluster's temp dir, for the caller to remove after ``ray.shutdown()``.
    """
    import ray

    if address:
        ray.init(address=address)
        return None
    # Short: Ray's Unix socket paths live under it and must stay within 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="psrv-", dir="/tmp")
    os.environ["RAY_TMPDIR"] = temp_dir
    # Ray starts its workers at nice 15, below every ordinary process: on a CPU host the engine's
    # model thread then loses its core to any nice-0 process that wakes (a benchmark client, the
    # GCS), 18.7% of its time on 2 cores at concurrency 16 against 13.1% at nice 0 (measured from
    # its schedstat). The engine is this cluster's reason to exist: its workers run at nice 0.
    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(address="local", include_dashboard=False, _temp_dir=temp_dir, num_cpus=num_cpus,
             object_store_memory=object_store_memory)  # fmt: skip
    return temp_dir
