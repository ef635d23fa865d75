"""Slow-loris clients that trickle their request headers, against the served cluster: 200 such
connections open at once must not keep the server from answering others. (Bodies trickled too
slowly get a 408: tests/router/test_request_guard.py.)"""

from __future__ import annotations

import socket
import threading
import time
from urllib.parse import urlparse

import httpx2
import pytest

from tests.router.conftest import Server

pytestmark = pytest.mark.slow

SLOW_CLIENTS = 200


def test_clients_trickling_headers_do_not_starve_the_others(server: Server) -> None:
    url = urlparse(server.base_url)
    stop = threading.Event()
    sockets: list[socket.socket] = []
    for _ in range(SLOW_CLIENTS):
        s = socket.create_connection((url.hostname, url.port), timeout=5)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # the headers never end
        sockets.append(s)
    closed_by_server = 0

    def trickle() -> None:
        while not stop.is_set():
            for s in sockets:
                try:
                    s.sendall(b"X")  # one more byte of a header name, now and then
                except OSError:
                    pass
            stop.wait(1.0)

    feeder = threading.Thread(target=trickle, daemon=True)
    feeder.start()
    try:
        with httpx2.Client(base_url=server.base_url, timeout=60,
                           headers={"Authorization": f"Bearer {server.api_key}"}) as http:  # fmt: skip
            for i in range(5):
                t0 = time.monotonic()
                r = http.post("/v1/completions", json={"model": server.model, "prompt": f"Hello {i}",
                                                       "max_tokens": 4, "temperature": 0})  # fmt: skip
                assert r.status_code == 200, r.text
                assert time.monotonic() - t0 < 30
            assert http.get("/health").status_code == 200
    finally:
        stop.set()
        feeder.join(5)
        for s in sockets:
            try:
                s.settimeout(0.01)
                closed_by_server += s.recv(1) == b""
            except OSError:
                pass
            s.close()
    print(f"\n{SLOW_CLIENTS} clients trickling headers; requests still served; {closed_by_server} of them "
          "already closed by the server")
