"""The engine's step loop fuzzed: random arrivals (greedy, parallel samples, beam searches), aborts,
small pools that force preemption by recompute or swap, chunked prefill and prefix caching.

The model is replaced by a shadow executor that keeps what a worker keeps (block tables as plan
deltas, forks' tables) over a pool that stores token ids where the worker stores K/V, applies the
plan's swaps and copy-on-write copies as the worker does, and checks, for every scheduled sequence,
that reading its table back gives exactly the tokens the engine believes the request has: a block
shared wrongly, a copy missed or a swap mapped wrongly shows up at the step it happens. After every
step the block manager's invariants hold; at the end every block is free, on device and host.
``PAGEDSERVE_FUZZ_EXAMPLES`` sets how many random programs run (25 by default).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagedserve.cluster.block_manager import RequestTooLong
from pagedserve.cluster.engine import Engine
from pagedserve.cluster.request import RequestStatus
from pagedserve.config import CacheConfig, EngineConfig
from pagedserve.plan import NULL_BLOCK, SampledToken, StepOutput, StepPlan
from pagedserve.sampling import SamplingParams, num_beam_candidates
from pagedserve.worker.kv_groups import kv_cache_groups
from pagedserve.worker.loader import load_config
from tests.cluster.test_block_manager import check_invariants

VOCAB = 48  # token ids the shadow model produces (EOS = 2 among them)


class ShadowExecutor:
    """A worker stand-in over a pool of token ids; the engine is read only to check what was read."""

    def __init__(self, num_blocks: int, num_host_blocks: int) -> None:
        self.num_blocks, self.num_host_blocks = num_blocks, num_host_blocks
        self.engine: Engine | None = None
        self.tables: dict[str, list[list[int]]] = {}  # per KV group
        self.params: dict[str, SamplingParams] = {}
        self.reads = 0

    def determine_num_blocks(self, cache: CacheConfig, max_num_batched_tokens: int) -> tuple[int, int]:
        return self.num_blocks, self.num_host_blocks

    def init_kv_pool(self, num_blocks: int, block_size: int, num_host_blocks: int,
                     hybrid: bool = True) -> None:  # fmt: skip
        self.bs = block_size
        self.kv = [[None] * block_size for _ in range(num_blocks)]
        self.host = [[None] * block_size for _ in range(num_host_blocks)]

    @property
    def windows(self) -> list[int | None]:
        return [g.window for g in self.engine.kv_groups]

    def restart(self) -> None:
        raise RuntimeError("no restarts here")

    def shutdown(self) -> None:
        pass

    def execute(self, plan: StepPlan) -> StepOutput:
        plan = StepPlan.from_wire(msgpack.unpackb(msgpack.packb(plan.to_wire()), strict_map_key=False))
        for req_id in plan.finished:
            self.tables.pop(req_id, None)
            self.params.pop(req_id, None)
        # the worker's order: swap out, swap in, copy, then this step's writes
        for device, host in plan.swap_out:
            self.host[host] = list(self.kv[device])
        for host, device in plan.swap_in:
            self.kv[device] = list(self.host[host])
        for src, dst in plan.copies:
            self.kv[dst] = list(self.kv[src])
        for s in plan.seqs:
            if s.req_id not in self.tables:
                assert s.new is not None, f"first sight of {s.req_id} without its prompt"
                if "fork_of" in s.new:
                    self.params[s.req_id] = self.params[s.new["fork_of"]]
                else:
                    self.params[s.req_id] = SamplingParams.from_dict(s.new["params"])
                self.tables[s.req_id] = [[] for _ in self.windows]
            for table, blocks in zip(self.tables[s.req_id], s.new_blocks, strict=True):
                del table[s.table_start :]
                table.extend(blocks)
                for i, token in enumerate(s.token_ids):
                    pos = s.start_pos + i
                    assert table[pos // self.bs] != NULL_BLOCK or not self.engine.block_manager.num_reserved
                    self.kv[table[pos // self.bs]][pos % self.bs] = token
        out = StepOutput([])
        for s in plan.seqs:
            tokens = self._read(s.req_id, s.start_pos, s.start_pos + len(s.token_ids))
            if not s.sample:
                continue
            params = self.params[s.req_id]
            if params.use_beam_search:
                k = num_beam_candidates(params, self.engine.eos_token_ids)
                gen = torch.Generator().manual_seed(hash(tuple(tokens)) & 0xFFFFFFFF)
                logprobs = torch.randn(VOCAB, generator=gen).mul_(3).log_softmax(-1)
                values, ids = logprobs.topk(k)
                out.beam_candidates[s.req_id] = [ids.tolist(), values.tolist()]
                continue
            for k, row_id in enumerate([s.req_id, *s.fork_ids]):
                if k:
                    self.tables[row_id] = [list(t) for t in self.tables[s.req_id]]
                    self.params[row_id] = params.for_sample(k)
                token = random.Random(hash((tuple(tokens), row_id))).randrange(VOCAB)
                out.sampled.append(SampledToken(row_id, token))
        return out

    def _read(self, req_id: str, start: int, length: int) -> list[int]:
        """The tokens this step's queries (from ``start``) read through each KV group's table (a
        sliding-window group: its window), checked against the engine's request; group 0's."""
        req = self.engine.scheduler.requests[req_id]
        out = []
        for table, window in zip(self.tables[req_id], self.windows):
            lo = 0 if window is None else max(0, start - window + 1)
            tokens = [self.kv[table[p // self.bs]][p % self.bs] for p in range(lo, length)]
            assert tokens == req.all_token_ids[lo:length], f"{req_id} reads back other tokens than its own"
            out.append(tokens)
        self.reads += 1
        assert self.windows[0] is None, "group 0 is full attention in these models"
        return out[0]


PREFIXES = [[11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24, 25, 26]]


@st.composite
def request_params(draw) -> SamplingParams:
    kind = draw(st.sampled_from(["greedy", "samples", "beam", "beam"]))  # beams: the most moving parts
    max_tokens = draw(st.integers(1, 8))
    ignore_eos = draw(st.booleans())
    if kind == "greedy":
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    if kind == "samples":
        return SamplingParams(n=draw(st.integers(2, 3)), temperature=1.0, seed=draw(st.integers(0, 9)),
                              max_tokens=max_tokens, ignore_eos=ignore_eos)  # fmt: skip
    width = draw(st.integers(2, 3))
    return SamplingParams(
        use_beam_search=True, beam_width=width, n=draw(st.integers(1, width)), temperature=0,
        max_tokens=max(2, max_tokens), ignore_eos=ignore_eos,
        length_penalty=draw(st.sampled_from([0.5, 1.0, 2.0])),
        early_stopping=draw(st.sampled_from([False, True, "never"])),
    )  # fmt: skip


def check_engine(engine: Engine) -> None:
    sched, bm = engine.scheduler, engine.block_manager
    check_invariants(bm)
    for req in sched.running:
        assert req.status is RequestStatus.RUNNING and req.request_id in bm
        assert not bm.is_swapped(req.request_id)
    for req in sched.swapped:
        assert req.status is RequestStatus.SWAPPED and bm.is_swapped(req.request_id)
    for req in sched.waiting:
        assert req.status is RequestStatus.WAITING and req.request_id not in bm
    for root in engine._groups.values():
        if root.beam_group is not None:
            for beam in root.beam_group.beams:
                assert not beam.is_finished and sched.requests[beam.request_id] is beam


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    """Only its tokenizer and config are read (the shadow executor is the model): a Llama (one KV
    group), and a Gemma 3 whose sliding-window layer gets its own group (hybrid KV, window 16)."""
    return request.getfixturevalue("tiny_engine_model" if request.param == "llama" else "tiny_engine_gemma3")


@settings(max_examples=int(os.environ.get("PAGEDSERVE_FUZZ_EXAMPLES", "25")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
@given(data=st.data())
def test_engine_fuzz_with_a_shadow_pool(model_dir, data):
    mode = data.draw(st.sampled_from(["recompute", "swap"]), label="preemption")
    block_size = data.draw(st.sampled_from([2, 4]), label="bs")
    # a pool just above one request's worth in every KV group (and the null block with sliding
    # windows): preemption is the rule, not the exception
    groups = kv_cache_groups(load_config(model_dir))
    num_blocks = len(groups) * 48 // block_size + (len(groups) > 1) + data.draw(st.integers(0, 12),
                                                                                label="extra blocks")
    host_blocks = data.draw(st.sampled_from([6, 200]), label="host blocks")  # 6: swap often falls back
    config = EngineConfig.from_flags(
        model=str(model_dir), max_model_len=48, block_size=block_size,
        max_num_seqs=data.draw(st.sampled_from([4, 8, 16]), label="max seqs"),
        max_num_batched_tokens=data.draw(st.sampled_from([8, 16, 64]), label="budget"),
        enable_prefix_caching=data.draw(st.booleans(), label="prefix caching"), preemption_mode=mode,
        watermark=0.0,
    )  # fmt: skip
    shadow = ShadowExecutor(num_blocks, host_blocks)
    engine = Engine(config, executor=shadow)
    shadow.engine = engine
    live: list[str] = []
    for n in range(data.draw(st.integers(1, 60), label="actions")):
        action = data.draw(st.sampled_from(["add", "add", "add", "step", "step", "abort"]))
        if action == "add":
            prompt = data.draw(st.sampled_from(PREFIXES + [[]])) + data.draw(
                st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=14)
            )
            try:
                engine.add_request(f"r{n}", {"prompt_token_ids": prompt}, data.draw(request_params()))
                live.append(f"r{n}")
            except RequestTooLong:
                pass
        elif action == "abort" and live:
            engine.abort_request(live.pop(data.draw(st.integers(0, len(live) - 1))))
        else:
            engine.step()
        check_engine(engine)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        check_engine(engine)
        steps += 1
        assert steps < 2000, "the engine stopped making progress"
    engine.step()  # the workers hear about the last finished requests
    st_ = engine.stats()
    event(f"preempted: {st_.num_preemptions > 0}, mode {mode}")
    event(f"beam steps: {st_.beam_block_steps_logical > 0}")
    event(f"shared beam blocks: {st_.beam_block_steps_physical < st_.beam_block_steps_logical}")
    event(f"prefix hits: {st_.prefix_cache_hits > 0}")
    assert not engine._groups and not shadow.tables
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks
    bm = engine.block_manager
    assert sorted(bm.host_free) == list(range(bm.num_host_blocks)) and not any(bm.host_ref_count)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_engine_loop_with_random_aborts_on_a_real_model(tiny_engine_model, seed):
    """The tiny model for real: 24 mixed requests (greedy, n = 3 samples, width-3 beam searches)
    into a pool small enough to preempt, a random abort now and then; the greedy requests that were
    not aborted still equal transformers', and at the end every block is free."""
    from tests.cluster.test_engine import hf_greedy

    rng = random.Random(seed)
    engine = Engine(EngineConfig.from_flags(
        model=str(tiny_engine_model), dtype="float32", max_model_len=96, block_size=4,
        num_gpu_blocks_override=48, max_num_batched_tokens=32,
        preemption_mode=["recompute", "swap"][seed % 2],
    ))  # fmt: skip
    prompts, kinds = {}, {}
    for i in range(24):
        tail = [rng.randrange(100, 40000) for _ in range(rng.randrange(3, 20))]
        prompt = rng.choice(PREFIXES + [[]]) + tail
        kind = rng.choice(["greedy", "samples", "beam"])
        params = {
            "greedy": SamplingParams(temperature=0, max_tokens=8),
            "samples": SamplingParams(n=3, temperature=1.0, seed=i, max_tokens=8),
            "beam": SamplingParams(use_beam_search=True, n=2, beam_width=3, temperature=0, max_tokens=8),
        }[kind]
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
        prompts[f"r{i}"], kinds[f"r{i}"] = prompt, kind
    finals, aborted = {}, set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        check_engine(engine)
        if rng.random() < 0.1:
            live = sorted(set(prompts) - set(finals) - aborted)
            if live:
                victim = rng.choice(live)
                finals[victim] = engine.abort_request(victim)
                aborted.add(victim)
    engine.step()
    assert engine.stats().num_preemptions > 0 and aborted
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks
    greedy = sorted(r for r in prompts if kinds[r] == "greedy" and r not in aborted)
    expected = hf_greedy(tiny_engine_model, [prompts[r] for r in greedy], 8)
    assert [finals[r].outputs[0].token_ids for r in greedy] == expected
    assert all(finals[r].outputs[0].finish_reason == "abort" for r in aborted)
