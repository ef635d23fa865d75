"""The HTTP API fuzzed from its own OpenAPI schema with schemathesis: every operation gets generated
requests that fit the schema (positive) and requests that break it (negative: wrong types,
missing fields, values out of range), and must never answer 5xx or hang. The app is the real
FastAPI app with SmolLM2's tokenizer; the engine behind it is a stand-in that checks what reaches
it, so a request the API should have refused (parameters SamplingParams rejects, token ids
outside the vocabulary, a prompt plus output past the context) fails as a 500 here.
``PAGEDSERVE_SCHEMA_EXAMPLES`` sets the examples per operation and mode (30 by default;
``make test-reliability`` runs 300).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from pagedserve.router.api import ModelInfo, build_api
from pagedserve.router.metrics import IngressMetrics
from pagedserve.sampling import SamplingParams

MAX_MODEL_LEN = 512
EXAMPLES = int(os.environ.get("PAGEDSERVE_SCHEMA_EXAMPLES", "30"))


class ValidatingEngine:
    """Answers each request with n finished samples after checking it is one the engine can run."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.requests = 0

    async def generate(self, request: dict[str, Any]):
        params = SamplingParams.from_dict(request["params"])  # raises on what the API should refuse
        ids = request["prompt_token_ids"]
        assert ids and all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids), ids[:8]
        # max_tokens None: up to the context (chat without a limit)
        assert len(ids) + (params.max_tokens or 1) <= MAX_MODEL_LEN, (len(ids), params.max_tokens)
        self.requests += 1
        outputs = [{"index": k, "text_start": 0, "text": " ok", "token_ids": [28],
                    "logprobs": [[[28, -0.1, 1]]] if params.logprobs is not None else None,
                    "finish_reason": "length", "stop_reason": None} for k in range(params.n)]  # fmt: skip
        yield {"outputs": outputs, "finished": True, "num_prompt_tokens": len(ids), "num_cached_tokens": 0}

    async def engine_health(self) -> None:
        return None

    async def render_metrics(self) -> bytes:
        return b"# no metrics here\n"


def api_schema(smollm2_dir: Path):
    from pagedserve.worker.loader import load_config, load_tokenizer

    tokenizer = load_tokenizer(smollm2_dir)
    vocab = load_config(smollm2_dir).vocab_size
    model = ModelInfo("smollm2", str(smollm2_dir), MAX_MODEL_LEN, 16, vocab)
    app = build_api(model, tokenizer, ValidatingEngine(vocab), IngressMetrics("smollm2"))
    return schemathesis.openapi.from_asgi("/openapi.json", app)


def check(case, statuses: dict) -> None:
    response = case.call(timeout=30)
    key = (case.path, response.status_code)
    statuses[key] = statuses.get(key, 0) + 1
    assert response.status_code < 500, (case.method, case.path, response.status_code, response.text[:500])
    if response.status_code >= 400 and "json" in response.headers.get("content-type", ""):
        error = response.json()["error"]  # OpenAI's error shape, with a message saying what was wrong
        assert error["message"] and error["type"], error


@pytest.mark.timeout(1800)
def test_no_operation_answers_5xx(smollm2_dir: Path) -> None:
    schema = api_schema(smollm2_dir)
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"} <= paths, paths
    statuses: dict[tuple[str, int], int] = {}
    for op, mode in [(op, mode) for op in operations for mode in GenerationMode]:
        if mode is GenerationMode.NEGATIVE and not (op.body or op.query or op.path_parameters):
            continue  # nothing to break: an operation without parameters or body

        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])  # fmt: skip
        def fuzz(case) -> None:
            check(case, statuses)

        try:
            fuzz()
        except Unsatisfiable:  # nothing to break: an operation without parameters or body
            assert mode is GenerationMode.NEGATIVE and not op.body and not op.query, op.path
    print("\n" + ", ".join(f"{p} {code}: {n}" for (p, code), n in sorted(statuses.items())))
    # the fuzz reached the engine, not only the validation: some generated requests were served
    assert statuses.get(("/v1/completions", 200), 0) > 0, statuses
