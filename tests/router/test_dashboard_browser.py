"""The admin dashboard in a real browser: Playwright for Python driving Debian's chromium against the
session's served model (tests/router/conftest.py: two engine replicas, prefix routing).

Each scenario checks the page against what the server did: the figures it shows come from
/admin/api/overview, read here with the bearer token, and from the completions' own usage. The
module's page saves a full-page screenshot when it closes ($PAGEDSERVE_ARTIFACTS, else a pytest
temporary folder): an artifact, not committed.
"""

from __future__ import annotations

import os
import subprocess
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from tests.clients import wait_until
from tests.router.conftest import NUM_REPLICAS, Server

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]  # fmt: skip
VIEWPORT = {"width": 1366, "height": 768}  # a laptop screen
# ~120 tokens: seven full blocks of 16, so that a repeat of it is a prefix hit
FILLER = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 9
WAIT_S = 15.0  # for the page or the stats to catch up (stats are published every 0.1 s, polled every 1 s)

# Everything the page shows of each replica, read through its data-testid hooks.
READ_CARDS_JS = """() => Object.fromEntries(
  [...document.querySelectorAll('[data-testid=replica-card]')].map(card => {
  const map = card.querySelector('[data-testid=block-map]');
  const hit = card.querySelector('[data-testid=hit-rate]');
  return [card.dataset.replicaId, {
    free: +map.dataset.free, cached: +map.dataset.cached, used: +map.dataset.used,
    shared: +map.dataset.shared, cells: map.dataset.cells || '',
    queries: +hit.dataset.queries, hits: +hit.dataset.hits,
    hit_rate: hit.dataset.value === '' ? null : +hit.dataset.value,
    generation_tokens: +card.dataset.generationTokens, draining: card.dataset.draining === 'true'}];
}))"""


@dataclass
class Dashboard:
    """The logged-in page, and the script errors it raised (there must be none)."""

    page: Page
    errors: list[str] = field(default_factory=list)

    def cards(self) -> dict[str, dict[str, Any]]:
        return self.page.evaluate(READ_CARDS_JS)

    def card(self, replica_id: str):
        return self.page.locator(f'[data-testid=replica-card][data-replica-id="{replica_id}"]')

    def decisions(self) -> dict[str, int]:
        """The router table's total decisions per replica."""
        return self.page.evaluate("""() => Object.fromEntries([...document.querySelectorAll(
          '[data-testid=decision-row]')].map(row => [row.dataset.replicaId, +row.dataset.total]))""")

    def check(self) -> None:
        assert not self.errors, f"the page raised script errors: {self.errors}"


# ---- fixtures ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chromium() -> Path:
    """Debian's chromium, installed here when missing and we may (root)."""
    if not CHROMIUM.exists() and os.geteuid() == 0:
        try:
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            subprocess.run(["apt-get", "install", "-y", "chromium"], env=env, capture_output=True,
                           timeout=600, check=False)  # fmt: skip
        except subprocess.TimeoutExpired:
            pass
    if not CHROMIUM.exists():
        pytest.skip(f"!!! {CHROMIUM} is missing and could not be installed (apt-get install chromium): "
                    "the dashboard's browser tests did NOT run !!!")  # fmt: skip
    return CHROMIUM


@pytest.fixture(scope="module")
def browser(chromium: Path) -> Iterator[Browser]:
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(chromium), headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def admin(server: Server) -> Iterator[httpx2.Client]:
    """The admin API with the bearer token: the oracle for what the page shows."""
    headers = {"Authorization": f"Bearer {server.admin_token}"}
    with httpx2.Client(base_url=server.base_url, headers=headers, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def dashboard(browser: Browser, server: Server,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dashboard]:  # fmt: skip
    """A page logged in through the login form; saves a full-page screenshot when the module ends."""
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    dash = Dashboard(page)
    page.on("pageerror", lambda e: dash.errors.append(str(e)))
    page.goto(f"{server.base_url}/dashboard")
    page.fill("input[name=token]", server.admin_token)
    page.click("button[type=submit]")
    page.wait_for_url(f"{server.base_url}/dashboard")
    try:
        yield dash
    finally:
        folder = Path(os.environ.get("PAGEDSERVE_ARTIFACTS") or tmp_path_factory.mktemp("dashboard"))
        folder.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(folder / "dashboard.png"), full_page=True)
        print(f"dashboard screenshot: {folder / 'dashboard.png'}")
        context.close()


