"""Continuous batching: every step, decide which tokens of which requests run, and with what blocks.

Each step the running requests go first (a decode is one token, an unfinished prefill its next
chunk), then swapped-out requests come back, then waiting requests are admitted in order, all
under one token budget (``max_num_batched_tokens``, so prefills are chunked) and ``max_num_seqs``.
When the pool cannot give a running request its slots, the newest (or lowest-priority) running
request is preempted: by recompute (its blocks are freed; it re-prefills later, mostly from
blocks still cached) or by swap (its blocks move to the host pool). The output of a step is one
``StepPlan``: what the workers run. The scheduler never touches tensors.
"""

from __future__ import annotations

import time
from collections import deque

from pagedserve.cluster.block_manager import BlockManager, PrefixHit, RequestTooLong
from pagedserve.cluster.request import Request, RequestStatus
from pagedserve.config import SchedulerConfig
from pagedserve.plan import ScheduledSeq, StepPlan


class Scheduler:
    """Decides each step's batch; owns the request queues and drives the BlockManager."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int) -> None:
        self.config = config
        self.bm = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._finished_ids: list[str] = []
        self._watermark_blocks = int(config.watermark * block_manager.num_blocks)

    # ---- queue changes -------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queue a request; raises RequestTooLong at once if it could never run."""
        if req.num_prompt_tokens >= self.max_model_len:
            raise RequestTooLong(
                f"the prompt has {req.num_prompt_tokens} tokens; this model's context is "
                f"{self.max_model_len} tokens including at least one generated token"
            )
        self.bm.check_fits(min(req.num_prompt_tokens + req.max_tokens, self.max_model_len))
        self.requests[req.request_id] = req
        if self.config.scheduling_policy == "priority":
            # Keep waiting sorted by (priority, arrival); insertion is rare next to steps.
            key = (req.priority, req.arrival_time)
            idx = next(
                (i for i, r in enumerate(self.waiting) if (r.priority, r.arrival_time) > key),
                len(self.waiting),
            )
            self.waiting.insert(idx, req)
        else:
            self.waiting.append(req)

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """End a request (stop, length, abort, error): its blocks go back at once."""
        if req.is_finished:
            return
        prior = req.status
        req.status = status
        if prior == RequestStatus.RUNNING:
            self.running.remove(req)
        elif prior == RequestStatus.WAITING:
            self.waiting.remove(req)
        elif prior == RequestStatus.SWAPPED:
            self.swapped.remove(req)
        if req.request_id in self.bm:
            self.bm.free(req.request_id)
        if req.sent_to_worker:
            self._finished_ids.append(req.request_id)
        self.requests.pop(req.request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # ---- scheduling ----------------------------------------------------------------------

    def _victim(self) -> Request:
        if self.config.scheduling_policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]  # running is in admission order: the newest is last

    def _preempt(self, req: Request, plan: StepPlan) -> None:
        self.running.remove(req)
        req.num_preemptions += 1
        self.num_preemptions += 1
        plan.num_preempted += 1
        if self.config.preemption_mode == "swap":
            mapping = self.bm.swap_out(req.request_id)
            if mapping is not None:
                plan.swap_out.extend(mapping)
                req.status = RequestStatus.SWAPPED
                self.swapped.append(req)
                return
        # recompute (or swap with the host pool full): drop the blocks, re-prefill later
        self.bm.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def schedule(self) -> StepPlan:
        """Pick this step's work. Mutates request progress as if the plan will run."""
        plan = StepPlan([], finished=self._finished_ids)
        self._finished_ids = []
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, tuple[Request, int, int]] = {}  # id -> (request, new tokens, table start)

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            preempted_before = plan.num_preempted
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            start = None
            while start is None:
                start = self.bm.allocate(req.request_id, req.all_token_ids, n)
                if start is None:
                    victim = self._victim()
                    if victim.request_id in scheduled:
                        budget += scheduled.pop(victim.request_id)[1]
                    self._preempt(victim, plan)
                    if victim is req:
                        break
            if start is None:
                continue  # req itself was preempted; the list shifted under i
            scheduled[req.request_id] = (req, n, start)
            budget -= n
            # a victim may have left the list before req (priority mode): find req again
            i = i + 1 if plan.num_preempted == preempted_before else self.running.index(req) + 1

        if not plan.num_preempted:
            budget = self._swap_in(plan, scheduled, budget)
            if not self.swapped:
                self._admit(scheduled, budget)

        now = time.monotonic()
        for req, n, start in scheduled.values():
            new = None
            if not req.sent_to_worker:
                new = {"prompt_token_ids": req.prompt_token_ids, "params": req.params.to_dict()}
                req.sent_to_worker = True
            if req.scheduled_time is None:
                req.scheduled_time = now
            pos = req.num_computed_tokens
            req.num_computed_tokens += n
            sample = req.num_computed_tokens == req.num_tokens
            forks = []
            if sample and req.params.n > 1 and not req.output_token_ids and req.parent is None:
                forks = [f"{req.request_id}#{k}" for k in range(1, req.params.n)]
            plan.seqs.append(
                ScheduledSeq(
                    req.request_id, req.all_token_ids[pos : pos + n], pos, start,
                    self.bm.block_table(req.request_id)[start:], sample, forks, new,
                )
            )  # fmt: skip
        plan.copies = self.bm.take_copies()
        return plan

    def _swap_in(self, plan: StepPlan, scheduled: dict, budget: int) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.swapped[0]
            # Room for its blocks, the blocks of this step's tokens (a whole chunk when it was
            # swapped out mid-prefill) and the watermark; alone, a request always fits (check_fits
            # at add), so the watermark never keeps it out of an empty pool forever.
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            held = self.bm.num_tokens(req.request_id)
            growth = self.bm.blocks_needed(held + n) - self.bm.blocks_needed(held)
            headroom = growth + (self._watermark_blocks if self.running else 0)
            if not self.bm.can_swap_in(req.request_id, headroom):
                break
            plan.swap_in.extend(self.bm.swap_in(req.request_id))
            self.swapped.popleft()
            start = self.bm.allocate(req.request_id, req.all_token_ids, n)
            assert start is not None, "swap-in checked room for the next token"
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.request_id] = (req, n, 0)  # every block is new to the workers
            budget -= n
        return budget

    def _admit(self, scheduled: dict, budget: int) -> None:
        bm = self.bm
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            # prompt logprobs need every prompt position computed: no prefix hits for those
            if req.params.prompt_logprobs is None or req.num_preemptions:
                hit = bm.match_prefix(req.all_token_ids, req.extra_keys)
            else:
                hit = PrefixHit([], [], bm.block_size)
            n = req.num_tokens - hit.num_tokens
            if n > budget and not self.config.enable_chunked_prefill:
                break
            n = min(n, budget)
            if self.running and bm.num_free_blocks - bm.blocks_needed(n) < self._watermark_blocks:
                break
            first = req.num_preemptions == 0
            start = bm.allocate(
                req.request_id, req.all_token_ids, n, prefix=hit, extra_keys=req.extra_keys,
                count_prefix_stats=first,
            )  # fmt: skip
            if start is None:
                break
            self.waiting.popleft()
            if first:
                req.num_cached_tokens = hit.num_tokens
            req.num_computed_tokens = hit.num_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.request_id] = (req, n, 0)
            budget -= n

    def add_forks(self, parent: Request, fork_ids: list[str]) -> list[Request]:
        """Parallel samples of ``parent``: each shares all of its blocks, copy-on-write."""
        children = []
        idx = self.running.index(parent) + 1
        for k, child_id in enumerate(fork_ids, start=1):
            child = parent.fork(child_id, k)
            self.bm.fork(parent.request_id, child_id)
            self.requests[child_id] = child
            self.running.insert(idx, child)
            idx += 1
            parent.samples.append(child)
            children.append(child)
        return children
