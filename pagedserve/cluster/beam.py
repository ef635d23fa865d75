"""Beam search's decisions, with transformers' rules: which beams live on, which hypotheses finish.

The engine keeps a beam group's live beams as requests whose block tables share blocks (a beam
that continues from a parent forks the parent's table; copy-on-write covers the partly filled
last block). Each step every live beam's worker row returns its best ``num_candidates`` tokens
and their log-softmax; ``BeamSearch.advance`` then does what ``generate(num_beams=W)`` does in
one iteration, in the same float32 arithmetic so the choices are the same:

- the group's best K candidates over all beams, K = max(2, 1 + number of stop tokens) x W, by
  beam score + token logprob (a beam's own best K hold every candidate of the group's best K);
- among them the first W that do not stop become the live beams;
- a candidate among the first W that stops (a stop token, or the length limit) is a finished
  hypothesis scored sum(logprobs) / generated_length ** length_penalty; W hypotheses are kept;
- the search ends when the length limit is reached, when ``early_stopping=True`` and W
  hypotheses are done, or when no live beam can still beat the worst kept hypothesis (with
  ``early_stopping=False`` judged at the current length; with ``"never"`` and a positive length
  penalty at the length limit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.sampling import SamplingParams, beam_stop_token_ids, num_beam_candidates


@dataclass(slots=True)
class Hypothesis:
    """A finished beam: its generated tokens and transformers' length-penalized score."""

    score: float
    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: str  # "stop" (a stop token ended it) or "length"
    stop_reason: int | None = None  # the stop token id, when it was not an EOS


@dataclass(slots=True)
class Continuation:
    """A live beam of the next step: ``parent`` (index into the beams passed in) plus ``token``."""

    parent: int
    token_id: int
    score: float  # sum of the logprobs of its generated tokens (float32 arithmetic)


class BeamSearch:
    """One group's beam-search state: its finished hypotheses and whether it may still improve."""

    def __init__(self, params: SamplingParams, eos_token_ids: Sequence[int], max_tokens: int) -> None:
        self.width = params.width
        self.num_candidates = num_beam_candidates(params, eos_token_ids)
        self.length_penalty = params.length_penalty
        self.early_stopping = params.early_stopping
        self.stop_ids = beam_stop_token_ids(params, eos_token_ids)
        self.eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.max_tokens = max_tokens
        self.hypotheses: list[Hypothesis] = []  # best first, at most `width`
        self.improvable = True  # transformers' is_early_stop_heuristic_unsatisfied
        self.done = False

    def advance(
        self,
        outputs: Sequence[Sequence[int]],
        scores: Sequence[float],
        candidates: Sequence[tuple[Sequence[int], Sequence[float]]],
    ) -> list[Continuation]:
        """One step. ``outputs[i]``/``scores[i]``: beam i's generated tokens and score (beams best
        first, all of one length); ``candidates[i]``: its top token ids and logprobs, best first.
        Returns the live beams of the next step, best first (none once ``done``)."""
        assert not self.done, "advance() after the search ended"
        width = self.width
        gen_len = len(outputs[0]) + 1  # generated length once this step's token is appended
        ids = torch.tensor([list(c[0]) for c in candidates], dtype=torch.int64)
        logprobs = torch.tensor([list(c[1]) for c in candidates], dtype=torch.float32)
        running = torch.tensor(list(scores), dtype=torch.float32)
        per_beam = ids.shape[1]
        accumulated = (logprobs + running[:, None]).flatten()
        top_values, top_index = accumulated.topk(min(self.num_candidates, accumulated.numel()))
        penalized = top_values / (gen_len**self.length_penalty)
        values, positions, finals = top_values.tolist(), top_index.tolist(), penalized.tolist()
        flat_ids = ids.flatten().tolist()
        at_limit = gen_len >= self.max_tokens
        # Whether finished candidates may still enter: not once W are kept with early_stopping,
        # nor after the heuristic said no live beam can improve on them.
        accepting = self.improvable and not (self.early_stopping is True and len(self.hypotheses) == width)
        new_hypotheses: list[Hypothesis] = []
        live: list[Continuation] = []
        for rank, (value, position, final) in enumerate(zip(values, positions, finals)):
            parent, token = position // per_beam, flat_ids[position]
            stops = token in self.stop_ids
            if stops or at_limit:
                if accepting and rank < width:
                    tokens = [*outputs[parent], token]
                    reason = "stop" if stops else "length"
                    stop_reason = token if stops and token not in self.eos_token_ids else None
                    new_hypotheses.append(Hypothesis(final, tokens, value, reason, stop_reason))
            elif len(live) < width:
                live.append(Continuation(parent, token, value))
        if new_hypotheses:
            # transformers keeps the best W of the kept and the new (kept first on equal scores)
            merged = self.hypotheses + new_hypotheses
            merged.sort(key=lambda h: h.score, reverse=True)
            self.hypotheses = merged[:width]
        full = len(self.hypotheses) == width
        if full and live:
            if self.early_stopping == "never" and self.length_penalty > 0.0:
                best_length = self.max_tokens
            else:
                best_length = gen_len
            best_possible = torch.tensor([live[0].score], dtype=torch.float32) / (
                best_length**self.length_penalty
            )
            worst = min(h.score for h in self.hypotheses)
            self.improvable = self.improvable and bool(best_possible[0] > worst)
        self.done = (
            at_limit
            or not live
            or not self.improvable
            or (self.early_stopping is True and full)
        )
        return [] if self.done else live

    def best(self, n: int) -> list[Hypothesis]:
        """The n best finished hypotheses (all the search keeps, best first)."""
        return self.hypotheses[:n]


class BeamGroup:
    """A beam-search request in the engine: its root request, live beams (requests, best first)
    with their scores, and the search state."""

    __slots__ = ("root", "search", "beams", "scores", "num_forks")

    def __init__(self, root: Any, search: BeamSearch) -> None:
        self.root = root
        self.search = search
        self.beams: list[Any] = [root]
        self.scores: list[float] = [0.0]
        self.num_forks = 0

    def next_beam_id(self) -> str:
        self.num_forks += 1
        return f"{self.root.request_id}#beam{self.num_forks}"
