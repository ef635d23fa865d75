"""``pagedserve serve --proxy-location Direct`` as a user runs it: the CLI in its own process with
its own private Ray; the ingress replica itself answers HTTP on --port (no Serve proxy between the
client and it), on loopback only, behind --api-key, and again on the same port once a lost
ingress replica is replaced.

Oracles: the official ``openai`` client; greedy text of the same model in this process; the
kernel's own socket table (/proc/net/tcp) for who listens where; /metrics for the KV pool.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx2
import openai
import pytest

from tests.router.conftest import PROMPTS
from tests.router.test_tensor_parallel_serve import cli_server, free_blocks, metric_values

pytestmark = pytest.mark.slow

KEY = "direct-key"


def listeners(port: int) -> list[tuple[str, int]]:
    """(local IPv4 address as hex, socket inode) of every TCP socket listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                address, hex_port = fields[1].split(":")
                if int(hex_port, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                    found.append((address, int(fields[9])))
    return found


def owner(inode: int) -> tuple[int, str]:
    """(pid, process title: Ray's actor name) of the process holding socket `inode`."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        return int(pid), f.read().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
    return 0, ""


def test_direct_ingress_serves_on_loopback_behind_the_api_key(tiny_engine_model: Path, size_1_texts) -> None:
    flags = ("--proxy-location", "Direct", "--api-key", KEY, "--max-waiting-requests", "2")
    with cli_server(tiny_engine_model, *flags) as (base, proc):
        port = int(base.rsplit(":", 1)[1])
        # the ingress replica holds the port, on 127.0.0.1 only
        found = listeners(port)
        assert [address for address, _ in found] == ["0100007F"], found
        ingress_pid, title = owner(found[0][1])
        assert "ServeReplica:pagedserve:OpenAIIngress" in title

        # the API key, as the openai client sends it; greedy text equals the model in process
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
        api = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)
        texts = [api.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0).choices[0].text
                 for p in PROMPTS]  # fmt: skip
        assert texts == size_1_texts
        stream = api.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                        stream=True)  # fmt: skip
        streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert streamed == size_1_texts[0]
        reply = httpx2.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": -1},
                            headers={"Authorization": f"Bearer {KEY}"}, timeout=30)  # fmt: skip
        assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"

        # a client that leaves mid-stream: the request is aborted and its blocks come back
        before = sum(metric_values(base, "pagedserve:generation_tokens_total"))
        body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx2.stream("POST", f"{base}/v1/completions", json=body, timeout=60,
                           headers={"Authorization": f"Bearer {KEY}"}) as response:  # fmt: skip
            assert response.status_code == 200
            received = 0
            for line in response.iter_lines():
                received += line.startswith("data: ")
                if received == 3:
                    break
        assert free_blocks(base) == [96.0], "every block back in the pool"
        assert sum(metric_values(base, "pagedserve:generation_tokens_total")) - before < 200

        # overload: 8 running + 2 waiting on the one replica; 40 at once get 200 or 503, none lost
        async def flood() -> list[httpx2.Response]:
            async with httpx2.AsyncClient(base_url=base, timeout=120,
                                          headers={"Authorization": f"Bearer {KEY}"}) as c:  # fmt: skip
                one = {"model": "tiny", "max_tokens": 16, "ignore_eos": True, "temperature": 0}
                return await asyncio.gather(
                    *(c.post("/v1/completions", json=one | {"prompt": f"Story {i}:"}) for i in range(40))
                )

        statuses = [r.status_code for r in asyncio.run(flood())]
        assert set(statuses) == {200, 503}, statuses
        assert free_blocks(base) == [96.0], "every block back in the pool after the flood"

        # the ingress replica's process dies: Serve starts another, which takes the same port
        os.kill(ingress_pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:
            found = listeners(port)
            if found and owner(found[0][1])[0] not in (0, ingress_pid):
                try:
                    if httpx2.get(f"{base}/health", timeout=5).status_code == 200:
                        break
                except httpx2.HTTPError:
                    pass
            assert time.monotonic() < deadline, "no ingress took the port back"
            time.sleep(0.5)
        print(f"a new ingress served after {time.monotonic() - deadline + 120:.1f} s")
        again = api.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=12, temperature=0)
        assert again.choices[0].text == size_1_texts[2]

        # Ctrl-C (SIGTERM): a clean exit, not held by Serve's draining period for load balancers
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        print(f"shutdown took {time.monotonic() - t0:.1f} s")
