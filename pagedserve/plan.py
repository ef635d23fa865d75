"""The contract between the scheduler and the tensor-parallel ranks: one StepPlan in, one StepOutput out.

The scheduler (``cluster/``) makes a plan each step; every rank (``worker/``) receives the same
plan and rank 0 returns the step's output. Both sides import these types from here and nowhere
else. Across a process boundary they travel as msgpack of plain lists (``to_wire``/``from_wire``),
never pickle: the bytes are ints, floats, strings and lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# A block-table entry that names no block: a sliding-window KV group's block wholly out of its
# window (hybrid KV). Block 0 is then reserved (zeros, never written) and nothing reads it.
NULL_BLOCK = 0


def window_start_block(window: int | None, position: int, block_size: int) -> int:
    """The first block that a query at ``position`` (or later) reads with an attention window of
    ``window`` tokens (None: full attention, block 0). The scheduler gives back a sliding-window
    group's blocks before it, and the workers null their entries, by this one rule."""
    if window is None:
        return 0
    return max(0, position - window + 1) // block_size


@dataclass(slots=True)
class ScheduledSeq:
    """One request's part of a step; travels to the workers as a msgpack list."""

    req_id: str
    token_ids: list[int]  # the tokens whose KV this step computes
    start_pos: int  # position of token_ids[0] (tokens already in the KV cache)
    table_start: int  # each of the worker's block tables becomes table[:table_start] + new_blocks[g]
    new_blocks: list[list[int]]  # per KV group (one list for models without sliding windows)
    sample: bool  # this step reaches the end of the known tokens: sample the next one
    fork_ids: list[str] = field(default_factory=list)  # parallel samples drawn from this row too
    # first sight for the workers: {"prompt_token_ids", "params"}, or {"fork_of": beam id} for a
    # beam that continues another (same params; its whole table comes in new_blocks)
    new: dict | None = None


@dataclass(slots=True)
class StepPlan:
    seqs: list[ScheduledSeq]
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host), done first
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    finished: list[str] = field(default_factory=list)  # requests the workers may forget
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    def to_wire(self) -> list:
        return [
            [[s.req_id, s.token_ids, s.start_pos, s.table_start, s.new_blocks, s.sample, s.fork_ids, s.new]
             for s in self.seqs],
            self.swap_out, self.swap_in, self.copies, self.finished,
        ]  # fmt: skip

    @classmethod
    def from_wire(cls, wire: list) -> StepPlan:
        seqs, swap_out, swap_in, copies, finished = wire
        return cls([ScheduledSeq(*s) for s in seqs], swap_out, swap_in, copies, finished)


@dataclass(slots=True)
class SampledToken:
    """A token sampled for one request in one step, with its logprobs when asked for."""

    req_id: str
    token_id: int
    logprob: float | None = None
    rank: int | None = None
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None


@dataclass(slots=True)
class StepOutput:
    """What rank 0 returns for a plan: sampled tokens, and prompt logprobs of prefill chunks."""

    sampled: list[SampledToken]
    # req_id -> entries for prompt tokens scored this step: (token, logprob, rank, top_ids, top_logprobs)
    prompt_logprobs: dict[str, list[list]] = field(default_factory=dict)
    timings: list[float] = field(default_factory=list)  # seconds: [prepare inputs, model, sample]
    # beam id -> [top token ids, their logprobs], best first: each beam-search row's candidates
    beam_candidates: dict[str, list[list]] = field(default_factory=dict)

    def to_wire(self) -> list:
        return [[[s.req_id, s.token_id, s.logprob, s.rank, s.top_ids, s.top_logprobs] for s in self.sampled],
                self.prompt_logprobs, self.timings, self.beam_candidates]  # fmt: skip

    @classmethod
    def from_wire(cls, wire: list) -> StepOutput:
        return cls([SampledToken(*s) for s in wire[0]], wire[1], wire[2], wire[3])
