"""The deployment's request limits (``serve --max-n --max-logprobs --max-output-tokens
--max-prompt-tokens --max-body-bytes``) on the real FastAPI app, driven over ASGI by httpx, with a
fake engine behind it: past a limit a 400 naming the parameter (413 for the body), within it the
request reaches the engine."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx2
import pytest

from pagedserve.config import ConfigError, ServeConfig
from pagedserve.router.api import Limits, ModelInfo, build_api
from pagedserve.router.app import limits_of
from pagedserve.router.metrics import IngressMetrics

MODEL = ModelInfo("m", "m", max_model_len=256, block_size=16, vocab_size=1000)
LIMITS = Limits(max_body_bytes=4096, max_n=4, max_logprobs=3, max_output_tokens=32, max_prompt_tokens=40)


class FakeEngine:
    """Answers every request with one finished sample of max_tokens tokens; records what came."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []

    async def generate(self, request: dict[str, Any]):
        self.requests.append(request)
        params = request["params"]
        outputs = [{"index": k, "text_start": 0, "text": "", "token_ids": [7] * params["max_tokens"],
                    "logprobs": None, "finish_reason": "length", "stop_reason": None}
                   for k in range(params["n"])]  # fmt: skip
        yield {"outputs": outputs, "finished": True, "num_prompt_tokens": len(request["prompt_token_ids"]),
               "num_cached_tokens": 0}  # fmt: skip

    async def engine_health(self) -> None:
        return None

    async def render_metrics(self) -> bytes:
        return b""


def post(path: str, body: dict | bytes, limits: Limits = LIMITS) -> tuple[httpx2.Response, FakeEngine]:
    engine = FakeEngine()
    app = build_api(MODEL, None, engine, IngressMetrics("m"), limits=limits)

    async def run() -> httpx2.Response:
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://test") as client:
            if isinstance(body, bytes):
                return await client.post(path, content=body, headers={"content-type": "application/json"})
            return await client.post(path, json=body)

    return asyncio.run(run()), engine


PROMPT = list(range(10, 30))  # 20 token ids


@pytest.mark.parametrize(
    "body, param",
    [
        ({"n": 5}, "n"),
        ({"n": 2, "best_of": 5, "use_beam_search": True}, "best_of"),
        ({"logprobs": 4}, "logprobs"),
        ({"max_tokens": 33}, "max_tokens"),
        ({"prompt": list(range(10, 51))}, "prompt"),  # 41 tokens
    ],
)
def test_completions_past_a_limit_get_400_naming_it(body: dict, param: str) -> None:
    r, engine = post("/v1/completions", {"model": "m", "prompt": PROMPT, "max_tokens": 8, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and "this server" in r.json()["error"]["message"]
    assert not engine.requests


def test_chat_limits_name_the_chat_parameters() -> None:
    messages = [{"role": "user", "content": "hi"}]
    for body, param in (({"top_logprobs": 4, "logprobs": True}, "top_logprobs"),
                        ({"max_completion_tokens": 40}, "max_completion_tokens")):  # fmt: skip
        # no tokenizer here: the limits are checked before the chat template is applied
        r, engine = post("/v1/chat/completions", {"model": "m", "messages": messages, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert not engine.requests


def test_within_the_limits_the_request_reaches_the_engine() -> None:
    body = {"model": "m", "prompt": list(range(10, 50)), "max_tokens": 32, "n": 4, "logprobs": 3}
    r, engine = post("/v1/completions", body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 4 and engine.requests[0]["params"]["max_tokens"] == 32
    # the defaults are the engine's own caps: the same body passes with no limits set
    assert post("/v1/completions", {"model": "m", "prompt": list(range(10, 60)), "max_tokens": 64, "n": 8},
                Limits())[0].status_code == 200  # fmt: skip


def test_body_over_max_body_bytes_gets_413() -> None:
    r, engine = post("/v1/completions", b'{"model": "m", "prompt": [' + b"1, " * 2000 + b'1]}')
    assert r.status_code == 413 and "4096 bytes" in r.json()["error"]["message"]
    assert not engine.requests


def test_serve_config_validates_and_passes_the_limits() -> None:
    cfg = ServeConfig(max_n=4, max_logprobs=3, max_output_tokens=32, max_prompt_tokens=40,
                      max_body_bytes=4096)  # fmt: skip
    assert Limits(**limits_of(cfg)) == LIMITS
    for bad in ({"max_n": 0}, {"max_n": 129}, {"max_logprobs": 21}, {"max_output_tokens": 0},
                {"max_body_bytes": 10}, {"body_timeout_s": 0}):  # fmt: skip
        with pytest.raises(ConfigError):
            ServeConfig(**bad)
