"""Helpers of the tests that drive a served cluster over HTTP: a streamed completion read in its
own thread, and polling until a condition holds."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import httpx2

T = TypeVar("T")


def wait_until(probe: Callable[[], T], what: str, timeout: float = 15.0, period: float = 0.1) -> T:
    """probe()'s first truthy value, polled every ``period`` s; fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(period)


@dataclass
class Stream:
    """One streamed completion (EOS ignored, usage asked for), read in its own thread, with what
    it got and when it ended. A broken connection or a passed deadline is recorded as the error
    code "client_error": only the server's own clear errors count as clear."""

    prompt: str
    tokens: int = 0  # chunks with text
    usage_tokens: int | None = None  # completion tokens, as the final usage chunk counts them
    finish_reason: str | None = None
    error: dict | None = None
    status: int | None = None
    ended_at: float | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def run(self, base_url: str, max_tokens: int, *, model: str | None = None, api_key: str | None = None,
            timeout: float = 120.0) -> None:  # fmt: skip
        body = {"prompt": self.prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        if model is not None:
            body["model"] = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            with httpx2.stream("POST", f"{base_url}/v1/completions", json=body, headers=headers,
                               timeout=timeout) as r:  # fmt: skip
                self.status = r.status_code
                if r.status_code != 200:
                    self.error = json.loads(r.read())["error"]
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: ") :])
                    if "error" in event:
                        self.error = event["error"]
                        continue
                    if event.get("usage"):
                        self.usage_tokens = event["usage"]["completion_tokens"]
                    if not event["choices"]:
                        continue
                    choice = event["choices"][0]
                    self.tokens += bool(choice["text"]) or choice.get("finish_reason") is None
                    self.finish_reason = choice.get("finish_reason") or self.finish_reason
        except httpx2.HTTPError as exc:  # a deadline passed or the connection broke: not a clear error
            self.error = {"code": "client_error", "message": repr(exc)}
        finally:
            self.ended_at = time.monotonic()
            self.done.set()
