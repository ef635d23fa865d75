"""One private Ray and one served model for the whole router test session.

The server is the real application (``build_app``): two engine replicas of the default model
(SmolLM2-135M-Instruct) behind the OpenAI ingress, on a free port, with an API key, small queues
(so that backpressure is reachable) and a small context.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

API_KEY = "test-key"
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 4
MAX_WAITING_REQUESTS = 2
NUM_REPLICAS = 2


@dataclass(frozen=True)
class Server:
    base_url: str  # http://127.0.0.1:PORT
    api_key: str
    model: str
    max_model_len: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def server(ray_session: None) -> Iterator[Server]:
    """The served default model; torn down (serve.shutdown) after the session."""
    from ray import serve

    from pagedserve.config import EngineConfig, ServeConfig
    from pagedserve.router.app import deploy, served_model_name

    engine = EngineConfig.from_flags(
        max_model_len=MAX_MODEL_LEN, kv_cache_memory=128 << 20, max_num_seqs=MAX_NUM_SEQS, dtype="float32"
    )
    config = ServeConfig(
        port=free_port(),
        num_replicas=NUM_REPLICAS,
        routing="prefix",
        api_key=API_KEY,
        max_waiting_requests=MAX_WAITING_REQUESTS,
        engine=engine,
    )
    deploy(config)
    try:
        yield Server(f"http://127.0.0.1:{config.port}", API_KEY, served_model_name(engine), MAX_MODEL_LEN)
    finally:
        serve.shutdown()
