"""``pagedserve serve --tensor-parallel-size 2`` as a user runs it: the CLI in its own process with
its own private Ray, real HTTP, the official ``openai`` client.

One replica of 2 ranks, then 2 replicas of 2 ranks (fractional CPUs: 0.1 per replica, 0.4 or
0.9 per rank on this 2-core machine): greedy text equals the same model at size 1 in process;
/metrics and the prefix router work unchanged. Killing a rank's process in the middle of a batch
of streams ends those streams with a clear error, the replica rebuilds its group, the next
request succeeds, and every KV block is free.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.router.conftest import PROMPTS, free_port

pytestmark = pytest.mark.slow

ENGINE_FLAGS = ["--max-model-len", "256", "--num-gpu-blocks-override", "96", "--block-size", "8",
                "--dtype", "float32", "--max-num-seqs", "8", "--step-timeout-s", "20"]  # fmt: skip
START_TIMEOUT_S = 300


@contextmanager
def cli_server(model: Path, *flags: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """``pagedserve serve`` in a subprocess (its own session); yields (base URL, process) once it
    says it is serving (Serve's application is running: every replica up) and /health answers,
    and stops it with SIGTERM as a user's Ctrl-C would. (With --proxy-location Direct the ingress
    replica answers /health as soon as it and one engine replica are up, before the others.)"""
    port = free_port()
    log = open(model.parent / f"serve-{port}.log", "w+")  # noqa: SIM115 - read back on failure
    cmd = [sys.executable, "-m", "pagedserve.cli", "serve", str(model), "--served-model-name", "tiny",
           "--port", str(port), *ENGINE_FLAGS, *flags]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"the server exited: {_tail(log)}"
            assert time.monotonic() < deadline, f"the server did not start: {_tail(log)}"
            # read through a file of its own: seeking `log` would move the server's offset too
            if "pagedserve: serving" in Path(log.name).read_text(errors="replace"):
                try:
                    if httpx2.get(f"{base}/health", timeout=5).status_code == 200:
                        break
                except httpx2.HTTPError:
                    pass
            time.sleep(1)
        yield base, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def _tail(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-4000:]


def rank_pids(server_pid: int) -> list[int]:
    """PIDs of the RankActor processes that descend from the server process (its own Ray)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"RankActor" not in f.read():
                    continue
        except OSError:
            continue
        pid = int(entry)
        while pid > 1:  # walk up the parents to the server
            try:
                with open(f"/proc/{pid}/stat") as f:
                    pid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                break
            if pid == server_pid:
                found.append(int(entry))
                break
    return found


def metric_values(base: str, name: str) -> list[float]:
    text = httpx2.get(f"{base}/metrics", timeout=30).text
    return [s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name]  # fmt: skip


def free_blocks(base: str, want: float = 96.0, timeout: float = 15.0) -> list[float]:
    """Each replica's free KV blocks from /metrics, once they read [want] or after `timeout` s."""
    deadline = time.monotonic() + timeout  # replicas publish their figures every ~0.1 s
    while (got := metric_values(base, "pagedserve:num_free_blocks")) != [want]:
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return got


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="EMPTY", max_retries=0, timeout=120)


def greedy_texts(api: openai.OpenAI) -> list[str]:
    return [api.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0).choices[0].text
            for p in PROMPTS]  # fmt: skip


def test_one_replica_of_two_ranks_serves_and_survives_a_lost_rank(tiny_engine_model, size_1_texts):
    with cli_server(tiny_engine_model, "--tensor-parallel-size", "2", "--num-replicas", "1") as (base, proc):
        api = client(base)
        assert greedy_texts(api) == size_1_texts
        assert sum(metric_values(base, "pagedserve:generation_tokens_total")) >= 4 * 1
        pids = rank_pids(proc.pid)
        assert len(pids) == 2, "one process per rank"

        # a batch of streams; once each has a token, one rank's process dies
        first_token = threading.Barrier(len(PROMPTS) + 1, timeout=120)
        ends: list[BaseException | None] = [None] * len(PROMPTS)

        def stream(i: int) -> None:
            got_first = False
            try:
                for chunk in api.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=200,
                                                    temperature=0, stream=True,
                                                    extra_body={"ignore_eos": True}):  # fmt: skip
                    if chunk.choices and chunk.choices[0].text and not got_first:
                        got_first = True
                        first_token.wait()
            except Exception as exc:
                ends[i] = exc

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        first_token.wait()
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "no stream may hang"
        assert time.monotonic() - t0 < 30
        for exc in ends:
            assert isinstance(exc, openai.APIError), ends
            assert "engine replica" in str(exc) and "tensor-parallel group" in str(exc), str(exc)

        # the replica rebuilt its group (new processes) and serves as before
        assert greedy_texts(api) == size_1_texts
        new_pids = rank_pids(proc.pid)
        assert len(new_pids) == 2 and not set(new_pids) & set(pids)
        assert metric_values(base, "pagedserve:engine_group_restarts_total") == [1.0]
        assert free_blocks(base, timeout=10) == [96.0], "every block back in the pool"


def test_two_replicas_of_two_ranks_route_by_prefix(tiny_engine_model, size_1_texts):
    with cli_server(tiny_engine_model, "--tensor-parallel-size", "2", "--num-replicas", "2",
                    "--routing", "prefix") as (base, proc):  # fmt: skip
        assert len(rank_pids(proc.pid)) == 4
        api = client(base)
        assert greedy_texts(api) == size_1_texts
        # a long shared prefix, sent again: the router sends it where its blocks are cached
        shared = "Tell me a story about a dragon who lived in a castle by the sea and " * 4
        for i in range(4):
            api.completions.create(model="tiny", prompt=shared + str(i), max_tokens=4, temperature=0)
            time.sleep(0.6)  # busy replicas publish KV events every 0.25 s, busy routers poll as often
        assert len(metric_values(base, "pagedserve:num_gpu_blocks")) == 2, "both replicas report"
        assert sum(metric_values(base, "pagedserve:prefix_cache_hits_total")) > 0
        text = httpx2.get(f"{base}/metrics", timeout=30).text
        assert 'pagedserve:router_decisions_total{outcome="prefix_hit",policy="prefix"}' in text, text[-2000:]
