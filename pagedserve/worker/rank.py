"""One tensor-parallel rank as a Ray actor: its process group, and a Worker (model shard, KV shard).

The replica's RayExecutor creates one ``RankActor`` per rank inside the replica's placement group,
rendezvouses them on rank 0's node address (``init_distributed``: gloo on CPU, NCCL on CUDA), then
lets each load only its shard of the weights (``init_worker``). From then on a rank does what
each step's plan says (``execute_wire``: msgpack bytes in, msgpack bytes out). Only rank 0's
output carries the sampled tokens; the other ranks return an empty output.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from typing import Any

import msgpack

from pagedserve.config import CacheConfig
from pagedserve.plan import StepOutput


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class RankActor:
    """The actor body of one rank (wrapped with ``ray.remote`` by the executor)."""

    def __init__(self, rank: int, world_size: int) -> None:
        # torch's threads come from OMP_NUM_THREADS, set in the actor's runtime env by the executor
        self.rank, self.world_size = rank, world_size
        self.worker = None

    def placement(self) -> tuple[str, str, int]:
        """(node id, node address, a free port): rank 0's address and port are where the group meets."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), free_port()

    def init_distributed(self, host: str, port: int, backend: str, timeout_s: float) -> None:
        """Join the group's torch.distributed process group (a collective: all ranks at once)."""
        import torch.distributed as dist

        if host == "127.0.0.1" and "GLOO_SOCKET_IFNAME" not in os.environ:
            # one node: gloo's pairs would otherwise connect through the hostname's (NIC) address
            os.environ["GLOO_SOCKET_IFNAME"] = _loopback_ifname()
        dist.init_process_group(
            backend, init_method=f"tcp://{host}:{port}", rank=self.rank, world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
        )  # fmt: skip

    def init_worker(self, model_path: str, worker_kwargs: dict[str, Any]) -> None:
        """Load this rank's shard of the model (every rank at once: the loader's checks are local)."""
        from pagedserve.worker.worker import Worker

        self.worker = Worker(model_path, tp_rank=self.rank, tp_size=self.world_size, **worker_kwargs)

    def determine_num_blocks(self, cache: dict[str, Any], max_num_batched_tokens: int) -> tuple[int, int]:
        return self.worker.determine_num_blocks(CacheConfig(**cache), max_num_batched_tokens)

    def init_kv_pool(self, num_blocks: int, block_size: int, num_host_blocks: int,
                     hybrid: bool = True) -> None:
        self.worker.init_kv_pool(num_blocks, block_size, num_host_blocks, hybrid)

    def execute_wire(self, plan: bytes) -> bytes:
        """One step on this rank's shard. Rank 0 returns the step's output; the others an output
        with only their timings (what the executor needs to tell its own overhead from compute)."""
        start = time.perf_counter()
        out = self.worker.execute_wire(plan)
        if self.rank == 0:
            return out
        return msgpack.packb(StepOutput([], timings=[time.perf_counter() - start]).to_wire())

    def serve_plans(self, address: list, token: str) -> None:
        """Connect to the scheduler's plan channel and answer its plans from a thread of this actor."""
        from pagedserve.worker.plan_channel import serve_plans

        self._plan_thread = serve_plans(address, token, self.rank, self.execute_wire)

    def pid(self) -> int:
        return os.getpid()


def _loopback_ifname() -> str:
    """The loopback interface's name, so that gloo on a one-node group never picks a NIC."""
    return next((name for _, name in socket.if_nameindex() if name.startswith("lo")), "lo")
