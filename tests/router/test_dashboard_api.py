"""The admin API (/admin/api) and the dashboard's login, against the real served app.

The oracles are the engines' own counters as /metrics and the replicas' published stats give
them, the official ``openai`` client's view of a stream, and raw HTTP for status codes, cookies
and headers. The browser side is tests/router/test_dashboard_browser.py.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import httpx2
import openai
import pytest

from tests.clients import wait_until
from tests.router.conftest import NUM_REPLICAS, Server
from tests.router.test_api import wait_until_idle

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def admin(server: Server) -> httpx2.Client:
    with httpx2.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {server.admin_token}"},
                       timeout=60) as c:  # fmt: skip
        yield c


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0, timeout=120)


def replicas(admin: httpx2.Client) -> dict[str, dict[str, Any]]:
    reply = admin.get("/admin/api/replicas")
    assert reply.status_code == 200, reply.text
    return {r["replica_id"]: r for r in reply.json()}


def prompt_of(blocks: int) -> str:
    """A prompt no other test sends, of about ``blocks`` 16-token blocks."""
    return f"[{uuid.uuid4().hex}] " + "The quick brown fox jumps over the lazy dog. " * (blocks * 16 // 10)


def served(admin: httpx2.Client, before: dict[str, dict[str, Any]], field: str) -> dict[str, int]:
    after = replicas(admin)
    return {rid: after[rid][field] - before[rid][field] for rid in before}


# ---- access --------------------------------------------------------------------------------------


def test_admin_api_and_page_need_the_admin_token(server: Server) -> None:
    with httpx2.Client(base_url=server.base_url, timeout=30) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {server.api_key}"}):
            reply = http.get("/admin/api/overview", headers=headers)
            assert reply.status_code == 401, (headers, reply.text)
            assert reply.json()["error"]["code"] == "invalid_admin_token"
        assert http.post("/admin/api/replicas/x/drain").status_code == 401
        page = http.get("/dashboard", follow_redirects=False)
        assert page.status_code == 303 and page.headers["location"] == "/dashboard/login"
        # the admin token is not an API key
        completion = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                               headers={"Authorization": f"Bearer {server.admin_token}"})  # fmt: skip
        assert completion.status_code == 401
        wrong = http.post("/dashboard/login", data={"token": "not-it"}, follow_redirects=False)
        assert wrong.status_code == 401 and "invalid token" in wrong.text
        assert "pagedserve_admin" not in wrong.headers.get("set-cookie", "")


def test_login_sets_an_http_only_session_cookie_and_writes_need_the_csrf_header(server: Server) -> None:
    with httpx2.Client(base_url=server.base_url, timeout=30) as http:
        login = http.post("/dashboard/login", data={"token": server.admin_token}, follow_redirects=False)
        assert login.status_code == 303 and login.headers["location"] == "/dashboard"
        cookie = login.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie
        assert server.admin_token.lower() not in cookie  # the cookie is an HMAC of the token
        page = http.get("/dashboard")
        assert page.status_code == 200 and "<html" in page.text.lower()
        assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
        assert http.get("/admin/api/overview").status_code == 200
        rid = next(iter(http.get("/admin/api/replicas").json()))["replica_id"]
        # a cross-site form could send the cookie, never this header
        assert http.post(f"/admin/api/replicas/{rid}/undrain").status_code == 403
        ok = http.post(f"/admin/api/replicas/{rid}/undrain", headers={"X-Pagedserve-Admin": "1"})
        assert ok.status_code == 200 and ok.json() == {"replica_id": rid, "draining": False}
        http.post("/dashboard/logout")
        assert http.get("/admin/api/overview").status_code == 401


# ---- what it shows -------------------------------------------------------------------------------


def test_overview_shows_the_nodes_replicas_and_their_block_maps(admin: httpx2.Client, client: openai.OpenAI,
                                                                server: Server) -> None:  # fmt: skip
    client.completions.create(model=server.model, prompt=prompt_of(4), max_tokens=8)

    def probed() -> dict[str, Any] | None:
        view = admin.get("/admin/api/overview").json()
        alive = [n for n in view["nodes"] if n["alive"]]
        return view if alive and all(n["host"] for n in alive) else None

    view = wait_until(probed, "every live node's host figures", timeout=60)
    nodes = {n["node_id"]: n for n in view["nodes"]}
    head = [n for n in view["nodes"] if n["is_head"]]
    assert len(head) == 1 and head[0]["cpus"] > 0 and head[0]["memory_bytes"] > 0
    host = head[0]["host"]
    assert 0 < host["mem_used_bytes"] < host["mem_total_bytes"] and 0 <= host["cpu_percent"] <= 100
    assert head[0]["gpu_devices"] == []  # this machine has no GPU: host figures instead
    assert view["model"] == server.model and view["routing"] == "prefix"
    assert len(view["replicas"]) == NUM_REPLICAS
    metrics_blocks = None
    for r in view["replicas"]:
        assert r["node_id"] in nodes and r["replica_id"] in nodes[r["node_id"]]["replicas"]
        bmap = r["block_map"]
        assert bmap["num_blocks"] == r["num_blocks"] and len(bmap["cells"]) == bmap["num_blocks"]
        assert sum(bmap["counts"].values()) == bmap["num_blocks"]
        assert set(bmap["cells"]) <= set(".cus")  # Llama: no null block
        metrics_blocks = r["num_blocks"]
    assert metrics_blocks and metrics_blocks > 0


def test_block_map_and_counters_follow_requests_and_history_fills(admin: httpx2.Client,
                                                                   client: openai.OpenAI,
                                                                   server: Server) -> None:  # fmt: skip
    with httpx2.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {server.api_key}"},
                       timeout=60) as http:  # fmt: skip
        wait_until_idle(http)
    before = replicas(admin)
    prompt = prompt_of(6)
    # one session: the repeats follow the first to its replica even before the router has heard
    # of its blocks (a replica publishes them every ~100 ms)
    session = uuid.uuid4().hex
    outs = [client.completions.create(model=server.model, prompt=prompt, max_tokens=16, user=session)
            for _ in range(3)]  # fmt: skip
    generated = sum(o.usage.completion_tokens for o in outs)

    def counted() -> dict[str, int] | None:
        tokens = served(admin, before, "generation_tokens")
        return tokens if sum(tokens.values()) >= generated else None

    wait_until(counted, f"{generated} more generation tokens in the replicas' stats")
    after = replicas(admin)
    hits = {rid: after[rid]["prefix_cache_hits"] - before[rid]["prefix_cache_hits"] for rid in before}
    assert sum(hits.values()) > 0  # the repeats were prefix hits
    holder = max(hits, key=hits.__getitem__)

    def idle_map() -> dict[str, Any] | None:  # the map is redrawn every second, the counters more often
        r = replicas(admin)[holder]
        counts = r["block_map"]["counts"]
        return r["block_map"] if counts["c"] == r["cached_blocks"] > 0 and counts["u"] == 0 else None

    # the idle pool: the prompt's blocks are cached-free on the map as in the counters
    bmap = wait_until(idle_map, "the holder's map to show its cached blocks")
    assert bmap["cells"].count("c") == bmap["counts"]["c"] and bmap["counts"]["s"] == 0

    def charted() -> dict[str, Any] | None:
        history = admin.get("/admin/api/history").json()
        series = history["replicas"].get(holder)
        return history if series and any((v or 0) > 0 for v in series["output_tokens_per_s"]) else None

    history = wait_until(charted, "an output rate in the holder's history", timeout=30)
    series = history["replicas"][holder]
    assert len(series["t"]) == len(series["ttft_p50_s"]) and series["t"] == sorted(series["t"])
    assert any(v is not None and v > 0 for v in series["ttft_p50_s"])


# ---- actions -------------------------------------------------------------------------------------


def test_reset_empties_a_prefix_cache_so_the_next_repeat_misses(admin: httpx2.Client, client: openai.OpenAI,
                                                                 server: Server) -> None:  # fmt: skip
    prompt = prompt_of(6)
    before = replicas(admin)
    session = uuid.uuid4().hex  # the repeat goes where the first went (see the test above)
    client.completions.create(model=server.model, prompt=prompt, max_tokens=4, user=session)
    client.completions.create(model=server.model, prompt=prompt, max_tokens=4, user=session)
    hits = wait_until(lambda: (h := served(admin, before, "prefix_cache_hits")) and sum(h.values()) and h,
                      "the repeat's prefix hit")  # fmt: skip
    holder = max(hits, key=hits.__getitem__)
    reply = admin.post(f"/admin/api/replicas/{holder}/reset_prefix_cache")
    assert reply.status_code == 200, reply.text
    assert reply.json()["replica_id"] == holder and reply.json()["dropped_blocks"] >= 5
    assert wait_until(lambda: replicas(admin)[holder]["cached_blocks"] == 0, "no cached block after reset")
    before = replicas(admin)
    client.completions.create(model=server.model, prompt=prompt, max_tokens=4)
    queries = wait_until(
        lambda: (q := served(admin, before, "prefix_cache_queries")) and sum(q.values()) and q,
        "the next request's prefix lookup",
    )
    assert sum(served(admin, before, "prefix_cache_hits").values()) == 0, queries  # the repeat missed
    assert admin.post("/admin/api/replicas/no-such-replica/reset_prefix_cache").status_code == 404


def test_drain_sends_new_requests_to_the_other_replica(admin: httpx2.Client, client: openai.OpenAI,
                                                       server: Server) -> None:  # fmt: skip
    ids = sorted(replicas(admin))
    drained, other = ids[0], ids[1]
    try:
        reply = admin.post(f"/admin/api/replicas/{drained}/drain")
        assert reply.status_code == 200 and reply.json() == {"replica_id": drained, "draining": True}
        assert wait_until(lambda: replicas(admin)[drained]["draining"], "the drain mark")
        before = replicas(admin)
        # distinct prompts: pow2 would spread them over both replicas. A reply may end at EOS
        # before max_tokens, so its usage, not 6 * 4, is what the other replica must have counted.
        generated = sum(client.completions.create(model=server.model, prompt=prompt_of(2), max_tokens=4)
                        .usage.completion_tokens for _ in range(6))  # fmt: skip
        queries = served(admin, before, "prefix_cache_queries")
        assert queries[drained] == 0 and served(admin, before, "generation_tokens")[drained] == 0, queries
        assert wait_until(lambda: served(admin, before, "generation_tokens")[other] >= generated or None,
                          f"the other replica's {generated} tokens")  # fmt: skip
        # with every replica draining a request is refused, not left waiting
        admin.post(f"/admin/api/replicas/{other}/drain")
        assert replicas(admin)[other]["drain_requested"]  # at once; the replica hears it next
        assert wait_until(lambda: replicas(admin)[other]["draining"], "the second replica's drain")
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model=server.model, prompt=prompt_of(1), max_tokens=4)
        assert refused.value.status_code == 503 and "draining" in str(refused.value)
    finally:
        for rid in ids:
            admin.post(f"/admin/api/replicas/{rid}/undrain")
    assert wait_until(lambda: not any(r["draining"] for r in replicas(admin).values()), "the undrain")
    before = replicas(admin)
    for _ in range(12):  # undrained, it takes requests again (all 12 elsewhere: 2^-12 by chance)
        client.completions.create(model=server.model, prompt=prompt_of(2), max_tokens=4)
    assert wait_until(lambda: served(admin, before, "generation_tokens")[drained] > 0,
                      "the undrained replica's tokens")  # fmt: skip
    assert admin.post("/admin/api/replicas/no-such-replica/drain").status_code == 404


def test_abort_ends_a_running_stream_with_finish_reason_abort(admin: httpx2.Client, client: openai.OpenAI,
                                                              server: Server) -> None:  # fmt: skip
    chunks: list[Any] = []
    done = threading.Event()

    def stream() -> None:
        try:
            for chunk in client.completions.create(model=server.model, prompt=prompt_of(1), max_tokens=400,
                                                   stream=True, extra_body={"ignore_eos": True}):  # fmt: skip
                chunks.append(chunk)
        finally:
            done.set()

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    wait_until(lambda: chunks, "the stream's first chunk")
    engine_id = f"{chunks[0].id}-0"  # the engine's id of the completion's first prompt
    # (a listing is up to ~100 ms old: it may still show the previous test's last request)

    def listing() -> list[dict[str, Any]]:
        return [r for r in admin.get("/admin/api/requests").json() if r["request_id"] == engine_id]

    listed = wait_until(listing, "the request in the in-flight list")
    (request,) = listed
    assert request["prompt_tokens"] > 0 and request["replica_id"] in replicas(admin) and request["age_s"] >= 0
    reply = admin.post(f"/admin/api/requests/{request['request_id']}/abort")
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"request_id": request["request_id"], "replica_id": request["replica_id"],
                            "aborted": True}  # fmt: skip
    assert done.wait(10), "the aborted stream did not end"
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    tokens = sum(1 for c in chunks if c.choices and c.choices[0].text)
    assert reasons == ["abort"] and 0 < tokens < 400, (reasons, tokens)
    assert admin.post(f"/admin/api/requests/{request['request_id']}/abort").status_code == 404
    with httpx2.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {server.api_key}"},
                       timeout=60) as http:  # fmt: skip
        wait_until_idle(http)  # the aborted request's blocks are back in the pool
