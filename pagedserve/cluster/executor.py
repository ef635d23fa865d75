"""Runs a StepPlan on the ranks of one engine: in this process, or on Ray worker actors.

A plan crosses the process boundary once per step as msgpack bytes; every rank receives the
same bytes, and rank 0's StepOutput (also msgpack) is the step's result. Never pickle: the
bytes are plain lists of ints and strings.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgpack

from pagedserve.cluster.scheduler import StepOutput, StepPlan
from pagedserve.config import CacheConfig


class Executor(Protocol):
    def determine_num_blocks(self, cache: CacheConfig, max_num_batched_tokens: int) -> tuple[int, int]: ...
    def init_kv_pool(self, num_blocks: int, block_size: int, num_host_blocks: int) -> None: ...
    def execute(self, plan: StepPlan) -> StepOutput: ...
    def shutdown(self) -> None: ...


class InProcessExecutor:
    """One rank in this process (tensor parallel size 1). The plan still goes through msgpack,
    so the in-process path exercises exactly the bytes a remote rank would receive."""

    def __init__(self, model_path: str, **worker_kwargs: Any) -> None:
        from pagedserve.worker.worker import Worker

        self.worker = Worker(model_path, **worker_kwargs)

    def determine_num_blocks(self, cache: CacheConfig, max_num_batched_tokens: int) -> tuple[int, int]:
        return self.worker.determine_num_blocks(cache, max_num_batched_tokens)

    def init_kv_pool(self, num_blocks: int, block_size: int, num_host_blocks: int) -> None:
        self.worker.init_kv_pool(num_blocks, block_size, num_host_blocks)

    def execute(self, plan: StepPlan) -> StepOutput:
        wire = self.worker.execute_wire(msgpack.packb(plan.to_wire()))
        return StepOutput.from_wire(msgpack.unpackb(wire, strict_map_key=False))

    def shutdown(self) -> None:
        self.worker = None

