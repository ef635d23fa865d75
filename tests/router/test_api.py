"""The OpenAI-compatible API end to end: a real served model (tests/router/conftest.py), the official
``openai`` client, and raw HTTP where the wire format itself is under test."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import defaultdict
from typing import Any

import httpx2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.router.conftest import Server

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server: Server) -> httpx2.Client:
    with httpx2.Client(
        base_url=server.base_url, headers={"Authorization": f"Bearer {server.api_key}"}, timeout=120
    ) as c:
        yield c


@pytest.fixture(scope="module")
def offline_llm():
    """The offline engine on the same model and dtype: the oracle for greedy output."""
    from pagedserve import LLM

    return LLM(max_model_len=512, kv_cache_memory=64 << 20, dtype="float32")


def sse_events(response: httpx2.Response) -> list[Any]:
    """The data payloads of a server-sent event stream; checks the stream ends with [DONE]."""
    lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


def metrics(http: httpx2.Client) -> dict[str, list[Any]]:
    """Metric family name -> its samples, parsed by prometheus_client's own parser."""
    text = http.get("/metrics").text
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def total(families: dict[str, list[Any]], name: str, sample: str | None = None) -> float:
    return sum(s.value for s in families[name] if s.name == (sample or name))


def wait_until_idle(http: httpx2.Client, timeout: float = 20.0) -> dict[str, list[Any]]:
    """Metrics once every replica runs nothing, waits for nothing and holds no KV block."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(http)
        usage = [s.value for s in m["pagedserve:kv_cache_usage_perc"]]
        busy = total(m, "pagedserve:num_requests_running") + total(m, "pagedserve:num_requests_waiting")
        free = [s.value for s in m["pagedserve:num_free_blocks"]]
        blocks = [s.value for s in m["pagedserve:num_gpu_blocks"]]
        if usage and busy == 0 and max(usage) == 0 and free == blocks:
            return m
        assert time.monotonic() < deadline, f"engine not idle: busy={busy} usage={usage} free={free}/{blocks}"
        time.sleep(0.2)


# ---- models, health -----------------------------------------------------------------------------


def test_models_and_health(client: openai.OpenAI, http: httpx2.Client, server: Server) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [server.model]
    assert http.get(f"/v1/models/{server.model}").json()["max_model_len"] == server.max_model_len
    assert http.get("/health").status_code == 200


# ---- greedy output equals the offline engine ---------------------------------------------------


def test_completion_greedy_equals_offline(client: openai.OpenAI, offline_llm, server: Server) -> None:
    from pagedserve import SamplingParams

    expected = offline_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    out = client.completions.create(model=server.model, prompt=PROMPT, temperature=0, max_tokens=24)
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == expected.finish_reason
    assert out.usage.completion_tokens == len(expected.token_ids)
    assert out.usage.prompt_tokens == len(offline_llm.get_tokenizer()(PROMPT).input_ids)


def test_chat_greedy_equals_offline(client: openai.OpenAI, offline_llm, server: Server) -> None:
    from pagedserve import SamplingParams

    expected = offline_llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=24))[0]
    out = client.chat.completions.create(model=server.model, messages=CHAT, temperature=0, max_tokens=24)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.outputs[0].text
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.completion_tokens == len(expected.outputs[0].token_ids)


# ---- beam search ----------------------------------------------------------------------------------


def hf_beam_texts(model_dir, tokenizer, prompt_ids: list[int], width: int, n: int, max_new: int) -> list[str]:
    from tests.cluster.test_beam_search import hf_beams

    beams = hf_beams(model_dir, prompt_ids, width, n, max_new, [tokenizer.eos_token_id])
    return [tokenizer.decode(b, skip_special_tokens=True) for b in beams]


def test_beam_search_over_http_equals_transformers(client: openai.OpenAI, offline_llm, server: Server,
                                                   smollm2_dir) -> None:  # fmt: skip
    """vLLM's extras through the official client: use_beam_search with best_of = the width (completions)
    or n (chat); the n best beams come back, equal to transformers' generate(num_beams=W)."""
    tok = offline_llm.get_tokenizer()
    out = client.completions.create(
        model=server.model, prompt=PROMPT, n=2, max_tokens=12,
        extra_body={"use_beam_search": True, "best_of": 4, "length_penalty": 1.0},
    )  # fmt: skip
    expected = hf_beam_texts(smollm2_dir, tok, tok(PROMPT).input_ids, 4, 2, 12)
    assert [c.text for c in out.choices] == expected
    assert [c.index for c in out.choices] == [0, 1]
    chat_ids = list(tok.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True)["input_ids"])
    chat = client.chat.completions.create(
        model=server.model, messages=CHAT, n=3, max_tokens=16, extra_body={"use_beam_search": True},
    )  # fmt: skip
    assert [c.message.content for c in chat.choices] == hf_beam_texts(smollm2_dir, tok, chat_ids, 3, 3, 16)
    assert chat.usage.completion_tokens > 0
    # Streaming sends the final beams only (beams change until the search ends): same texts.
    chunks = list(client.chat.completions.create(
        model=server.model, messages=CHAT, n=3, max_tokens=16, stream=True,
        extra_body={"use_beam_search": True},
    ))  # fmt: skip
    texts: dict[int, str] = defaultdict(str)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert [texts[i] for i in range(3)] == [c.message.content for c in chat.choices]