# ---- helpers ------------------------------------------------------------------------------------------


def overview(admin: httpx2.Client) -> dict[str, Any]:
    r = admin.get("/admin/api/overview")
    assert r.status_code == 200, r.text
    return r.json()


def replicas(admin: httpx2.Client) -> dict[str, dict[str, Any]]:
    return {r["replica_id"]: r for r in overview(admin)["replicas"]}


def complete(client: openai.OpenAI, server: Server, prompt: str, max_tokens: int = 2):
    return client.completions.create(model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=0)


def served(admin: httpx2.Client, before: dict[str, dict[str, Any]], outs: list) -> dict[str, dict[str, int]]:
    """Per replica, the growth of its counters since ``before``, once the replicas' stats count the
    completions ``outs`` (stats are published, so they lag a little). Prefix queries grow only with
    new requests, so a stream left running by an earlier test cannot make them look counted."""
    prompt = sum(o.usage.prompt_tokens for o in outs)
    generated = sum(o.usage.completion_tokens for o in outs)

    def deltas() -> dict[str, dict[str, int]] | None:
        now = replicas(admin)
        d = {rid: {k: now[rid][k] - before[rid][k] for k in ("generation_tokens", "prefix_cache_queries",
                                                               "prefix_cache_hits")}
             for rid in before if rid in now}  # fmt: skip
        counted = sum(x["prefix_cache_queries"] for x in d.values()) >= prompt
        return d if counted and sum(x["generation_tokens"] for x in d.values()) >= generated else None

    return wait_until(deltas, f"the stats to count {prompt} more prompt and {generated} more output tokens")


def nonce_prompt() -> str:
    # the nonce comes first, so that no replica holds any block of the prompt yet
    return f"[{uuid.uuid4().hex[:12]}] {FILLER}"


# ---- scenarios ----------------------------------------------------------------------------------------


def test_without_the_token_the_page_asks_for_login_and_the_api_answers_401(
    browser: Browser, server: Server
) -> None:
    context = browser.new_context(viewport=VIEWPORT)
    try:
        page = context.new_page()
        page.goto(f"{server.base_url}/dashboard")
        assert page.url == f"{server.base_url}/dashboard/login"
        expect(page.locator("form input[name=token][type=password]")).to_be_visible()

        page.fill("input[name=token]", "not-the-token")
        page.click("button[type=submit]")
        expect(page.locator("[data-testid=login-error]")).to_contain_text("invalid token")
        assert not [c for c in context.cookies() if c["name"] == "pagedserve_admin"]
        page.goto(f"{server.base_url}/dashboard")
        assert page.url == f"{server.base_url}/dashboard/login"
    finally:
        context.close()

    # neither no token, a wrong one, nor the OpenAI API key opens the admin API
    for bearer in (None, "not-the-token", server.api_key):
        headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
        r = httpx2.get(f"{server.base_url}/admin/api/overview", headers=headers, timeout=30)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["code"] == "invalid_admin_token"
    r = httpx2.post(f"{server.base_url}/admin/api/replicas/x/drain", timeout=30)
    assert r.status_code == 401, r.text


def test_logged_in_the_page_shows_nodes_and_both_replicas(dashboard: Dashboard, admin: httpx2.Client) -> None:
    page = dashboard.page
    cookie = [c for c in page.context.cookies() if c["name"] == "pagedserve_admin"]
    assert cookie and cookie[0]["httpOnly"], cookie
    ov = overview(admin)
    ids = {r["replica_id"] for r in ov["replicas"]}
    assert len(ids) == NUM_REPLICAS, ov["replicas"]

    expect(page.locator("[data-testid=replica-card]")).to_have_count(NUM_REPLICAS, timeout=WAIT_S * 1000)
    assert set(dashboard.cards()) == ids
    for r in ov["replicas"]:
        card = dashboard.card(r["replica_id"])
        expect(card).to_contain_text(f"pid {r['pid']}")
        block_map = card.locator("[data-testid=block-map]")
        expect(block_map).to_have_attribute("data-num-blocks", str(r["num_blocks"]))

    nodes = page.locator("[data-testid=node-row]")
    expect(nodes).to_have_count(len(ov["nodes"]), timeout=WAIT_S * 1000)
    alive = {n["node_id"] for n in ov["nodes"] if n["alive"]}
    assert alive >= {r["node_id"] for r in ov["replicas"]}
    for node_id in alive:
        row = page.locator(f'[data-testid=node-row][data-node-id="{node_id}"]')
        expect(row).to_have_attribute("data-alive", "true")
        expect(row.locator("[data-testid=node-state]")).to_have_text("alive")
    dashboard.check()


