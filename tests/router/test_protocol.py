"""The wire format without a server: request models, engine deltas, stop hold-back, logprob shapes."""

from __future__ import annotations

import pytest

from pagedserve.cluster.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.router.protocol import (
    MIN_LOGPROB,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    OpenAIError,
    OutputDeltas,
    overloaded,
)
from pagedserve.router.responses import Choice
from pagedserve.sampling import SamplingParamsError


def output(samples: list[CompletionOutput], finished: bool = False) -> RequestOutput:
    return RequestOutput("r", None, [1, 2, 3], samples, finished=finished, num_cached_tokens=2)


def sample(
    index: int, text: str, ids: list[int], finish: str | None = None, logprobs=None
) -> CompletionOutput:
    return CompletionOutput(index, text, ids, None, logprobs, finish, None)


# ---- requests -------------------------------------------------------------------------------------


def test_completion_request_maps_to_sampling_params() -> None:
    req = CompletionRequest(
        prompt="hi",
        temperature=0.5,
        top_p=0.9,
        n=2,
        stop="\n",
        seed=7,
        top_k=5,
        min_p=0.1,
        repetition_penalty=1.1,
        min_tokens=1,
        ignore_eos=True,
        logprobs=2,
    )
    params = req.sampling_params(req.max_tokens, req.logprobs)
    assert (params.temperature, params.top_p, params.n, params.stop, params.seed) == (0.5, 0.9, 2, ["\n"], 7)
    assert (params.top_k, params.min_p, params.repetition_penalty) == (5, 0.1, 1.1)
    assert (params.min_tokens, params.ignore_eos, params.logprobs, params.max_tokens) == (1, True, 2, 16)
    defaults = CompletionRequest(prompt="hi").sampling_params(None, None)
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_tokens) == (1.0, 1.0, 0, None)


def test_bad_sampling_values_name_their_parameter() -> None:
    with pytest.raises(SamplingParamsError) as exc:
        CompletionRequest(prompt="hi", presence_penalty=3).sampling_params(16, None)
    assert exc.value.param == "presence_penalty"


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        (CompletionRequest(prompt="x", echo=True), "echo"),
        (CompletionRequest(prompt="x", suffix="y"), "suffix"),
        (CompletionRequest(prompt="x", best_of=2), "best_of"),
        (CompletionRequest(prompt="x", logit_bias={"1": 5.0}), "logit_bias"),
        (
            ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=[{"type": "function"}]),
            "tools",
        ),
        (
            ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tool_choice="auto"),
            "tool_choice",
        ),
        (ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_logprobs=2), "top_logprobs"),
        (
            ChatCompletionRequest(
                messages=[{"role": "user", "content": "x"}], response_format={"type": "json_object"}
            ),
            "response_format",
        ),
    ],
)
def test_unsupported_fields_are_rejected(request_, param: str) -> None:
    with pytest.raises(OpenAIError) as exc:
        request_.check_supported()
    assert exc.value.status == 400 and exc.value.param == param


def test_chat_messages_become_template_messages() -> None:
    parts = ChatMessage(role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])
    assert parts.as_template_message() == {"role": "user", "content": "ab"}
    assert ChatMessage(role="developer", content="be brief").as_template_message()["role"] == "system"
    with pytest.raises(OpenAIError):
        ChatMessage(role="user", content=[{"type": "image_url"}]).as_template_message()
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=True)
    assert req.num_logprobs == 0
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]).num_logprobs is None


def test_errors_round_trip_between_processes() -> None:
    err = overloaded("busy")
    back = OpenAIError.from_dict(err.to_dict())
    assert (back.status, back.code, back.headers["Retry-After"]) == (503, "server_overloaded", "1")
    assert back.body() == {
        "error": {"message": "busy", "type": "server_error", "param": None, "code": "server_overloaded"}
    }
    assert OpenAIError(400, "m", param="n").body()["error"]["type"] == "invalid_request_error"


# ---- engine deltas ----------------------------------------------------------------------------------


def test_deltas_carry_only_what_changed() -> None:
    deltas = OutputDeltas()
    first = deltas.delta(output([sample(0, "Hel", [5]), sample(1, "", [])]))
    assert first["outputs"] == [
        {
            "index": 0,
            "text_start": 0,
            "text": "Hel",
            "token_ids": [5],
            "logprobs": None,
            "finish_reason": None,
            "stop_reason": None,
        }
    ]
    assert (first["num_prompt_tokens"], first["num_cached_tokens"], first["finished"]) == (3, 2, False)
    second = deltas.delta(output([sample(0, "Hello wor", [5, 6, 7]), sample(1, "A", [9])]))
    assert [(o["index"], o["text_start"], o["text"], o["token_ids"]) for o in second["outputs"]] == [
        (0, 3, "lo wor", [6, 7]),
        (1, 0, "A", [9]),
    ]
    # a stop string cut text already sent: the delta rewrites the tail
    third = deltas.delta(
        output([sample(0, "Hello", [5, 6, 7, 8], "stop"), sample(1, "A", [9], "length")], True)
    )
    assert [(o["text_start"], o["text"], o["finish_reason"]) for o in third["outputs"]] == [
        (5, "", "stop"),
        (1, "", "length"),
    ]
    # finished samples are reported once
    assert (
        deltas.delta(output([sample(0, "Hello", [5, 6, 7, 8], "stop"), sample(1, "A", [9], "length")], True))[
            "outputs"
        ]
        == []
    )


def test_deltas_rebuild_the_engine_text() -> None:
    texts = ["a", "ab", "abc d", "abc de", "abc", "abc"]
    deltas, choice = OutputDeltas(), Choice(0)
    for i, text in enumerate(texts):
        for s in deltas.delta(output([sample(0, text, list(range(i + 1)), "stop" if i == 5 else None)]))[
            "outputs"
        ]:
            choice.apply(s)
        assert choice.text == text
    assert choice.token_ids == list(range(6)) and choice.finish_reason == "stop"


def test_logprobs_are_plain_and_finite() -> None:
    entry = {7: Logprob(-0.5, 1), 3: Logprob(float("-inf"), 2)}
    d = OutputDeltas().delta(output([sample(0, "x", [7], logprobs=[entry])]))
    assert d["outputs"][0]["logprobs"] == [[[7, -0.5, 1], [3, MIN_LOGPROB, 2]]]
