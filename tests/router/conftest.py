"""One private Ray and one served model for the whole router test session.

The server is the real application (``build_app``): two engine replicas of the default model
(SmolLM2-135M-Instruct) behind the OpenAI ingress, on a free port, with an API key, small queues
(so that backpressure is reachable), a small context and a KV pool small enough to preempt.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

API_KEY = "test-key"
ADMIN_TOKEN = "test-admin-token"
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 4
MAX_WAITING_REQUESTS = 2
NUM_REPLICAS = 2
# 91 blocks of 16 tokens per replica: less than MAX_NUM_SEQS sequences of MAX_MODEL_LEN tokens,
# so that long requests preempt (the soak test puts the pool under that pressure)
KV_CACHE_MEMORY = 64 << 20


PROCESSES = ("ray::ServeReplica:pagedserve:EngineDeployment", "ray::ServeReplica:pagedserve:OpenAIIngress",
             "ray::ProxyActor")  # fmt: skip


def rss_mb() -> dict[str, float]:
    """Resident memory (MB) of each serving process, by its Ray title and pid."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0].decode(errors="replace")
            with open(f"/proc/{entry}/status") as f:
                rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
        if title.startswith(PROCESSES):
            # Ray retitles a worker with its current task ("...OpenAIIngress.handle_request"): key
            # by the actor's class alone, so that two readings of one process match
            name = title.removeprefix("ray::").split(".")[0]
            out[f"{name}[{entry}]"] = rss / 1024
    return out


@dataclass(frozen=True)
class Server:
    base_url: str  # http://127.0.0.1:PORT
    api_key: str
    model: str
    max_model_len: int
    admin_token: str = ADMIN_TOKEN


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# greedy prompts of the CLI servers' tests (test_tensor_parallel_serve, test_direct_ingress)
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,", "Hello"]


@pytest.fixture(scope="module")
def size_1_texts(tiny_engine_model) -> list[str]:
    """The oracle of the CLI servers' tests: the tiny model, greedy, at size 1 in this process."""
    from pagedserve import LLM, SamplingParams

    llm = LLM(str(tiny_engine_model), dtype="float32", max_model_len=256, num_gpu_blocks_override=96,
              block_size=8)  # fmt: skip
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="session")
def server(ray_session: None) -> Iterator[Server]:
    """The served default model; torn down (serve.shutdown) after the session."""
    from ray import serve

    from pagedserve.config import EngineConfig, ServeConfig
    from pagedserve.router.app import deploy, served_model_name

    engine = EngineConfig.from_flags(
        max_model_len=MAX_MODEL_LEN, kv_cache_memory=KV_CACHE_MEMORY, max_num_seqs=MAX_NUM_SEQS,
        dtype="float32",
    )
    config = ServeConfig(
        port=free_port(),
        num_replicas=NUM_REPLICAS,
        routing="prefix",
        api_key=API_KEY,
        admin_token=ADMIN_TOKEN,
        max_waiting_requests=MAX_WAITING_REQUESTS,
        engine=engine,
    )
    deploy(config)
    try:
        yield Server(f"http://127.0.0.1:{config.port}", API_KEY, served_model_name(engine), MAX_MODEL_LEN)
    finally:
        serve.shutdown()