def test_the_block_map_and_counters_change_after_requests(dashboard: Dashboard, client: openai.OpenAI,
                                                          server: Server) -> None:  # fmt: skip
    before = dashboard.cards()
    prompt = nonce_prompt()
    prompts = [prompt, prompt, nonce_prompt(), nonce_prompt()]
    outs = [complete(client, server, p, max_tokens=4) for p in prompts]
    prompt_tokens = sum(o.usage.prompt_tokens for o in outs)
    generated = sum(o.usage.completion_tokens for o in outs)

    def changed() -> dict[str, dict[str, Any]] | None:
        now = dashboard.cards()
        queries = sum(now[r]["queries"] - before[r]["queries"] for r in before)
        tokens = sum(now[r]["generation_tokens"] - before[r]["generation_tokens"] for r in before)
        return now if queries >= prompt_tokens and tokens >= generated else None

    what = f"the page to count {prompt_tokens} more prefix queries and {generated} more tokens"
    after = wait_until(changed, what)
    # the prompts' full blocks stay cached-free once they finish
    assert any(after[r]["cached"] > 0 for r in after), after

    def map_matches_counts() -> bool:
        # the map is redrawn about once a second, the counts every publish: they agree once idle
        cards = dashboard.cards()
        return all(c["cells"].count("c") == c["cached"] and c["cells"].count(".") == c["free"]
                   for c in cards.values()
                   if len(c["cells"]) == sum(c[k] for k in ("free", "cached", "used", "shared")))  # fmt: skip

    wait_until(map_matches_counts, "the block maps to show the replicas' free and cached-free counts")
    dashboard.check()


def test_reset_empties_the_prefix_cache_and_the_next_repeat_misses(
    dashboard: Dashboard, admin: httpx2.Client, client: openai.OpenAI, server: Server
) -> None:
    page = dashboard.page
    prompt = nonce_prompt()
    before = replicas(admin)
    # on two replicas, two of three sends meet on one, whatever the routing: a repeat hits
    outs = [complete(client, server, prompt)]
    while len(outs) < 3 and not any(o.usage.prompt_tokens_details.cached_tokens for o in outs):
        outs.append(complete(client, server, prompt))
    assert max(o.usage.prompt_tokens_details.cached_tokens for o in outs) > 0
    deltas = served(admin, before, outs)
    holders = [rid for rid, d in deltas.items() if d["prefix_cache_queries"] > 0]
    assert holders and any(deltas[rid]["prefix_cache_hits"] > 0 for rid in holders), deltas

    for rid in holders:
        card = dashboard.card(rid)
        wait_until(lambda rid=rid: dashboard.cards()[rid]["cached"] > 0, f"{rid}'s cached blocks on the page")
        path = f"/admin/api/replicas/{rid}/reset_prefix_cache"
        with page.expect_response(lambda r, path=path: r.url.endswith(path)) as reply:
            card.locator("[data-testid=reset-button]").click()
        assert reply.value.status == 200, reply.value.text()
        assert reply.value.json()["dropped_blocks"] > 0
        expect(page.locator("[data-testid=toast]").last).to_contain_text("blocks dropped")
        block_map = card.locator("[data-testid=block-map]")
        expect(block_map).to_have_attribute("data-cached", "0", timeout=WAIT_S * 1000)
    rates = dashboard.cards()

    before = replicas(admin)
    again = complete(client, server, prompt)
    assert again.usage.prompt_tokens_details.cached_tokens == 0, again.usage
    deltas = served(admin, before, [again])
    target = [rid for rid, d in deltas.items() if d["prefix_cache_queries"] > 0]
    assert len(target) == 1 and deltas[target[0]]["prefix_cache_hits"] == 0, deltas
    if rates[target[0]]["hit_rate"]:
        # the page's hit rate of the replica that took the miss falls
        rid, rate = target[0], rates[target[0]]["hit_rate"]
        wait_until(lambda: dashboard.cards()[rid]["hit_rate"] < rate, f"{rid}'s hit rate to fall from {rate}")
    dashboard.check()


