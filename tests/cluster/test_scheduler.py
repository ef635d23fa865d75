"""The scheduler alone, with a real BlockManager and no model: tokens are made up, plans checked."""

from __future__ import annotations

import pytest

from pagedserve.cluster.block_manager import BlockManager, RequestTooLong
from pagedserve.cluster.request import Request, RequestStatus
from pagedserve.cluster.scheduler import Scheduler
from pagedserve.config import SchedulerConfig
from pagedserve.plan import StepPlan
from pagedserve.sampling import SamplingParams


def make(num_blocks=64, block_size=4, max_model_len=256, num_host_blocks=0, **cfg):
    bm = BlockManager(num_blocks, block_size, num_host_blocks=num_host_blocks)
    return Scheduler(SchedulerConfig(**cfg), bm, max_model_len)


def request(rid, prompt_len, max_tokens=4, priority=0, t=0.0):
    return Request(rid, [(hash(rid) + i) % 1000 for i in range(prompt_len)],
                   SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens, priority=priority,
                   arrival_time=t)  # fmt: skip


def step(s: Scheduler) -> StepPlan:
    """One step with a stand-in model: every sampling row gets token 7."""
    plan = s.schedule()
    for seq in plan.seqs:
        req = s.requests[seq.req_id]
        if seq.sample:
            req.append_token(7)
            if len(req.output_token_ids) >= req.max_tokens:
                s.finish_request(req, RequestStatus.FINISHED_LENGTH)
    return plan


def readmitted(plans: list[StepPlan]) -> set[str]:
    """Requests whose block table the workers had to rebuild after their first step (recompute)."""
    return {q.req_id for p in plans for q in p.seqs if q.table_start == 0 and q.new is None}


def drain(s: Scheduler, limit=500) -> list[StepPlan]:
    plans = []
    while s.has_unfinished():
        plans.append(step(s))
        assert len(plans) < limit, "the scheduler stopped making progress"
    assert s.bm.num_free_blocks == s.bm.num_blocks and not s.bm.seqs
    return plans


def test_chunked_prefill_respects_the_token_budget_and_decodes_go_first():
    s = make(max_num_batched_tokens=10)
    s.add_request(request("a", 3, max_tokens=6))
    s.add_request(request("b", 25))
    plans = drain(s)
    assert all(p.num_tokens <= 10 for p in plans)
    first = plans[0]
    assert [(q.req_id, len(q.token_ids)) for q in first.seqs] == [("a", 3), ("b", 7)]
    # later steps: a's decode is scheduled before b's next chunk
    assert [q.req_id for q in plans[1].seqs] == ["a", "b"] and len(plans[1].seqs[1].token_ids) == 9
    chunks = [q for p in plans for q in p.seqs if q.req_id == "b" and not q.sample]
    assert [q.start_pos for q in chunks] == [0, 7]


def test_a_prefill_that_ends_within_the_slack_is_not_cut_short():
    # Budget 64, slack 2 (1/32). One decode row and a burst of four 16-token prompts: 65 tokens.
    # Cut at the budget, the last prompt would get 15 of its 16 and its first token a step later.
    s = make(max_num_batched_tokens=64)
    assert s.config.finish_slack == 2 and s.config.max_step_tokens == 66
    s.add_request(request("a", 3, max_tokens=8))
    step(s)
    for i in range(4):
        s.add_request(request(f"p{i}", 16))
    plan = step(s)
    assert [(q.req_id, len(q.token_ids), q.sample) for q in plan.seqs] == (
        [("a", 1, True)] + [(f"p{i}", 16, True) for i in range(4)])  # fmt: skip
    assert plan.num_tokens == 65
    # beyond the slack the chunk stops at the budget: 1 + 16 * 3 + 15, the rest next step
    s = make(max_num_batched_tokens=64)
    s.add_request(request("a", 3, max_tokens=8))
    step(s)
    for i, n in enumerate([16, 16, 16, 18]):
        s.add_request(request(f"q{i}", n))
    plan = step(s)
    assert [len(q.token_ids) for q in plan.seqs] == [1, 16, 16, 16, 15] and plan.num_tokens == 64
    assert not plan.seqs[-1].sample
    plans = drain(s)
    assert all(p.num_tokens <= s.config.max_step_tokens for p in plans)


