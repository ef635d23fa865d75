"""One generation request as the scheduler sees it: tokens, progress, status, timings."""

from __future__ import annotations

import enum
import time
from typing import Any

from pagedserve.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


class Request:
    """A request's tokens and progress. ``all_token_ids`` is the prompt followed by the outputs."""

    __slots__ = (
        "request_id", "prompt_token_ids", "output_token_ids", "all_token_ids", "params", "priority",
        "arrival_time", "num_computed_tokens", "status", "stop_reason", "num_preemptions",
        "num_cached_tokens", "sent_to_worker", "extra_keys", "max_tokens", "parent", "sample_index",
        "samples", "logprobs", "cumulative_logprob", "prompt_logprobs", "first_token_time",
        "last_token_time", "scheduled_time", "error", "eos_token_ids", "beam_group", "fork_of", "table_stale",
        "beam_candidates",
    )  # fmt: skip

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        max_tokens: int,
        eos_token_ids: tuple[int, ...] = (),
        priority: int = 0,
        arrival_time: float | None = None,
        extra_keys: tuple[Any, ...] = (),
        parent: Request | None = None,
        sample_index: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens
        self.eos_token_ids = eos_token_ids
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.sent_to_worker = False
        self.extra_keys = extra_keys
        self.parent = parent
        self.sample_index = sample_index
        self.samples: list[Request] = [self]  # a parent's parallel samples, itself first
        self.logprobs: list[dict[int, tuple[float, int]]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list[dict[int, tuple[float, int]] | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.scheduled_time: float | None = None
        self.error: str | None = None
        # Beam search: the root request holds its group (``BeamGroup``); every beam, the root too,
        # is a request of its own whose blocks it shares with the beams it forked from.
        self.beam_group: Any = None  # its BeamGroup, on every beam of a beam search
        self.fork_of: str | None = None  # a beam forked from this one, until the workers first see it
        self.table_stale = False  # the workers' copy of its block table is out of date: resend it all
        # this step's candidates (token ids, logprobs), until the group advances
        self.beam_candidates: tuple[list[int], list[float]] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def _child(self, child_id: str, params: SamplingParams, parent: Request,
               sample_index: int = 0) -> Request:  # fmt: skip
        """A request continuing this one's progress (status, computed and cached tokens); the
        caller forks its blocks in the block manager."""
        child = Request(
            child_id, self.prompt_token_ids, params, max_tokens=self.max_tokens,
            eos_token_ids=self.eos_token_ids, priority=self.priority, arrival_time=self.arrival_time,
            extra_keys=self.extra_keys, parent=parent, sample_index=sample_index,
        )  # fmt: skip
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.status = self.status
        child.scheduled_time = self.scheduled_time
        return child

    def fork(self, child_id: str, sample_index: int) -> Request:
        """A parallel sample that shares everything computed so far (its blocks are forked too)."""
        child = self._child(child_id, self.params.for_sample(sample_index), self, sample_index)
        child.sent_to_worker = True  # the worker creates its state when it samples the fork
        child.prompt_logprobs = self.prompt_logprobs
        return child

    def fork_beam(self, child_id: str) -> Request:
        """A beam continuing this one: same tokens so far (its blocks are forked by the caller)."""
        child = self._child(child_id, self.params, self.parent or self)
        child.output_token_ids = list(self.output_token_ids)
        child.all_token_ids = list(self.all_token_ids)
        child.beam_group = self.beam_group
        child.fork_of = self.request_id
        child.table_stale = True
        return child

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens})"
        )
