"""What a request returns (vLLM's RequestOutput shape) and the incremental detokenizer."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

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


# Logprobs can be -inf (a token the model rules out); JSON has no infinity, vLLM sends this instead.
MIN_LOGPROB = -9999.0


class OutputDeltas:
    """Turns one request's cumulative RequestOutputs into the small deltas sent to the ingress.

    A delta is {"outputs": [sample...], "finished", "num_prompt_tokens", "num_cached_tokens"} where
    each sample that changed is {"index", "text_start", "text", "token_ids", "logprobs",
    "finish_reason", "stop_reason"}: the receiver's text becomes ``text[:text_start] + text``
    (a stop string can cut text already sent here, so a delta may rewrite the tail), token ids and
    logprobs are the new ones only. A logprobs entry is [[token_id, logprob, rank], ...] with the
    sampled token first, then the top tokens by rank.
    """

    __slots__ = ("_tokens", "_texts", "_finished")

    def __init__(self) -> None:
        self._tokens: dict[int, int] = {}
        self._texts: dict[int, str] = {}
        self._finished: set[int] = set()

    def delta(self, out: RequestOutput) -> dict[str, Any]:
        samples = []
        for o in out.outputs:
            sent = self._tokens.get(o.index, 0)
            done = o.finish_reason is not None
            if len(o.token_ids) == sent and (not done or o.index in self._finished):
                continue
            old = self._texts.get(o.index, "")
            start = len(old) if o.text.startswith(old) else _common_prefix_len(old, o.text)
            samples.append({
                "index": o.index, "text_start": start, "text": o.text[start:],
                "token_ids": o.token_ids[sent:],
                "logprobs": None if o.logprobs is None else [_plain_logprobs(e) for e in o.logprobs[sent:]],
                "finish_reason": o.finish_reason, "stop_reason": o.stop_reason,
            })  # fmt: skip
            self._tokens[o.index] = len(o.token_ids)
            self._texts[o.index] = o.text
            if done:
                self._finished.add(o.index)
        return {"outputs": samples, "finished": out.finished, "num_prompt_tokens": len(out.prompt_token_ids),
                "num_cached_tokens": out.num_cached_tokens}  # fmt: skip


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _plain_logprobs(entry: dict[int, Any]) -> list[list[Any]]:
    return [[tid, clamp_logprob(lp.logprob), lp.rank] for tid, lp in entry.items()]


def clamp_logprob(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


def merge_deltas(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """One delta with the effect of applying ``first`` and then ``then`` (both of one request).

    A consumer that fell behind sends one message instead of several. Text follows the
    ``text_start`` rule: where ``then`` cuts into what ``first`` added, the cut wins.
    """
    merged = {s["index"]: dict(s) for s in first["outputs"]}
    for s in then["outputs"]:
        a = merged.get(s["index"])
        if a is None:
            merged[s["index"]] = dict(s)
            continue
        if s["text_start"] >= a["text_start"]:
            a["text"] = a["text"][: s["text_start"] - a["text_start"]] + s["text"]
        else:
            a["text_start"], a["text"] = s["text_start"], s["text"]
        a["token_ids"] = a["token_ids"] + s["token_ids"]
        if a["logprobs"] is not None or s["logprobs"] is not None:
            a["logprobs"] = (a["logprobs"] or []) + (s["logprobs"] or [])
        if s["finish_reason"] is not None:
            a["finish_reason"], a["stop_reason"] = s["finish_reason"], s["stop_reason"]
    return {**then, "outputs": list(merged.values())}