def test_max_num_seqs_caps_the_batch():
    s = make(max_num_seqs=2)
    for i in range(5):
        s.add_request(request(f"r{i}", 5))
    plans = drain(s)
    assert max(len(p.seqs) for p in plans) == 2


def test_recompute_preempts_the_newest_and_it_finishes_later():
    s = make(num_blocks=6, block_size=4, max_model_len=24, watermark=0.0)
    s.add_request(request("old", 8, max_tokens=8, t=1))
    s.add_request(request("new", 8, max_tokens=8, t=2))
    plans = drain(s)
    assert sum(p.num_preempted for p in plans) >= 1
    assert s.num_preemptions >= 1
    # the newest was the victim: its blocks were dropped and later its table was rebuilt from 0
    assert readmitted(plans) == {"new"}


def test_swap_out_and_back_in_even_for_a_request_that_fills_the_pool():
    # 10 blocks, watermark 2 blocks: "big" is swapped out holding 8 blocks; it must come back
    # although 8 + watermark + 1 > 10, because alone it always fits.
    s = make(num_blocks=10, block_size=4, max_model_len=40, num_host_blocks=10, preemption_mode="swap",
             watermark=0.2)  # fmt: skip
    s.add_request(request("small", 4, max_tokens=12, t=1))
    s.add_request(request("big", 28, max_tokens=12, t=2))
    plans = drain(s)
    assert max(len(p.swap_out) for p in plans) == 8 and any(p.swap_in for p in plans)
    assert len(s.bm.host_free) == 10


def test_priority_mode_preempts_the_lowest_priority():
    s = make(num_blocks=6, block_size=4, max_model_len=24, watermark=0.0, scheduling_policy="priority")
    s.add_request(request("low", 8, max_tokens=8, priority=5, t=1))
    s.add_request(request("high", 8, max_tokens=8, priority=0, t=2))
    plans = drain(s)
    assert readmitted(plans) == {"low"}


def test_a_request_that_can_never_fit_fails_at_once():
    s = make(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(RequestTooLong):
        s.add_request(request("long-prompt", 64))
    with pytest.raises(RequestTooLong):
        s.add_request(request("too-much-output", 8, max_tokens=20))  # 28 tokens > 16 slots
    assert not s.has_unfinished()


def test_plans_round_trip_through_msgpack():
    import msgpack

    s = make()
    s.add_request(request("a", 9))
    plan = s.schedule()
    again = StepPlan.from_wire(msgpack.unpackb(msgpack.packb(plan.to_wire()), strict_map_key=False))
    assert again.seqs == plan.seqs and again.copies == plan.copies


def test_swapped_mid_prefill_comes_back_with_room_for_its_whole_next_chunk():
    # Chunks of 12 tokens and a pool of 12 blocks: requests are swapped out halfway through their
    # prompt; the one swapped back in must get blocks for its whole next chunk (3 blocks), not one.
    came_back_mid_prefill = set()
    for seed in range(6):
        s = make(num_blocks=12, block_size=4, max_model_len=48, num_host_blocks=40, preemption_mode="swap",
                 max_num_batched_tokens=12, watermark=0.0)  # fmt: skip
        for i in range(4):
            s.add_request(request(f"r{seed}-{i}", 14 + 3 * ((seed + i) % 4), max_tokens=10, t=i))
        plans = drain(s)
        came_back_mid_prefill |= {
            q.req_id for p in plans if p.swap_in for q in p.seqs
            if q.table_start == 0 and q.new is None and len(q.token_ids) > 4
        }  # fmt: skip
    assert came_back_mid_prefill, "some request must come back before its prompt was done"
