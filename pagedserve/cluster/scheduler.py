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
        total = min(req.num_prompt_tokens + req.max_tokens, self.max_model_len)
        self.bm.check_fits(total)
        width = req.params.width
        if width > 1:
            # A beam group at worst holds the prompt once and each beam's own outputs.
            need = self.bm.blocks_needed(req.num_prompt_tokens) + width * (
                self.bm.blocks_needed(total - req.num_prompt_tokens) + 1
            )
            if need > self.bm.num_usable_blocks:
                raise RequestTooLong(
                    f"a beam search of width {width} needs up to {need} KV blocks for this request, "
                    f"but the whole pool holds {self.bm.num_usable_blocks}"
                )
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

    @staticmethod
    def _group_of(req: Request, status: RequestStatus) -> list[Request]:
        """The request, or all beams of its beam group, that are in ``status``."""
        if req.beam_group is None:
            return [req]
        return [b for b in req.beam_group.beams if b.status is status]

    def _preempt(self, req: Request, plan: StepPlan, scheduled: dict, recompute: bool = False) -> int:
        """Preempt the request, or its whole beam group (by recompute when asked, else by the
        configured mode); returns the budget its scheduled tokens held."""
        members = self._group_of(req, RequestStatus.RUNNING)
        freed = 0
        for m in members:
            if m.request_id in scheduled:
                freed += scheduled.pop(m.request_id)[1]
            self.running.remove(m)
            m.num_preemptions += 1
        self.num_preemptions += len(members)
        plan.num_preempted += len(members)
        if self.config.preemption_mode == "swap" and not recompute:
            # a beam group's shared blocks move once, and come back shared
            mapping = self.bm.swap_out_group([m.request_id for m in members])
            if mapping is not None:
                plan.swap_out.extend(mapping)
                for m in members:
                    m.status = RequestStatus.SWAPPED
                self.swapped.extend(members)
                return freed
        # recompute (or swap with the host pool full): drop the blocks, re-prefill later; a beam
        # group's beams re-share their common prefix when they come back (see _beam_prefix)
        for m in reversed(members):
            self.bm.free(m.request_id)
            m.num_computed_tokens = 0
            m.beam_candidates = None  # it reports again after its re-prefill
            m.status = RequestStatus.WAITING
            self.waiting.appendleft(m)
        return freed

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
            # the slack only for the last running request: it must not take budget from decodes
            last = i == len(self.running) - 1
            n = self._chunk(req.num_tokens - req.num_computed_tokens, budget, slack=last)
            if n == 0:  # a beam that reported its candidates waits for the rest of its group
                i += 1
                continue
            start = None
            while start is None:
                start = self.bm.allocate(req.request_id, req.all_token_ids, n)
                if start is None:
                    budget += self._preempt(self._victim(), plan, scheduled)
                    if req.status is not RequestStatus.RUNNING:
                        break
            if start is None:
                continue  # req itself (or its beam group) was preempted; the list shifted under i
            scheduled[req.request_id] = (req, n, start)
            budget -= n
            # a victim may have left the list before req (priority mode): find req again
            i = i + 1 if plan.num_preempted == preempted_before else self.running.index(req) + 1

        if not plan.num_preempted:
            budget = self._swap_in(plan, scheduled, budget)
            if not self.swapped:
                self._admit(scheduled, budget)
        if not scheduled and self.running and not plan.swap_in and not plan.num_preempted:
            # Every running request is a beam that reported and waits for siblings which cannot
            # come back (no room, or swapped requests ahead of them): nothing would ever change.
            # Recompute those groups whole; they return together once there is room.
            for req in reversed(list(self.running)):
                if req.status is RequestStatus.RUNNING:
                    self._preempt(req, plan, scheduled, recompute=True)

        now = time.monotonic()
        for req, n, start in scheduled.values():
            new = None
            if not req.sent_to_worker:
                if req.fork_of is not None:
                    new = {"fork_of": req.fork_of}
                else:
                    new = {"prompt_token_ids": req.prompt_token_ids, "params": req.params.to_dict()}
                req.sent_to_worker = True
            if req.table_stale:
                start, req.table_stale = 0, False
            if req.scheduled_time is None:
                req.scheduled_time = now
            pos = req.num_computed_tokens
            req.num_computed_tokens += n
            sample = req.num_computed_tokens == req.num_tokens
            forks = []
            first_sample = sample and not req.output_token_ids and req.parent is None
            if first_sample and req.params.n > 1 and req.beam_group is None:
                forks = [f"{req.request_id}#{k}" for k in range(1, req.params.n)]
            plan.seqs.append(
                ScheduledSeq(
                    req.request_id, req.all_token_ids[pos : pos + n], pos, start,
                    [table[start:] for table in self.bm.block_tables(req.request_id)], sample, forks, new,
                )
            )  # fmt: skip
        plan.copies = self.bm.take_copies()
        return plan

    def _chunk(self, remaining: int, budget: int, *, slack: bool) -> int:
        """How many of a request's `remaining` uncomputed tokens this step runs with `budget` left:
        all of them where they exceed the budget by at most the config's slack (the prefill ends
        this step: the request's first token comes a step sooner), else what the budget holds."""
        if remaining <= budget or (slack and remaining <= budget + self.config.finish_slack):
            return remaining
        return budget

    def _swap_in(self, plan: StepPlan, scheduled: dict, budget: int) -> int:
        while self.swapped and budget > 0:
            req = self.swapped[0]
            members = self._group_of(req, RequestStatus.SWAPPED)  # a beam group comes back whole
            if self.running and len(self.running) + len(members) > self.config.max_num_seqs:
                break
            # Room for their blocks, the blocks of this step's tokens (a whole chunk when swapped
            # out mid-prefill; a copy when a shared last block is written) and the watermark;
            # alone, a request always fits (check_fits at add), so the watermark never keeps it
            # out of an empty pool forever.
            steps, headroom, left = [], 0, budget
            for m in members:
                n = min(m.num_tokens - m.num_computed_tokens, left)
                # beyond the slots it holds already (a beam preempted after this step's allocation
                # keeps them), in every KV group
                growth = self.bm.growth_blocks(m.request_id, m.num_computed_tokens + n)
                headroom += growth + (len(members) > 1) * self.bm.num_groups  # a copy per KV group
                steps.append(n)
                left -= n
            headroom += self._watermark_blocks if self.running else 0
            ids = [m.request_id for m in members]
            if not self.bm.can_swap_in_group(ids, headroom):
                break
            plan.swap_in.extend(self.bm.swap_in_group(ids))
            for m, n in zip(members, steps):
                self.swapped.remove(m)
                m.status = RequestStatus.RUNNING
                self.running.append(m)
                if n == 0:  # a beam waiting for its group: the workers hear its new table later
                    m.table_stale = True
                    continue
                missing = m.num_computed_tokens + n - self.bm.num_tokens(m.request_id)
                if missing > 0:
                    start = self.bm.allocate(m.request_id, m.all_token_ids, missing)
                    assert start is not None, "swap-in checked room for the next tokens"
                scheduled[m.request_id] = (m, n, 0)  # every block is new to the workers
            budget = left
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
            if req.beam_group is not None:
                if req.num_computed_tokens == 0 and not req.output_token_ids and self.running and (
                    len(self.running) + req.params.width > self.config.max_num_seqs
                ):
                    break  # a beam search's root expands to `width` running beams
                hit = self._beam_prefix(req, hit)
                if hit is None:
                    break  # a beam waits until a sibling has the prefix they share
                if not self._group_fits(req, hit):
                    break
            n = self._chunk(req.num_tokens - hit.num_tokens, budget, slack=True)
            if n < req.num_tokens - hit.num_tokens and not self.config.enable_chunked_prefill:
                break
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

    def _beam_prefix(self, req: Request, hit: PrefixHit) -> PrefixHit | None:
        """A re-admitted beam's leading blocks: its prefix-cache hit, or the full blocks it shares
        with a running sibling of its group when those are more, so that the group re-prefills
        the prompt once. None while a running sibling has not yet computed what they share."""
        bm = self.bm
        best: tuple[int, Request] | None = None
        limit = req.num_tokens - 1  # its last token is always computed (its logits are needed)
        for sibling in req.beam_group.beams:
            if sibling is req or sibling.status is not RequestStatus.RUNNING:
                continue
            common = _common_prefix(sibling.all_token_ids, req.all_token_ids, limit)
            if bm.num_tokens(sibling.request_id) < common // bm.block_size * bm.block_size:
                return None  # still prefilling what they share: the next steps compute it
            if best is None or common > best[0]:
                best = (common, sibling)
        if best is None or best[0] // bm.block_size <= len(hit.blocks):
            return hit
        # None: a sliding-window group of the sibling gave back blocks this beam's window needs
        return bm.shared_prefix(best[1].request_id, best[0] // bm.block_size, hit.hashes) or hit

    def _group_fits(self, req: Request, hit: PrefixHit) -> bool:
        """Whether a beam group coming back (``req`` first, no beam of it running) has free blocks
        for all its waiting beams, sharing their common prefix with ``req``: a group is never let
        in half, to wait with its first beams holding blocks that its others cannot get."""
        group = req.beam_group
        if len(group.beams) == 1 or any(b.status is RequestStatus.RUNNING for b in group.beams):
            return True  # a root not yet expanded, or a sibling is back (its blocks were counted)
        bm, bs = self.bm, self.bm.block_size
        need = bm.blocks_needed(req.num_tokens) - hit.num_held
        for b in group.beams:
            if b is not req and b.status is RequestStatus.WAITING:
                common = _common_prefix(b.all_token_ids, req.all_token_ids, b.num_tokens - 1)
                need += bm.blocks_needed(b.num_tokens) - bm.blocks_needed(common // bs * bs)
        headroom = self._watermark_blocks if self.running else 0
        return bm.num_free_blocks - need >= headroom

    def add_beam(self, parent: Request, child: Request) -> None:
        """A beam that continues ``parent`` too: it shares all of the parent's blocks (copy-on-write)."""
        self.bm.fork(parent.request_id, child.request_id)
        self.requests[child.request_id] = child
        self.running.insert(self.running.index(parent) + 1, child)

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


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
