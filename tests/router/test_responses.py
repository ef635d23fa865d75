"""Response assembly without a server: the stop-string hold-back and the logprob shapes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pagedserve.cluster.outputs import CompletionOutput, RequestOutput, find_stop_string
from pagedserve.router.protocol import OutputDeltas
from pagedserve.router.responses import Choice, chat_logprobs, completion_logprobs


def output(text: str, num_tokens: int, finish: str | None) -> RequestOutput:
    sample = CompletionOutput(0, text, list(range(num_tokens)), None, None, finish, None)
    return RequestOutput("r", None, [1, 2, 3], [sample], finished=finish is not None)


# ---- stop strings are held back -----------------------------------------------------------------------


@given(
    pieces=st.lists(st.text(alphabet="ab c", min_size=0, max_size=3), min_size=1, max_size=30),
    stop=st.text(alphabet="ab c", min_size=1, max_size=4),
)
def test_held_back_text_never_sends_a_stop_string(pieces: list[str], stop: str) -> None:
    """Engine side as pagedserve/cluster/engine.py: text grows by detokenized pieces and is cut
    at a stop string ending in the newest piece. Whatever is streamed must stay a prefix of the
    final text, which holds no stop string."""
    deltas, choice = OutputDeltas(), Choice(0)
    text, streamed, finish = "", "", None
    for i, piece in enumerate(pieces):
        text += piece
        hit = find_stop_string(text, len(piece), [stop]) if piece else None
        if hit is not None:
            text, finish = text[: hit[1]], "stop"
        elif i == len(pieces) - 1:
            finish = "length"
        for s in deltas.delta(output(text, i + 1, finish))["outputs"]:
            choice.apply(s)
        streamed += choice.release_text(len(stop) - 1)
        assert text.startswith(streamed)
        if finish:
            break
    assert streamed == text and stop not in streamed


# ---- logprob shapes ---------------------------------------------------------------------------------------

TEXTS = {1: "A", 2: "B", 3: "C", 4: "A"}
ENTRIES = [
    [[3, -2.0, 3], [1, -0.5, 1], [2, -1.0, 2], [3, -2.0, 3]],  # sampled token ranked third
    [[1, -0.1, 1], [1, -0.1, 1], [4, -0.2, 2]],  # ids 1 and 4 decode alike
]


def test_completion_logprobs_shape() -> None:
    out, offset = completion_logprobs(ENTRIES, 2, TEXTS.__getitem__, 10)
    assert out["tokens"] == ["C", "A"] and out["token_logprobs"] == [-2.0, -0.1]
    assert out["text_offset"] == [10, 11] and offset == 12
    assert out["top_logprobs"][0] == {"A": -0.5, "B": -1.0, "C": -2.0}  # the top 2 and the sampled one
    assert out["top_logprobs"][1] == {"A": -0.1}  # the sampled token's own figure wins


def test_chat_logprobs_shape() -> None:
    content = chat_logprobs(ENTRIES[:1], 2, TEXTS.__getitem__)
    assert content == [
        {
            "token": "C",
            "logprob": -2.0,
            "bytes": [67],
            "top_logprobs": [
                {"token": "A", "logprob": -0.5, "bytes": [65]},
                {"token": "B", "logprob": -1.0, "bytes": [66]},
            ],
        }
    ]
