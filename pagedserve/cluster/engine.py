"""The engine: tokens in, tokens out. Drives the scheduler and the executor one step at a time.

``Engine`` is synchronous (the offline ``LLM`` and tests); ``AsyncEngine`` runs the same step
loop in a background thread and streams each request's outputs to an asyncio consumer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from pagedserve.cluster.beam import BeamGroup, BeamSearch
from pagedserve.cluster.block_manager import BlockManager, RequestTooLong
from pagedserve.cluster.executor import Executor, RankFailure, make_executor
from pagedserve.cluster.outputs import (
    CompletionOutput,
    IncrementalDetokenizer,
    Logprob,
    OutputDeltas,
    RequestMetrics,
    RequestOutput,
    find_stop_string,
)
from pagedserve.cluster.request import Request, RequestStatus
from pagedserve.cluster.scheduler import Scheduler
from pagedserve.config import ConfigError, EngineConfig
from pagedserve.plan import StepOutput, StepPlan
from pagedserve.sampling import SamplingParams, SamplingParamsError
from pagedserve.worker.kv_groups import kv_cache_groups
from pagedserve.worker.loader import check_tensor_parallel, load_config, load_tokenizer, resolve_model
from pagedserve.worker.models import get_model_class

logger = logging.getLogger(__name__)

Prompt = str | list[int] | dict[str, Any]


class InvalidPrompt(ValueError):
    """The prompt is empty or holds token ids outside the vocabulary."""


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    num_blocks: int
    block_size: int
    free_blocks: int
    cached_blocks: int
    kv_cache_usage: float
    live_fraction: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    num_steps: int
    num_group_restarts: int = 0  # tensor-parallel groups rebuilt after a rank failed
    # Beam search: blocks the live beams' tables name, and the distinct blocks they hold (sharing
    # makes the second smaller); as of the last step, and summed over every step since the start.
    beam_blocks_logical: int = 0
    beam_blocks_physical: int = 0
    beam_block_steps_logical: int = 0
    beam_block_steps_physical: int = 0
    step_time: dict[str, float] = field(default_factory=dict)  # seconds: schedule, model, sample, other


def eos_token_ids(tokenizer: Any, hf_config: Any) -> tuple[int, ...]:
    """EOS ids from the tokenizer and the model config (Llama 3 lists several)."""
    ids: set[int] = set()
    for source in (getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    return tuple(sorted(ids))


class Engine:
    """Continuous-batching engine over one executor (one tensor-parallel group)."""

    def __init__(self, config: EngineConfig | None = None, *, executor: Executor | None = None,
                 **flags: Any) -> None:  # fmt: skip
        config = config or EngineConfig.from_flags(**flags)
        self.config = config
        mc, cc, sc = config.model, config.cache, config.scheduler
        self.model_path = str(resolve_model(mc.model))
        self.model_name = mc.served_model_name or (mc.model or "SmolLM2-135M-Instruct")
        self.tokenizer = load_tokenizer(mc.tokenizer or self.model_path)
        hf_config = load_config(self.model_path)
        self.hf_config = hf_config
        self.eos_token_ids = eos_token_ids(self.tokenizer, hf_config)
        self.vocab_size = hf_config.vocab_size
        self.max_model_len = mc.max_model_len or hf_config.max_position_embeddings
        get_model_class(hf_config)  # an architecture we do not implement fails here, naming ours
        check_tensor_parallel(hf_config, config.parallel.tensor_parallel_size)
        worker_kwargs = {"dtype": mc.dtype, "seed": mc.seed, "eos_token_ids": self.eos_token_ids}
        self.executor = executor or make_executor(config.parallel, self.model_path, worker_kwargs)
        # KV groups: one of every layer, or (hybrid KV) full-attention and sliding-window groups
        self.kv_groups = kv_cache_groups(hf_config, hybrid=not cc.disable_hybrid_kv_cache_manager)
        num_blocks, num_host = self.executor.determine_num_blocks(cc, sc.max_step_tokens)
        if sc.preemption_mode != "swap":
            num_host = 0  # the host pool only serves swapping
        self._pool_shape = (num_blocks, num_host)
        self._new_scheduler()
        try:
            self.block_manager.check_fits(self.max_model_len)
        except (RequestTooLong, ValueError) as e:
            raise ConfigError(
                f"the KV pool of {num_blocks} blocks of {cc.block_size} tokens cannot hold one request of "
                f"--max-model-len {self.max_model_len} tokens: lower --max-model-len or give the cache "
                f"more memory"
            ) from e
        hybrid = not cc.disable_hybrid_kv_cache_manager
        self.executor.init_kv_pool(num_blocks, cc.block_size, num_host, hybrid)
        self._lost_events: list[tuple[str, list[int]]] = []  # of a block manager dropped by recover()
        self._groups: dict[str, Request] = {}  # request id -> its first sample (holds the others)
        self._beam_groups: dict[str, BeamGroup] = {}  # beam searches whose beams are reporting
        self._beam_block_steps = [0, 0]  # logical, physical
        self._beam_blocks_now = (0, 0)  # as of the last step (stats() is read every step)
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._prompts: dict[str, str | None] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_steps = 0
        self.num_group_restarts = 0
        self._time = {"schedule": 0.0, "model": 0.0, "sample": 0.0, "other": 0.0}
        logger.info(
            "KV pool: %d blocks of %d tokens = %d tokens; max concurrency at max_model_len %d: %.1f",
            num_blocks, cc.block_size, num_blocks * cc.block_size, self.max_model_len,
            num_blocks * cc.block_size / self.max_model_len,
        )  # fmt: skip

    def _new_scheduler(self) -> None:
        num_blocks, num_host = self._pool_shape
        cc = self.config.cache
        self.block_manager = BlockManager(
            num_blocks, cc.block_size, num_host_blocks=num_host,
            enable_prefix_caching=cc.enable_prefix_caching,
            group_windows=[g.window for g in self.kv_groups],
            max_chunk_tokens=self.config.scheduler.max_step_tokens,
        )  # fmt: skip
        self.scheduler = Scheduler(self.config.scheduler, self.block_manager, self.max_model_len)

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every request with an error (finish reason "error"); their final outputs."""
        outputs = []
        for root in list(self._groups.values()):
            root.error = message
            for sample in root.samples:
                self.scheduler.finish_request(sample, RequestStatus.FINISHED_ERROR)
            outputs.append(self._finish_group(root))
        return outputs

    def recover(self) -> None:
        """After a RankFailure (call fail_all first): rebuild the rank group and start a fresh
        scheduler over its empty pool. The routers hear that every cached block is gone."""
        assert not self._groups, "fail the requests in flight before rebuilding"
        old = self.block_manager
        self._lost_events.extend(old.take_events())
        if old.cached:
            self._lost_events.append(("removed", list(old.cached)))
        self.executor.restart()
        queries, hits, preemptions = old.prefix_queries, old.prefix_hits, self.scheduler.num_preemptions
        self._new_scheduler()
        # the figures are cumulative since the replica started (Prometheus counters), not per group
        self.block_manager.prefix_queries, self.block_manager.prefix_hits = queries, hits
        self.scheduler.num_preemptions = preemptions
        self.num_group_restarts += 1

    # ---- requests ------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> tuple[list[int], str | None]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"]), prompt.get("prompt")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return self.tokenizer(prompt).input_ids, prompt
        return list(prompt), None

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Queue a request. Raises InvalidPrompt or RequestTooLong (never queues what cannot run)."""
        params = params or SamplingParams()
        token_ids, text = self.tokenize(prompt)
        if not token_ids:
            raise InvalidPrompt("the prompt is empty")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise InvalidPrompt(f"prompt token ids must be in [0, {self.vocab_size})")
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        room = self.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, max(room, 1))
        req = Request(
            request_id, token_ids, params, max_tokens=max_tokens, eos_token_ids=self.eos_token_ids,
            priority=priority, arrival_time=arrival_time, extra_keys=(cache_salt,) if cache_salt else (),
        )  # fmt: skip
        if params.use_beam_search:
            self._check_beam_width(params)
            req.beam_group = BeamGroup(req, BeamSearch(params, self.eos_token_ids, max_tokens))
        self.scheduler.add_request(req)
        self._groups[request_id] = req
        self._prompts[request_id] = text
        return req

    def _check_beam_width(self, params: SamplingParams) -> None:
        sc = self.config.scheduler
        limit = min(sc.max_beam_width, sc.max_num_seqs)
        if params.width > limit:
            param = "beam_width" if params.beam_width else ("best_of" if params.best_of else "n")
            raise SamplingParamsError(
                param, f"the beam width must be <= {limit} (--max-beam-width {sc.max_beam_width}, "
                f"--max-num-seqs {sc.max_num_seqs}), got {params.width}"
            )  # fmt: skip

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request and all its samples now; its blocks return to the pool."""
        root = self._groups.get(request_id)
        if root is None:
            return None
        for sample in root.samples:
            self.scheduler.finish_request(sample, RequestStatus.FINISHED_ABORTED)
        return self._finish_group(root)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, execute, and turn sampled tokens into outputs of the requests that advanced."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        t1 = time.perf_counter()
        if plan.seqs or plan.swap_out or plan.swap_in or plan.copies or plan.finished:
            result = self.executor.execute(plan)
        else:
            result = StepOutput([])
        t2 = time.perf_counter()
        outputs = self._update(plan, result)
        t3 = time.perf_counter()
        self.num_steps += 1
        self._beam_blocks_now = self._beam_blocks() if self._beam_groups else (0, 0)
        self._beam_block_steps[0] += self._beam_blocks_now[0]
        self._beam_block_steps[1] += self._beam_blocks_now[1]
        _, model, sample = result.timings or (0.0, 0.0, 0.0)  # input preparation lands in other
        self._time["schedule"] += (t1 - t0) + (t3 - t2)
        self._time["model"] += model
        self._time["sample"] += sample
        self._time["other"] += (t2 - t1) - model - sample
        return outputs

    def _update(self, plan: StepPlan, result: StepOutput) -> list[RequestOutput]:
        requests = self.scheduler.requests
        for s in plan.seqs:
            if s.fork_ids and s.req_id in requests:
                self.scheduler.add_forks(requests[s.req_id], s.fork_ids)
        for req_id, entries in result.prompt_logprobs.items():
            req = requests.get(req_id)
            if req is not None and req.prompt_logprobs is not None:
                req.prompt_logprobs.extend({e[0]: Logprob(e[1], e[2])} | _top(e[3], e[4]) for e in entries)
        touched: dict[str, Request] = {}
        now = time.monotonic()
        for tok in result.sampled:
            req = requests.get(tok.req_id)
            if req is None:  # aborted while its step ran
                continue
            if not req.output_token_ids and req.parent is None:
                self.prompt_tokens += req.num_prompt_tokens
            req.append_token(tok.token_id)
            self.generation_tokens += 1
            req.first_token_time = req.first_token_time or now
            req.last_token_time = now
            if req.logprobs is not None:
                req.logprobs.append(
                    {tok.token_id: Logprob(tok.logprob, tok.rank)} | _top(tok.top_ids, tok.top_logprobs)
                )
                req.cumulative_logprob += tok.logprob
            status = self._check_stop(req, tok.token_id)
            if status is not None:
                self.scheduler.finish_request(req, status)
            root = req.parent or req
            touched[root.request_id] = root
        outputs = []
        for root in touched.values():
            if all(s.is_finished for s in root.samples):
                outputs.append(self._finish_group(root))
            else:
                outputs.append(self._output(root))
        for req_id, (ids, logprobs) in result.beam_candidates.items():
            req = requests.get(req_id)
            if req is not None:  # else aborted while its step ran
                req.beam_candidates = (ids, logprobs)
                self._beam_groups[req.beam_group.root.request_id] = req.beam_group
        for group in list(self._beam_groups.values()):
            # A group advances once every live beam has reported and is running (a preempted
            # beam reports again after its re-prefill; a swapped one once it is back).
            if all(b.beam_candidates is not None and b.status is RequestStatus.RUNNING for b in group.beams):
                out = self._advance_beams(group, now)
                if out is not None:
                    outputs.append(out)
        return outputs

    def _advance_beams(self, group: BeamGroup, now: float) -> RequestOutput | None:
        """One beam-search step of a group: its beams fork, continue or drop; the final output
        when the search ends (a beam search returns nothing before it is done)."""
        root, beams, finish = group.root, group.beams, self.scheduler.finish_request
        candidates = [b.beam_candidates for b in beams]
        for b in beams:
            b.beam_candidates = None
        if root.first_token_time is None:
            self.prompt_tokens += root.num_prompt_tokens
            root.first_token_time = now
        root.last_token_time = now
        self.generation_tokens += len(beams)
        continuations = group.search.advance([b.output_token_ids for b in beams], group.scores, candidates)
        if group.search.done:
            for b in beams:
                finish(b, RequestStatus.FINISHED_STOPPED)
            return self._finish_group(root)
        # Forks first, while each parent still holds exactly its blocks; then every beam appends.
        new_beams: list[Request] = []
        continued: set[int] = set()
        for c in continuations:
            parent = beams[c.parent]
            if c.parent in continued:
                child = parent.fork_beam(group.next_beam_id())
                self.scheduler.add_beam(parent, child)
                new_beams.append(child)
            else:
                continued.add(c.parent)
                new_beams.append(parent)
        for i, b in enumerate(beams):
            if i not in continued:
                finish(b, RequestStatus.FINISHED_STOPPED)  # dropped: its blocks go back at once
        for b, c in zip(new_beams, continuations):
            b.append_token(c.token_id)
        group.beams = new_beams
        group.scores = [c.score for c in continuations]
        root.samples = list(new_beams)
        return None

    def _beam_blocks(self) -> tuple[int, int]:
        """Block-table entries of the running beams, and the distinct blocks among them."""
        logical, physical = 0, set()
        bm = self.block_manager
        for group in self._beam_groups.values():
            for b in group.beams:
                if b.request_id in bm and not bm.is_swapped(b.request_id):
                    for table in bm.block_tables(b.request_id):
                        held = bm.held(table)
                        logical += len(held)
                        physical.update(held)
        return logical, len(physical)

    def _check_stop(self, req: Request, token_id: int) -> RequestStatus | None:
        params = req.params
        num_out = len(req.output_token_ids)
        detok = self._detok.get(req.request_id)
        if detok is None:
            detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params.skip_special_tokens)
            self._detok[req.request_id] = detok
        delta = detok.add(token_id)
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token_id in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                req.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            if params.stop and delta:
                hit = find_stop_string(detok.text, len(delta), params.stop)
                if hit is not None:
                    stop, idx = hit
                    detok.text = detok.text[: idx + len(stop) if params.include_stop_str_in_output else idx]
                    req.stop_reason = stop
                    return RequestStatus.FINISHED_STOPPED
        if num_out >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _output(self, root: Request) -> RequestOutput:
        if root.beam_group is not None:
            return self._beam_output(root)
        outs = []
        for i, sample in enumerate(root.samples):
            detok = self._detok.get(sample.request_id)
            finish = sample.status.value if sample.is_finished else None
            outs.append(CompletionOutput(
                i, detok.text if detok else "", list(sample.output_token_ids),
                sample.cumulative_logprob if sample.logprobs is not None else None,
                sample.logprobs, finish, sample.stop_reason,
            ))  # fmt: skip
        metrics = RequestMetrics(
            root.arrival_time, root.scheduled_time, root.first_token_time, root.last_token_time,
            time.monotonic() if all(s.is_finished for s in root.samples) else None,
        )  # fmt: skip
        return RequestOutput(
            root.request_id, self._prompts.get(root.request_id), root.prompt_token_ids, outs,
            finished=metrics.finished_time is not None, prompt_logprobs=root.prompt_logprobs,
            num_cached_tokens=root.num_cached_tokens, metrics=metrics, error=root.error,
        )  # fmt: skip

    def _beam_output(self, root: Request) -> RequestOutput:
        """The n best finished hypotheses; when aborted or failed before the end, the n best live beams."""
        group = root.beam_group
        skip = root.params.skip_special_tokens
        decode = self.tokenizer.decode
        if group.search.done:
            outs = [
                CompletionOutput(i, decode(h.token_ids, skip_special_tokens=skip), list(h.token_ids),
                                 h.cumulative_logprob, None, h.finish_reason, h.stop_reason)
                for i, h in enumerate(group.search.best(root.params.n))
            ]  # fmt: skip
        else:
            outs = [
                CompletionOutput(i, decode(b.output_token_ids, skip_special_tokens=skip),
                                 list(b.output_token_ids), score,
                                 None, b.status.value if b.is_finished else None)
                for i, (b, score) in enumerate(zip(group.beams[: root.params.n], group.scores))
            ]  # fmt: skip
        finished = all(b.is_finished for b in group.beams)
        metrics = RequestMetrics(root.arrival_time, root.scheduled_time, root.first_token_time,
                                 root.last_token_time, time.monotonic() if finished else None)  # fmt: skip
        return RequestOutput(
            root.request_id, self._prompts.get(root.request_id), root.prompt_token_ids, outs,
            finished=finished, num_cached_tokens=root.num_cached_tokens, metrics=metrics, error=root.error,
        )  # fmt: skip

    def _finish_group(self, root: Request) -> RequestOutput:
        out = self._output(root)
        self._groups.pop(root.request_id, None)
        self._beam_groups.pop(root.request_id, None)
        self._prompts.pop(root.request_id, None)
        for sample in root.samples:
            self._detok.pop(sample.request_id, None)
        return out

    def shutdown(self) -> None:
        """Stop the executor's ranks (a tensor-parallel group's actors and placement group)."""
        self.executor.shutdown()

    # ---- figures -------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        kv = self.block_manager.stats()
        sched = self.scheduler
        logical, physical = self._beam_blocks_now
        return EngineStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting), num_swapped=len(sched.swapped),
            num_blocks=kv.num_blocks, block_size=kv.block_size, free_blocks=kv.free_blocks,
            cached_blocks=kv.cached_blocks, kv_cache_usage=kv.usage, live_fraction=kv.live_fraction,
            prefix_cache_queries=kv.prefix_queries, prefix_cache_hits=kv.prefix_hits,
            num_preemptions=sched.num_preemptions, prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens, num_steps=self.num_steps,
            num_group_restarts=self.num_group_restarts, step_time=dict(self._time),
            beam_blocks_logical=logical, beam_blocks_physical=physical,
            beam_block_steps_logical=self._beam_block_steps[0],
            beam_block_steps_physical=self._beam_block_steps[1],
        )  # fmt: skip

    def take_kv_events(self) -> list[tuple[str, list[int]]]:
        lost, self._lost_events = self._lost_events, []
        return lost + self.block_manager.take_events()


