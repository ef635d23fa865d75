"""Tensor parallelism over Ray actors (gloo on CPU): one scheduler, one plan per step, N ranks.

Greedy tokens equal size 1 and transformers' generate, with prefix caching, chunked prefill and
both kinds of preemption; seeded samples equal size 1; a rank that dies or hangs fails the
requests in flight, the group is rebuilt, and the next requests succeed with every block back.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import ray

from pagedserve import LLM, SamplingParams
from pagedserve.cluster.engine import AsyncEngine
from pagedserve.cluster.executor import RankFailure
from pagedserve.cluster.ray_executor import RayExecutor
from pagedserve.config import ConfigError
from tests.cluster.test_engine import GREEDY, MAX_NEW, assert_pool_empty, hf_greedy, mixed_prompts, run

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]


def tp_llm(model: Path | None, tp: int, **flags) -> LLM:
    llm = LLM(str(model) if model else None, tensor_parallel_size=tp, dtype="float32", **flags)
    assert isinstance(llm.engine.executor, RayExecutor) and len(llm.engine.executor.ranks) == tp
    return llm


def assert_group_released(llm: LLM) -> None:
    """After shutdown the ranks are gone and their placement group no longer holds CPUs."""
    pids = llm.engine.executor.pids
    llm.shutdown()
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), "rank processes must exit with the engine"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "gemma3"])
def test_size_2_greedy_equals_transformers_with_caching_chunking_and_preemption(
    kind, tiny_engine_model, tiny_engine_qwen2, tiny_engine_qwen3, tiny_engine_gemma3
):
    """Llama (2 KV heads: one per rank), Qwen2 (1 KV head: replicated on both ranks), Qwen3 (query
    and key norms over each rank's heads), Gemma 3 (1 KV head; a sliding layer and a global one)."""
    models = {"llama": tiny_engine_model, "qwen2": tiny_engine_qwen2, "qwen3": tiny_engine_qwen3,
              "gemma3": tiny_engine_gemma3}  # fmt: skip
    model = models[kind]
    prompts = mixed_prompts()
    expected = hf_greedy(model, prompts, MAX_NEW)
    for mode in ("recompute", "swap"):
        # a pool small enough to preempt, chunks of 24 tokens, prefix caching on (the default);
        # Gemma 3's layers form two KV groups (hybrid KV): a block holds one layer, not two
        blocks = 20 if kind != "gemma3" else 46
        llm = tp_llm(model, 2, num_gpu_blocks_override=blocks, max_model_len=160, block_size=8,
                     preemption_mode=mode, swap_space=0.002, max_num_batched_tokens=24)  # fmt: skip
        try:
            assert run(llm, prompts, GREEDY) == expected
            st = llm.stats()
            assert st.num_preemptions > 0, "the pool is small enough that preemption must happen"
            assert st.prefix_cache_hits > 0, "the shared prefixes must hit the prefix cache"
            assert_pool_empty(llm)
        finally:
            assert_group_released(llm)


def test_one_rank_in_its_own_process_equals_in_process(tiny_engine_model):
    """distributed_executor_backend="ray" at size 1: the model runs in a rank actor, the scheduler here."""
    prompts = mixed_prompts(8, seed=2)
    expected = hf_greedy(tiny_engine_model, prompts, MAX_NEW)
    llm = LLM(str(tiny_engine_model), dtype="float32", distributed_executor_backend="ray",
              num_gpu_blocks_override=64, max_model_len=160, block_size=8)  # fmt: skip
    try:
        assert isinstance(llm.engine.executor, RayExecutor) and len(llm.engine.executor.ranks) == 1
        assert run(llm, prompts, GREEDY) == expected
        assert_pool_empty(llm)
    finally:
        assert_group_released(llm)


def test_seeded_parallel_samples_equal_size_1(tiny_engine_model):
    prompts = [{"prompt_token_ids": list(range(300, 333))}, {"prompt_token_ids": list(range(900, 917))}]
    # top_k: a random model's distribution is nearly flat over 49k tokens, where the inverse CDF
    # turns the ~1e-7 logit differences of another reduction order (two ranks) into a neighbour
    # token now and then; over five candidates it does not
    params = SamplingParams(n=3, temperature=1.0, top_k=5, seed=1234, max_tokens=10, ignore_eos=True)
    flags = dict(num_gpu_blocks_override=128, max_model_len=256, block_size=8)
    single = LLM(str(tiny_engine_model), dtype="float32", **flags)
    alone = [[c.token_ids for c in out.outputs] for out in single.generate(prompts, params)]
    llm = tp_llm(tiny_engine_model, 2, **flags)
    try:
        assert [[c.token_ids for c in out.outputs] for out in llm.generate(prompts, params)] == alone
        assert all(len({tuple(s) for s in samples}) == 3 for samples in alone)
        assert_pool_empty(llm)
    finally:
        assert_group_released(llm)


def test_beam_search_at_size_2_equals_transformers_under_swap(tiny_engine_model):
    """Beams forked on every rank (each keeps every beam's table), candidates from rank 0, group
    swaps moving each rank's shard of the shared blocks once."""
    from tests.cluster.test_beam_search import beam_params, hf_beams, random_prompts

    prompts = random_prompts(3, seed=4)
    llm = tp_llm(tiny_engine_model, 2, num_gpu_blocks_override=30, max_model_len=64, block_size=4,
                 preemption_mode="swap", max_num_batched_tokens=64)  # fmt: skip
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], beam_params(4, 2, 1.0, False, n=2))
        for p, out in zip(prompts, outs):
            assert [o.token_ids for o in out.outputs] == hf_beams(tiny_engine_model, p, 4, 2, 14, [2])
        assert llm.stats().num_preemptions > 0
        assert_pool_empty(llm)
    finally:
        assert_group_released(llm)