def test_beam_sharing_is_in_the_metrics(client: openai.OpenAI, http: httpx2.Client, server: Server) -> None:
    """The replicas count the beams' block-table entries and the distinct blocks behind them."""
    client.completions.create(model=server.model, prompt=PROMPT, n=4, max_tokens=24,
                              extra_body={"use_beam_search": True, "ignore_eos": True})  # fmt: skip
    deadline = time.monotonic() + 10
    while True:
        m = metrics(http)
        shared = total(m, "pagedserve:beam_kv_block_steps", "pagedserve:beam_kv_block_steps_total")
        name = "pagedserve:beam_kv_block_steps_unshared"
        unshared = total(m, name, f"{name}_total")
        if shared > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert 0 < shared < unshared  # beams shared blocks


# ---- streaming ------------------------------------------------------------------------------------


def test_completion_stream_equals_non_stream(client: openai.OpenAI, server: Server) -> None:
    whole = client.completions.create(model=server.model, prompt=PROMPT, temperature=0, max_tokens=20)
    chunks = list(
        client.completions.create(
            model=server.model,
            prompt=PROMPT,
            temperature=0,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_starts_with_role(client: openai.OpenAI, server: Server) -> None:
    whole = client.chat.completions.create(model=server.model, messages=CHAT, temperature=0, max_tokens=20)
    chunks = list(
        client.chat.completions.create(
            model=server.model,
            messages=CHAT,
            temperature=0,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == whole.choices[0].message.content
    )
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason


def test_raw_sse_wire_format(http: httpx2.Client, server: Server) -> None:
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert {e["object"] for e in events} == {"text_completion"}
    assert len({e["id"] for e in events}) == 1
    assert "usage" not in events[0]  # only with stream_options.include_usage
    assert events[-1]["choices"][0]["finish_reason"] == "length"


# ---- n, stop, logprobs, seeds -------------------------------------------------------------------


def test_n2_choices_are_indexed(client: openai.OpenAI, server: Server) -> None:
    out = client.completions.create(
        model=server.model,
        prompt=PROMPT,
        n=2,
        temperature=1.0,
        seed=3,
        max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.text and c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 16
    chunks = list(
        client.chat.completions.create(
            model=server.model,
            messages=CHAT,
            n=2,
            temperature=1.0,
            seed=3,
            max_tokens=8,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    texts: dict[int, str] = defaultdict(str)
    finishes: dict[int, list[str]] = defaultdict(list)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index].append(choice.finish_reason)
    assert sorted(texts) == [0, 1] and all(texts.values())
    assert all(len(f) == 1 for f in finishes.values()) and sorted(finishes) == [0, 1]


def test_stop_string_is_never_sent(client: openai.OpenAI, server: Server) -> None:
    kwargs = {"model": server.model, "prompt": PROMPT, "temperature": 0, "max_tokens": 32}
    full = client.completions.create(**kwargs).choices[0].text
    # A stop string starting mid-text and spanning tokens, so that streaming must hold text back.
    start = len(full) // 2
    stop = full[start : start + 5]
    expected = full[: full.index(stop)]
    out = client.completions.create(**kwargs, stop=[stop])
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stop=stop, stream=True))
    assert streamed == expected and stop not in streamed


def test_completion_logprobs(client: openai.OpenAI, server: Server) -> None:
    out = client.completions.create(
        model=server.model, prompt=PROMPT, temperature=0, max_tokens=12, logprobs=3
    )
    choice = out.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 1 <= len(top) <= 4
        assert top[token] == logprob == pytest.approx(max(top.values()))  # greedy picks the best


def test_chat_logprobs(client: openai.OpenAI, server: Server) -> None:
    out = client.chat.completions.create(
        model=server.model, messages=CHAT, temperature=0, max_tokens=12, logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for item in content:
        assert item.bytes == list(item.token.encode("utf-8"))
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)
    chunks = client.chat.completions.create(
        model=server.model,
        messages=CHAT,
        temperature=0,
        max_tokens=12,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    )
    streamed = [
        item for c in chunks if c.choices and c.choices[0].logprobs for item in c.choices[0].logprobs.content
    ]
    assert [(i.token, i.logprob) for i in streamed] == [(i.token, i.logprob) for i in content]


def test_seed_reproduces_sampled_text(client: openai.OpenAI, server: Server) -> None:
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model=server.model, prompt="Once upon a time", temperature=1.0, seed=seed, max_tokens=16
            )
            .choices[0]
            .text
        )

    first = sample(1234)
    assert sample(1234) == first
    assert {sample(1), sample(2), sample(3)} != {first}  # seeds actually change the samples


def test_batch_prompts_and_token_ids(client: openai.OpenAI, http: httpx2.Client, server: Server) -> None:
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_text = client.completions.create(
        model=server.model, prompt=[PROMPT, "Hello"], temperature=0, max_tokens=8
    )
    assert [c.index for c in by_text.choices] == [0, 1]
    assert (
        by_text.usage.prompt_tokens
        == len(ids) + http.post("/tokenize", json={"prompt": "Hello"}).json()["count"]
    )
    by_ids = client.completions.create(model=server.model, prompt=ids, temperature=0, max_tokens=8)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_cache_salt_separates_prefix_caches(client: openai.OpenAI, server: Server) -> None:
    messages = [{"role": "user", "content": "List the planets of the solar system, nearest first."}]

    def cached_tokens(salt: str | None = None) -> int:
        extra = {"cache_salt": salt} if salt else {}
        out = client.chat.completions.create(
            model=server.model, messages=messages, max_tokens=1, extra_body=extra
        )
        return out.usage.prompt_tokens_details.cached_tokens

    # Three requests on two replicas: two of them met on one replica, whatever the routing, and
    # the later of the two found the prompt's full blocks in its prefix cache.
    assert max(cached_tokens() for _ in range(3)) > 0
    salted = [cached_tokens("tenant-a") for _ in range(3)]
    assert salted[0] == 0  # no block anywhere carries this salt yet
    assert max(salted[1:]) > 0


# ---- errors ---------------------------------------------------------------------------------------

BAD_COMPLETIONS = [
    ({"temperature": -1}, "temperature", None),
    ({"top_p": 0}, "top_p", None),
    ({"n": 0}, "n", None),
    ({"n": "two"}, "n", None),
    ({"max_tokens": 0}, "max_tokens", None),
    ({"max_tokens": 600}, "max_tokens", "context_length_exceeded"),
    ({"logprobs": 21}, "logprobs", None),
    ({"stop": [""]}, "stop", None),
    ({"temperature": 0, "n": 2}, "n", None),
    ({"prompt": []}, "prompt", None),
    ({"prompt": [10**9]}, "prompt", None),
    ({"prompt": "x " * 1000}, "prompt", "context_length_exceeded"),
    ({"echo": True}, "echo", None),
    ({"best_of": 3}, "best_of", None),
    ({"use_beam_search": True, "best_of": 5}, "best_of", None),  # above --max-num-seqs 4
    ({"use_beam_search": True, "n": 3, "best_of": 2}, "best_of", None),
    ({"use_beam_search": True, "n": 2, "temperature": 0.7}, "temperature", None),
    ({"use_beam_search": True, "n": 2, "stop": ["."]}, "stop", None),
    ({"use_beam_search": True, "n": 2, "early_stopping": "sometimes"}, "early_stopping", None),
    ({"length_penalty": 0.5}, "length_penalty", None),
]
BAD_CHATS = [
    ({"messages": []}, "messages", None),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages", None),
    ({"top_logprobs": 3}, "top_logprobs", None),
    ({"logprobs": True, "top_logprobs": 30}, "top_logprobs", None),
    ({"max_completion_tokens": 1000}, "max_tokens", "context_length_exceeded"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", None),
]


def assert_openai_error(response: httpx2.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize(("fields", "param", "code"), BAD_COMPLETIONS)
def test_bad_completion_parameters(
    http: httpx2.Client, server: Server, fields: dict, param: str, code: str
) -> None:
    body = {"model": server.model, "prompt": PROMPT} | fields
    error = assert_openai_error(http.post("/v1/completions", json=body), 400, param)
    assert error["type"] == "invalid_request_error" and error["code"] == code


@pytest.mark.parametrize(("fields", "param", "code"), BAD_CHATS)
def test_bad_chat_parameters(
    http: httpx2.Client, server: Server, fields: dict, param: str, code: str
) -> None:
    body = {"model": server.model, "messages": CHAT} | fields
    error = assert_openai_error(http.post("/v1/chat/completions", json=body), 400, param)
    assert error["code"] == code


def test_errors_through_the_openai_client(client: openai.OpenAI, server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=server.model, messages=CHAT, temperature=-1)
    assert bad.value.status_code == 400 and bad.value.param == "temperature"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-4", prompt=PROMPT)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):  # an error before streaming starts keeps its status
        list(client.completions.create(model=server.model, prompt=PROMPT, max_tokens=600, stream=True))


def test_malformed_unknown_and_oversized_requests(http: httpx2.Client) -> None:
    bad_json = http.post(
        "/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"}
    )
    assert_openai_error(bad_json, 400)
    assert_openai_error(http.get("/v1/nothing"), 404)
    assert_openai_error(http.get("/v1/completions"), 405)
    huge = json.dumps({"prompt": "a" * (9 << 20)}).encode()
    error = assert_openai_error(http.post("/v1/completions", content=huge), 413)
    assert error["code"] == "request_too_large"


HOSTILE = [
    # (what, request body bytes or JSON, expected status, param)
    ("invalid UTF-8", b'{"prompt": "' + bytes([0xFF, 0xFE]) + b' ok", "max_tokens": 2}', 400, None),
    ("nested 10,000 deep", b'{"prompt": ' + b"[" * 10000 + b"]" * 10000 + b"}", 400, None),
    ("a million prompt token ids", {"prompt": [1] * 1_000_000, "max_tokens": 1}, 400, None),
    ("n above the limit", {"prompt": "hi", "n": 129}, 400, "n"),
    ("absurd max_tokens", {"prompt": "hi", "max_tokens": 10**12}, 400, "max_tokens"),
    ("stop of the wrong type", {"prompt": "hi", "stop": {"a": 1}}, 400, "stop"),
    ("too many stop strings", {"prompt": "hi", "stop": [str(i) for i in range(1000)]}, 400, "stop"),
    ("top_p above 1", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("a float where an int goes", {"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens"),
    ("no prompt at all", {"max_tokens": 2}, 400, "prompt"),
]


@pytest.mark.parametrize(("what", "body", "status", "param"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_completion_bodies(http: httpx2.Client, server: Server, what: str, body: Any, status: int,
                                   param: str | None) -> None:  # fmt: skip
    if isinstance(body, dict):
        body = json.dumps({"model": server.model, **body}).encode()
    response = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_openai_error(response, status, param)
    ok = http.post("/v1/completions", json={"model": server.model, "prompt": PROMPT, "max_tokens": 2})
    assert ok.status_code == 200, ok.text  # the next valid request is served
    wait_until_idle(http)


def test_500_streams_never_read_get_backpressure_and_the_server_stays_up(http: httpx2.Client,
                                                                         server: Server) -> None:  # fmt: skip
    """500 raw connections each send a streamed request and never read a byte: the replicas take
    what their queues hold and refuse the rest (503), a normal request is still served meanwhile,
    and once the clients leave every block comes back."""
    import socket

    host, port = server.base_url.removeprefix("http://").split(":")
    body = json.dumps({"model": server.model, "prompt": PROMPT, "max_tokens": 64, "stream": True,
                       "ignore_eos": True}).encode()  # fmt: skip
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {server.api_key}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    socks = []
    try:
        for _ in range(500):
            s = socket.create_connection((host, int(port)), timeout=10)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.sendall(request)
            socks.append(s)
        time.sleep(2)
        ok = http.post("/v1/completions", json={"model": server.model, "prompt": PROMPT, "max_tokens": 2})
        assert ok.status_code in (200, 503), ok.text
        if ok.status_code == 503:
            assert int(ok.headers["retry-after"]) >= 1
    finally:
        for s in socks:
            s.close()
    wait_until_idle(http)
    ok = http.post("/v1/completions", json={"model": server.model, "prompt": PROMPT, "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_cors_is_off_and_the_api_key_is_never_logged(server: Server, http: httpx2.Client) -> None:
    """No CORS headers for a browser's cross-origin request (none is configured), and the API key,
    sent right and wrong, appears in no log of the session (Serve's access and replica logs)."""
    import os
    from pathlib import Path

    origin = {"Origin": "https://evil.example"}
    r = http.post("/v1/completions", json={"model": server.model, "prompt": PROMPT, "max_tokens": 2},
                  headers=origin)  # fmt: skip
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    pre = http.options("/v1/completions", headers=origin | {"Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in pre.headers
    wrong = "sk-WRONG-" + "x" * 20
    bad = httpx2.post(f"{server.base_url}/v1/models", headers={"Authorization": f"Bearer {wrong}"})
    assert bad.status_code == 401 and wrong not in bad.text
    time.sleep(1)  # log lines are flushed by the replicas and the proxy
    logs = Path(os.environ["RAY_TMPDIR"]) / "session_latest" / "logs"
    files = [f for f in logs.rglob("*") if f.is_file()]
    assert any("serve" in str(f) for f in files), "no Serve log found to check"
    logged_requests = 0
    for f in files:
        text = f.read_bytes()
        assert server.api_key.encode() not in text and wrong.encode() not in text, f"a key is in {f}"
        logged_requests += text.count(b"/v1/models")
    assert logged_requests > 0, "the requests must be in the access logs, else this proves nothing"


def test_a_lost_state_actor_is_rebuilt_with_every_replicas_cache(server: Server, http: httpx2.Client) -> None:
    """Kill the named state actor: requests keep succeeding (routing never waits on it), the
    replicas make it afresh, notice its new epoch and resend their whole prefix cache, so the new
    log again knows which replica holds a prompt cached before the loss."""
    import ray

    from pagedserve.cluster.hashing import hash_blocks
    from pagedserve.router.state import NAMESPACE, STATE_ACTOR_NAME

    prompt = "The history of paged memory in operating systems begins with " * 6
    body = {"model": server.model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    assert http.post("/v1/completions", json=body).status_code == 200
    tokens = http.post("/tokenize", json={"model": server.model, "prompt": prompt}).json()["tokens"]
    hashes = set(hash_blocks(tokens, 16)[: len(tokens) // 16])
    assert hashes

    def holders() -> list[str]:
        actor = ray.get_actor(STATE_ACTOR_NAME, namespace=NAMESPACE)
        snapshot = ray.get(actor.poll.remote(0, None))["snapshot"]
        return [rid for rid, held in snapshot.items() if hashes <= set(held)]

    deadline = time.monotonic() + 10
    while not holders():
        assert time.monotonic() < deadline, "the state log never learned the cached prompt"
        time.sleep(0.2)
    ray.kill(ray.get_actor(STATE_ACTOR_NAME, namespace=NAMESPACE), no_restart=True)
    for i in range(4):  # served meanwhile
        r = http.post("/v1/completions", json=body | {"prompt": f"Another request {i}"})
        assert r.status_code == 200, r.text
    deadline = time.monotonic() + 20
    while True:
        try:
            if holders():
                break
        except (ValueError, ray.exceptions.RayActorError):  # not made afresh yet
            pass
        assert time.monotonic() < deadline, "the rebuilt state log does not know the cached prompt"
        time.sleep(0.3)
    time.sleep(1.5)  # and the routers with their next poll (every second while idle: app.PUBLISH_IDLE_S)
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_api_key_is_required(server: Server) -> None:
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 1}
    with httpx2.Client(base_url=server.base_url, timeout=60) as anonymous:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": server.api_key}):
            for path in ("/v1/completions", "/tokenize"):
                response = anonymous.post(path, json=body, headers=headers)
                assert assert_openai_error(response, 401)["code"] == "invalid_api_key"
            assert_openai_error(anonymous.get("/v1/models", headers=headers), 401)
        assert anonymous.get("/health").status_code == 200
        assert anonymous.get("/metrics").status_code == 200
    wrong = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


# ---- tokenizer ------------------------------------------------------------------------------------


def test_tokenize_detokenize_round_trip(http: httpx2.Client, client: openai.OpenAI, server: Server) -> None:
    text = "Paged attention keeps the KV cache in blocks. ✓"
    tokens = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"])
    assert tokens["max_model_len"] == server.max_model_len
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": text}
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    usage = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens
    assert_openai_error(http.post("/detokenize", json={"tokens": [-1]}), 400, "tokens")


# ---- disconnects, overload, metrics ------------------------------------------------------------------


def test_disconnect_aborts_and_frees_blocks(http: httpx2.Client, server: Server) -> None:
    before = total(
        wait_until_idle(http), "pagedserve:generation_tokens", "pagedserve:generation_tokens_total"
    )
    body = {
        "model": server.model,
        "prompt": "Write a long story.",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        received = 0
        for line in response.iter_lines():
            received += line.startswith("data: ")
            if received == 3:
                break  # leave with ~400 tokens still to generate
    # Replicas publish their figures every ~0.1 s, and three tokens can take less than that: an idle
    # snapshot may predate this request. Wait for one that counts the tokens the client received.
    deadline = time.monotonic() + 15
    while True:
        after = wait_until_idle(http, timeout=15)
        counted = total(after, "pagedserve:generation_tokens", "pagedserve:generation_tokens_total")
        generated = counted - before
        if generated >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert 3 <= generated < 400  # the request was aborted, not run to the end


def test_overload_gets_503_with_retry_after(server: Server, http: httpx2.Client) -> None:
    # 2 replicas x (4 running + 2 waiting) + 4 queued at the handle: 24 at once cannot all be taken.
    async def flood() -> list[httpx2.Response]:
        headers = {"Authorization": f"Bearer {server.api_key}"}
        async with httpx2.AsyncClient(base_url=server.base_url, headers=headers, timeout=120) as c:
            body = {"model": server.model, "max_tokens": 24, "ignore_eos": True, "temperature": 0}
            return await asyncio.gather(
                *(c.post("/v1/completions", json=body | {"prompt": f"Story {i}:"}) for i in range(24))
            )

    responses = asyncio.run(flood())
    statuses = [r.status_code for r in responses]
    assert set(statuses) == {200, 503}, statuses
    for r in responses:
        if r.status_code == 503:
            assert int(r.headers["retry-after"]) >= 1
            assert assert_openai_error(r, 503)["code"] == "server_overloaded"
        else:
            assert r.json()["usage"]["completion_tokens"] == 24
    wait_until_idle(http)


@pytest.mark.timeout(2 * int(float(os.environ.get("PAGEDSERVE_OVERLOAD_S", "12"))) + 600)
def test_open_loop_overload_is_shed_and_served_requests_finish(server: Server, http: httpx2.Client) -> None:
    """Open-loop Poisson arrivals at 2x, then 5x, the measured capacity (a short version of the
    reliability run; ``PAGEDSERVE_OVERLOAD_S`` sets each load's seconds, ``make
    test-reliability`` holds each for 3 minutes): every answer is a 200 with all its tokens or a
    503 with Retry-After sent at once; nothing else; the queues stay bounded; resident memory of
    the serving processes stays bounded; afterwards every block is free."""
    import random

    from tests.router.conftest import rss_mb

    body = {"model": server.model, "max_tokens": 16, "ignore_eos": True, "temperature": 0}
    headers = {"Authorization": f"Bearer {server.api_key}"}

    async def run(rate: float, seconds: float, seed: int) -> list[tuple[int, float, str | None]]:
        rng = random.Random(seed)
        async with httpx2.AsyncClient(base_url=server.base_url, headers=headers, timeout=120) as c:

            async def one(i: int) -> tuple[int, float, str | None]:
                start = time.monotonic()
                r = await c.post("/v1/completions", json=body | {"prompt": f"Item {seed}-{i}:"})
                tokens = r.json()["usage"]["completion_tokens"] if r.status_code == 200 else None
                return r.status_code, time.monotonic() - start, r.headers.get("retry-after") or tokens

            tasks, t, i = [], 0.0, 0
            while t < seconds:  # arrivals do not wait for answers (open loop)
                tasks.append(asyncio.ensure_future(one(i)))
                gap = rng.expovariate(rate)
                t += gap
                i += 1
                await asyncio.sleep(gap)
            return await asyncio.gather(*tasks)

    # capacity: 8 requests at once (what the two replicas run), completions per second
    start = time.monotonic()
    warm = asyncio.run(run(1000.0, 0.008, 0))
    capacity = len(warm) / (time.monotonic() - start)
    hold = os.environ.get("PAGEDSERVE_OVERLOAD_S")
    rss_before = rss_mb()
    for factor, seconds in ((2, float(hold or 12.0)), (5, float(hold or 8.0))):
        results = asyncio.run(run(factor * capacity, seconds, factor))
        statuses = {status for status, _, _ in results}
        assert statuses <= {200, 503}, statuses
        admitted = [(lat, extra) for status, lat, extra in results if status == 200]
        rejected = [(lat, extra) for status, lat, extra in results if status == 503]
        assert admitted and all(extra == 16 for _, extra in admitted)
        assert all(int(extra) >= 1 for _, extra in rejected)
        if rejected:
            assert sorted(lat for lat, _ in rejected)[len(rejected) // 2] < 1.0  # shed at once
        lat = sorted(lat for lat, _ in admitted)
        print(f"\n{factor}x capacity ({factor * capacity:.1f} req/s offered for {seconds:.0f} s): "
              f"{len(results)} sent, {len(admitted)} served ({len(admitted) / seconds:.2f} req/s goodput), "
              f"reject rate {len(rejected) / len(results):.0%}, "
              f"p99 latency of served {lat[int(0.99 * (len(lat) - 1))]:.2f} s")  # fmt: skip
    wait_until_idle(http, timeout=60)
    growth = {k: rss_mb().get(k, v) - v for k, v in rss_before.items()}
    print("RSS growth under overload (MB): " + ", ".join(f"{k} {v:+.0f}" for k, v in sorted(growth.items())))
    assert all(g < 300 for g in growth.values()), growth  # bounded: queues, not memory, absorb the excess


def test_metrics_parse_and_count(http: httpx2.Client, server: Server) -> None:
    # a streamed request of its own, so that the figures do not depend on the tests before
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 8, "stream": True, "temperature": 0}
    for _ in range(2):
        with http.stream("POST", "/v1/completions", json=body) as response:
            sse_events(response)
    time.sleep(0.5)  # the replicas publish their figures within 0.25 s of a request's end
    m = metrics(http)
    for name in (
        "pagedserve:num_requests_running",
        "pagedserve:num_requests_waiting",
        "pagedserve:kv_cache_usage_perc",
        "pagedserve:prefix_cache_queries",
        "pagedserve:prefix_cache_hits",
        "pagedserve:num_preemptions",
        "pagedserve:prompt_tokens",
        "pagedserve:generation_tokens",
        "pagedserve:time_to_first_token_seconds",
        "pagedserve:inter_token_latency_seconds",
        "pagedserve:e2e_request_latency_seconds",
        "pagedserve:router_decisions",
    ):
        assert name in m, name
    assert len({s.labels["replica"] for s in m["pagedserve:num_requests_running"]}) == 2
    assert total(m, "pagedserve:generation_tokens", "pagedserve:generation_tokens_total") > 0
    assert total(m, "pagedserve:prefix_cache_queries", "pagedserve:prefix_cache_queries_total") > 0
    # the same prompt was sent many times: some of it came from the prefix cache
    assert total(m, "pagedserve:prefix_cache_hits", "pagedserve:prefix_cache_hits_total") > 0
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert total(m, f"pagedserve:{name}", f"pagedserve:{name}_count") > 0
    # engine step time by phase: every generated token took a step, and steps took model time
    steps = total(m, "pagedserve:engine_steps", "pagedserve:engine_steps_total")
    assert steps >= 8, steps
    model_s = total(m, "pagedserve:engine_step_model_seconds", "pagedserve:engine_step_model_seconds_total")
    assert 0 < model_s < steps * 10, (model_s, steps)
    decisions = {
        (s.labels["policy"], s.labels["outcome"]): s.value
        for s in m["pagedserve:router_decisions"]
        if s.name.endswith("_total")
    }
    assert decisions and all(policy == "prefix" for policy, _ in decisions)