def _top(ids: list[int] | None, values: list[float] | None) -> dict[int, Logprob]:
    if not ids:
        return {}
    return {t: Logprob(v, r) for r, (t, v) in enumerate(zip(ids, values), start=1)}


class AsyncEngine:
    """The engine's step loop in a background thread, with asyncio streams of outputs.

    Requests and aborts are queued to the loop thread (the engine is touched by that thread only),
    so an HTTP server's event loop never waits on a model step.
    """

    def __init__(self, config: EngineConfig | None = None, **flags: Any) -> None:
        self.engine = Engine(config, **flags)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._stats = self.engine.stats()
        self._kv_events: list[tuple[str, list[int]]] = []
        self._snapshot_wanted = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[RequestOutput]:  # fmt: skip
        """Yield the request's cumulative output each step it advances; the last has finished=True.

        Leaving the iterator early (a client disconnect) aborts the request and frees its blocks.
        """
        request_id = request_id or uuid.uuid4().hex
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._commands.put(("add", request_id, prompt, params, kwargs))
        self._wake.set()
        # Outputs are cumulative: when the consumer fell behind, only the newest matters (one
        # delta instead of several, each a message through Serve and the HTTP proxy).
        items = relay(stream, lambda older, newer: newer, lambda out: out.finished,
                      lambda: self.abort(request_id))  # fmt: skip
        try:
            async with aclosing(items):
                async for item in items:
                    yield item
        finally:
            self._streams.pop(request_id, None)

    async def generate_deltas(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[dict[str, Any]]:  # fmt: skip
        """``generate`` as the small deltas the ingress takes (``OutputDeltas``)."""
        deltas = OutputDeltas()
        async with aclosing(self.generate(prompt, params, request_id, **kwargs)) as outputs:
            async for out in outputs:
                yield deltas.delta(out)

    @property
    def failure(self) -> str | None:
        """None while the step loop runs, else why it stopped."""
        return None if self._thread.is_alive() or self._stopped else "the engine's step loop died"

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    async def call_in_loop(self, fn: Callable[[Engine], Any]) -> Any:
        """``fn(engine)`` run on the loop thread between two steps (the engine is that thread's
        alone); its result, or its exception raised here."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", fn, future))
        self._wake.set()
        return await asyncio.wrap_future(future)

    async def block_states(self) -> str:
        """The KV pool's blocks as ``BlockManager.block_states`` describes them, as of now."""
        return await self.call_in_loop(lambda engine: engine.block_manager.block_states())

    async def reset_prefix_cache(self) -> int:
        """Forget every cached-free block's content (their "removed" events follow, so routers
        forget them too); returns how many blocks were dropped. Blocks in use stay."""
        return await self.call_in_loop(lambda engine: engine.block_manager.reset_prefix_cache())

    def stats(self) -> EngineStats:
        """The figures as of the last step (read without stopping the loop)."""
        return self._stats

    def take_kv_events(self) -> list[tuple[str, list[int]]]:
        with self._lock:
            events, self._kv_events = self._kv_events, []
        return events

    def request_kv_snapshot(self) -> None:
        """Have the next KV events start with every block hash the prefix cache holds (one
        "stored" event) instead of what was pending: for a state log that lost everything."""
        self._snapshot_wanted = True
        self._wake.set()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)
        for cmd in self._queued_commands():
            if cmd[0] == "call" and cmd[2].set_running_or_notify_cancel():
                cmd[2].set_exception(RuntimeError("the engine has shut down"))
        self.engine.shutdown()

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _queued_commands(self) -> Iterator[tuple]:
        """The commands queued for the loop thread, taken off the queue one by one."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply_commands(self) -> None:
        for cmd in self._queued_commands():
            if cmd[0] == "add":
                _, request_id, prompt, params, kwargs = cmd
                if request_id not in self._streams:
                    continue  # the caller already left
                try:
                    self.engine.add_request(request_id, prompt, params, **kwargs)
                except Exception as exc:  # reported to the caller, never kills the loop
                    self._deliver(request_id, exc)
            elif cmd[0] == "call":
                _, fn, future = cmd
                if not future.set_running_or_notify_cancel():
                    continue  # the caller stopped waiting (a timeout): never set a cancelled future
                try:
                    future.set_result(fn(self.engine))
                except Exception as exc:
                    future.set_exception(exc)
            else:
                out = self.engine.abort_request(cmd[1])
                if out is not None:
                    self._deliver(cmd[1], out)

    def _run(self) -> None:
        engine = self.engine
        while not self._stopped:
            self._apply_commands()
            if not engine.has_unfinished_requests():
                self._publish()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = engine.step()
            except RankFailure as exc:
                self._recover(exc)
                continue
            except Exception as exc:  # a step failure fails the running requests, not the replica
                logger.exception("engine step failed")
                message = f"engine step failed: {exc}"
                for out in engine.fail_all(message):
                    self._deliver(out.request_id, RuntimeError(message))
                continue
            for out in outputs:
                self._deliver(out.request_id, out)
            self._publish()

    def _recover(self, failure: RankFailure) -> None:
        """A rank died or hung: fail the requests in flight at once, then rebuild the group.

        Requests that arrive meanwhile wait in the command queue and run on the new group; while
        a rebuild keeps failing, they fail too (never left waiting on a dead group).
        """
        logger.error("%s; failing the requests in flight and rebuilding the group", failure)
        message = f"{failure}; the engine is rebuilding its tensor-parallel group, retry the request"
        for out in self.engine.fail_all(message):
            self._deliver(out.request_id, RankFailure(message))
        self._publish()
        delay = 1.0
        while not self._stopped:
            try:
                self.engine.recover()
                logger.info("tensor-parallel group rebuilt")
                return
            except Exception as exc:
                logger.exception("rebuilding the tensor-parallel group failed; retrying in %.0f s", delay)
                self._fail_queued(f"the engine cannot rebuild its tensor-parallel group: {exc}")
                self._wake.wait(timeout=delay)
                self._wake.clear()
                delay = min(2 * delay, 30.0)

    def _fail_queued(self, message: str) -> None:
        for cmd in self._queued_commands():
            if cmd[0] == "add":
                self._deliver(cmd[1], RankFailure(message))
            elif cmd[0] == "call" and cmd[2].set_running_or_notify_cancel():
                cmd[2].set_exception(RankFailure(message))

    def _publish(self) -> None:
        self._stats = self.engine.stats()
        events = self.engine.take_kv_events()
        if self._snapshot_wanted:  # read on the loop thread: the block manager is ours here
            self._snapshot_wanted = False
            with self._lock:
                self._kv_events = [("stored", list(self.engine.block_manager.cached))]
        if events:
            with self._lock:
                self._kv_events.extend(events)


async def relay(stream: asyncio.Queue, combine: Callable[[Any, Any], Any], is_final: Callable[[Any], bool],
                abort: Callable[[], None]) -> AsyncIterator[Any]:  # fmt: skip
    """One request's items from ``stream`` until the final one; an exception put there is raised.

    Items queued while the consumer was busy go on as one, ``combine(older, newer)``. Leaving
    before the final item (a client disconnect) calls ``abort``.
    """
    finished = False
    try:
        while True:
            item = await stream.get()
            while not isinstance(item, BaseException) and not stream.empty():
                newer = stream.get_nowait()
                item = newer if isinstance(newer, BaseException) else combine(item, newer)
            if isinstance(item, BaseException):
                finished = True
                raise item
            finished = is_final(item)
            yield item
            if finished:
                return
    finally:
        if not finished:
            abort()


def run_to_completion(engine: Engine, request_ids: Sequence[str]) -> dict[str, RequestOutput]:
    """Step until every named request finishes; their final outputs by id."""
    pending = set(request_ids)
    finals: dict[str, RequestOutput] = {}
    while pending and engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id in pending:
                finals[out.request_id] = out
                pending.discard(out.request_id)
    if pending:
        raise RuntimeError(f"requests {sorted(pending)[:5]} never finished")
    return finals