def test_drain_sends_new_requests_to_the_other_replica(
    dashboard: Dashboard, admin: httpx2.Client, client: openai.OpenAI, server: Server
) -> None:
    # a prompt that one replica holds, so that prefix routing would send it there but for the drain
    prompt = nonce_prompt()
    before = replicas(admin)
    outs = [complete(client, server, prompt), complete(client, server, prompt)]
    deltas = served(admin, before, outs)
    drained = max(deltas, key=lambda r: (deltas[r]["prefix_cache_hits"], deltas[r]["prefix_cache_queries"]))
    (other,) = set(deltas) - {drained}
    card = dashboard.card(drained)
    button = card.locator("[data-testid=drain-button]")
    # a drained replica still finishes what it has, queued requests included: start with none queued
    wait_until(lambda: replicas(admin)[drained]["num_waiting"] == 0, f"{drained} to have nothing queued")
    decided = dashboard.decisions()
    try:
        button.click()
        expect(card.locator("[data-testid=draining-badge]")).to_be_visible()
        expect(button).to_have_text("Undrain")
        wait_until(lambda: replicas(admin)[drained]["draining"], f"{drained} to hear it drains")

        before = replicas(admin)
        outs = [complete(client, server, p) for p in [prompt] * 3 + [nonce_prompt() for _ in range(3)]]
        deltas = served(admin, before, outs)
        # no new request reached the drained replica (each one's prompt is a prefix query)
        assert deltas[drained]["prefix_cache_queries"] == 0, deltas
        assert deltas[other]["prefix_cache_queries"] >= sum(o.usage.prompt_tokens for o in outs), deltas
        # the router's table on the page counts the six decisions for the other replica (a router
        # that has not heard of the drain yet may still pick the drained one, which refuses: the
        # ingress then sends the request again, so that replica's count is not checked)
        wait_until(lambda: dashboard.decisions().get(other, 0) >= decided.get(other, 0) + len(outs),
                   f"the page's router decisions for {other} to grow by {len(outs)}")  # fmt: skip

        button.click()
        expect(card.locator("[data-testid=draining-badge]")).to_be_hidden()
        expect(button).to_have_text("Drain")
        wait_until(lambda: not replicas(admin)[drained]["draining"], f"{drained} to hear it is undrained")
    finally:
        # the server is shared with other tests: never leave a replica drained
        admin.post(f"/admin/api/replicas/{drained}/undrain")
    dashboard.check()


def test_abort_ends_a_running_stream(dashboard: Dashboard, client: openai.OpenAI, server: Server) -> None:
    page = dashboard.page
    started = threading.Event()
    seen: dict[str, Any] = {"id": None, "chunks": 0, "finish_reason": None, "error": None}

    def stream() -> None:
        try:
            chunks = client.completions.create(model=server.model, prompt="Count to one thousand: 1, 2, 3,",
                                               max_tokens=400, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})  # fmt: skip
            for chunk in chunks:
                seen["id"] = chunk.id
                started.set()
                if chunk.choices:
                    seen["chunks"] += 1
                    seen["finish_reason"] = chunk.choices[0].finish_reason or seen["finish_reason"]
        except Exception as e:  # reported below: the test thread asserts
            seen["error"] = repr(e)
        finally:
            started.set()

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    assert started.wait(60) and seen["id"], seen
    # the engine request of a completion's prompt k is "<completion id>-k"
    row = page.locator(f'[data-testid=request-row][data-request-id^="{seen["id"]}-"]')
    expect(row).to_have_count(1, timeout=WAIT_S * 1000)
    request_id = row.get_attribute("data-request-id")

    with page.expect_response(lambda r: r.url.endswith("/abort")) as reply:
        row.locator("[data-testid=abort-button]").click()
    assert reply.value.status == 200, reply.value.text()
    assert reply.value.json()["aborted"] is True
    thread.join(10)
    assert not thread.is_alive(), "the stream did not end within 10 s of the abort"
    assert seen["error"] is None, seen
    assert seen["finish_reason"] == "abort", seen
    assert seen["chunks"] < 400, seen
    expect(page.locator(f'[data-testid=request-row][data-request-id="{request_id}"]')).to_have_count(0)
    dashboard.check()
