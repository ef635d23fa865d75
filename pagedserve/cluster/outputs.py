"""What a request returns (vLLM's RequestOutput shape) and the incremental detokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None
    new_token_counts: list[int] = field(default_factory=list)  # per sample, tokens added this step


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam of ``LLM.beam_search`` (vLLM's shape): ``tokens`` and ``text`` hold the prompt too."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    """The best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


class IncrementalDetokenizer:
    """Text of a growing token sequence, emitted only in whole characters.

    vLLM's method: re-decode a short window of tokens before the new ones and emit what the
    window gained, unless it ends in U+FFFD (an incomplete UTF-8 sequence split across byte
    tokens), in which case wait for the next token.
    """

    __slots__ = ("tokenizer", "skip_special_tokens", "tokens", "prefix_offset", "read_offset", "text")

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:  # fmt: skip
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # A few prompt tokens give the first output token its context (leading spaces, merges).
        self.tokens: list[str] = tokenizer.convert_ids_to_tokens(
            prompt_token_ids[-6:], skip_special_tokens=skip_special_tokens
        )
        self.prefix_offset = max(len(self.tokens) - 5, 0)
        self.read_offset = len(self.tokens)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; returns the text it completed (possibly empty)."""
        new = self.tokenizer.convert_ids_to_tokens([token_id], skip_special_tokens=self.skip_special_tokens)
        if not new:
            return ""
        self.tokens.extend(new)
        to_string = self.tokenizer.convert_tokens_to_string
        prefix_text = to_string(self.tokens[self.prefix_offset : self.read_offset])
        new_text = to_string(self.tokens[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self.text += delta
        return delta


def find_stop_string(text: str, delta_len: int, stops: list[str]) -> tuple[str, int] | None:
    """The first stop string that ends inside the last ``delta_len`` characters: (stop, index)."""
    best: tuple[str, int] | None = None
    for stop in stops:
        # only occurrences that overlap the new text can be new
        idx = text.find(stop, max(0, len(text) - delta_len - len(stop) + 1))
        if idx != -1 and (best is None or idx < best[1]):
            best = (stop, idx)
    return best