def test_head_count_the_size_does_not_divide_is_refused_at_start(tiny_engine_model, smollm2_dir):
    with pytest.raises(ConfigError, match=r"9 attention heads, 3 KV heads"):
        LLM(None, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match=r"4 attention heads, 2 KV heads.*not divisible by 3"):
        LLM(str(tiny_engine_model), tensor_parallel_size=3)


def test_smollm2_size_3_greedy_equals_size_1_and_transformers(smollm2_dir):
    """The real default model split over 3 ranks (3 heads and 1 KV head each), in fp32, with
    shared prefixes, a pool small enough to preempt (recompute) and chunked prefill."""
    prompts = mixed_prompts(12, seed=7, shared=48)
    expected = hf_greedy(smollm2_dir, prompts, 12)
    flags = dict(num_gpu_blocks_override=30, max_model_len=320, block_size=16, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=12)
    single = LLM(None, dtype="float32", **flags)
    assert run(single, prompts, params) == expected
    llm = tp_llm(None, 3, **flags)
    try:
        assert run(llm, prompts, params) == expected
        st = llm.stats()
        assert st.num_preemptions > 0 and st.prefix_cache_hits > 0
        assert_pool_empty(llm)
    finally:
        assert_group_released(llm)


def test_smollm2_size_3_swap_preemption(smollm2_dir):
    prompts = mixed_prompts(8, seed=3, shared=48)
    expected = hf_greedy(smollm2_dir, prompts, 12)
    llm = tp_llm(None, 3, num_gpu_blocks_override=24, max_model_len=320, block_size=16,
                 preemption_mode="swap", swap_space=0.05)  # fmt: skip
    try:
        assert run(llm, prompts, SamplingParams(temperature=0, max_tokens=12)) == expected
        assert llm.stats().num_preemptions > 0
        assert_pool_empty(llm)
        bm = llm.engine.block_manager
        assert len(bm.host_free) == bm.num_host_blocks
    finally:
        assert_group_released(llm)


async def _stream_until_failure(engine: AsyncEngine, prompts: list[str], kill) -> list[BaseException]:
    """Start one stream per prompt; once every stream has a token, call kill(); collect how each ended."""
    started = asyncio.Event()
    seen: set[int] = set()

    async def one(i: int) -> BaseException | None:
        params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0)
        try:
            async for out in engine.generate(prompts[i], params):
                if out.outputs[0].token_ids:
                    seen.add(i)
                    if len(seen) == len(prompts):
                        started.set()
        except RankFailure as exc:
            return exc
        return None

    tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
    await asyncio.wait_for(started.wait(), 120)
    kill()
    return await asyncio.wait_for(asyncio.gather(*tasks), 60)


@pytest.mark.parametrize(
    "fault, transport",
    [("killed", "socket"), ("hung", "socket"), ("killed", "compiled_graph"), ("killed", "actor_call")],
)
def test_a_lost_rank_fails_its_requests_and_the_group_is_rebuilt(tiny_engine_model, fault, transport):
    engine = AsyncEngine(model=str(tiny_engine_model), tensor_parallel_size=2, dtype="float32",
                         num_gpu_blocks_override=128, max_model_len=256, block_size=8,
                         step_timeout_s=5, plan_transport=transport)  # fmt: skip
    executor = engine.engine.executor
    old_pids = list(executor.pids)
    try:
        expected = asyncio.run(_final_text(engine, "Hello there"))

        def kill() -> None:
            if fault == "killed":
                ray.kill(executor.ranks[1], no_restart=True)
            else:  # alive but never answering: the step times out
                os.kill(old_pids[1], signal.SIGSTOP)

        t0 = time.monotonic()
        ends = asyncio.run(_stream_until_failure(engine, [f"Story {i}:" for i in range(4)], kill))
        assert all(isinstance(e, RankFailure) for e in ends), ends
        assert "rebuilding its tensor-parallel group" in str(ends[0])
        assert time.monotonic() - t0 < 5 + 30, "the requests must fail within the step timeout"
        # the group is rebuilt (new processes) and serves the next request as before
        assert asyncio.run(_final_text(engine, "Hello there")) == expected
        assert not set(executor.pids) & set(old_pids)
        st = engine.engine.stats()
        assert st.num_group_restarts == 1
        assert st.free_blocks == st.num_blocks and not engine.engine.block_manager.seqs
    finally:
        if fault == "hung":
            try:
                os.kill(old_pids[1], signal.SIGCONT)
            except ProcessLookupError:
                pass
        engine.shutdown()


async def _final_text(engine: AsyncEngine, prompt: str) -> str:
    last = None
    async for out in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=8)):
        last = out
    return last.outputs[0].text


def test_a_private_ray_runs_its_workers_at_the_drivers_niceness(ray_session) -> None:
    # Ray's default puts workers at nice 15, where an engine's model thread loses its core to
    # every ordinary process that wakes; init_ray asks for nice 0 (relative to the driver's own)
    @ray.remote(num_cpus=0)
    def niceness() -> int:
        return os.nice(0)

    assert ray.get(niceness.remote(), timeout=120) == os.nice(0)
