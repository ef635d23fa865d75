"""The ingress's request guard at the ASGI level: a client that trickles its body (slow-loris)."""

from __future__ import annotations

import asyncio
import json
import time

from pagedserve.router.api import Limits, ModelInfo, build_api
from pagedserve.router.metrics import IngressMetrics


def run_request(body_chunks: list[bytes], stall: bool, timeout_s: float) -> tuple[int, dict, float]:
    """Drive the real app with an ASGI receive that sends ``body_chunks`` and then, if ``stall``,
    never sends the rest. Returns (status, JSON body, seconds until the response started)."""
    model = ModelInfo("m", "m", 64, 16, 100)
    app = build_api(model, None, None, IngressMetrics("m"), limits=Limits(body_timeout_s=timeout_s))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}  # fmt: skip
    sent: list[dict] = []

    async def main() -> float:
        chunks = list(body_chunks)
        forever = asyncio.Event()

        async def receive() -> dict:
            if chunks:
                return {"type": "http.request", "body": chunks.pop(0), "more_body": bool(chunks) or stall}
            await forever.wait()  # the rest of the body never comes
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        start = time.monotonic()
        await asyncio.wait_for(app(scope, receive, send), timeout=30)
        return time.monotonic() - start

    elapsed = asyncio.run(main())
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body), elapsed


def test_a_trickled_body_gets_408_after_the_timeout() -> None:
    status, body, elapsed = run_request([b'{"prompt": "hel'], stall=True, timeout_s=0.5)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert 0.4 < elapsed < 10


def test_a_body_in_pieces_within_the_timeout_is_read() -> None:
    # the whole body arrives (in two pieces): parsing goes on to validation (here: no prompt -> 400)
    status, body, _ = run_request([b'{"max_tok', b'ens": 2}'], stall=False, timeout_s=5)
    assert status == 400 and body["error"]["param"] == "prompt"
