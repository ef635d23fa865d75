"""AsyncEngine: streams, concurrency, early exit aborts, errors reach the caller."""

import asyncio

import pytest

from pagedserve import LLM
from pagedserve.cluster.block_manager import RequestTooLong
from pagedserve.cluster.engine import AsyncEngine
from pagedserve.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_engine_model):
    eng = AsyncEngine(
        model=str(tiny_engine_model), dtype="float32", num_gpu_blocks_override=64, max_model_len=128,
        block_size=8,
    )
    yield eng
    eng.shutdown()


async def wait_idle(engine, tries: int = 200) -> None:
    """Until the engine (an AsyncEngine or an EngineProcess) runs nothing and holds no block."""
    for _ in range(tries):
        st = engine.stats()
        if st.num_running == st.num_waiting == 0 and st.free_blocks == st.num_blocks:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine not idle: {engine.stats()}")


def test_streams_are_cumulative_and_equal_the_sync_result(engine, tiny_engine_model):
    async def main():
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        prompts = [{"prompt_token_ids": list(range(100 + i, 120 + i))} for i in range(4)]

        async def one(i):
            seen = []
            async for out in engine.generate(prompts[i], params, request_id=f"s{i}"):
                seen.append(list(out.outputs[0].token_ids))
            return seen

        streams = await asyncio.gather(*(one(i) for i in range(4)))
        for seen in streams:
            assert len(seen[-1]) == 10
            assert all(a == seen[-1][: len(a)] for a in seen)  # each output extends the last
        await wait_idle(engine)
        return [s[-1] for s in streams]

    streamed = asyncio.run(main())
    llm = LLM(str(tiny_engine_model), dtype="float32", num_gpu_blocks_override=64, max_model_len=128,
              block_size=8)  # fmt: skip
    prompts = [{"prompt_token_ids": list(range(100 + i, 120 + i))} for i in range(4)]
    direct = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert streamed == [o.outputs[0].token_ids for o in direct]


def test_leaving_the_stream_aborts_and_frees_blocks(engine):
    async def main():
        params = SamplingParams(max_tokens=100, ignore_eos=True)
        before = engine.engine.generation_tokens
        agen = engine.generate({"prompt_token_ids": list(range(60))}, params, request_id="leaver")
        async for out in agen:
            if len(out.outputs[0].token_ids) >= 2:
                break
        await agen.aclose()
        await wait_idle(engine)
        assert engine.engine.generation_tokens - before < 100, "the request ran on after its caller left"

    asyncio.run(main())


def test_errors_reach_the_caller_and_the_loop_survives(engine):
    async def main():
        with pytest.raises(RequestTooLong):
            async for _ in engine.generate({"prompt_token_ids": list(range(300))}, SamplingParams()):
                pass
        outs = [o async for o in engine.generate("hello", SamplingParams(max_tokens=3, ignore_eos=True))]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3

    asyncio.run(main())


def test_block_states_and_prefix_cache_reset_run_between_steps(engine):
    """The dashboard's block map is the pool as the block manager holds it: while two requests
    share a prompt its full blocks are shared, after they finish cached-free; a reset drops the
    cached content (and says how many blocks) without touching anything in use."""

    async def main():
        await wait_idle(engine)
        await engine.reset_prefix_cache()
        # 5 full blocks of 8: the second request shares the first 4 (its last token is computed)
        prompt = {"prompt_token_ids": list(range(100, 140))}
        params = SamplingParams(max_tokens=30, ignore_eos=True)
        first = engine.generate(prompt, params, request_id="share-a")
        await anext(first)
        second = engine.generate(prompt, params, request_id="share-b")
        await anext(second)
        states = await engine.block_states()
        assert len(states) == 64 and states.count("s") == 4 and set(states) <= set(".cus")
        async for _ in first:
            pass
        async for _ in second:
            pass
        await wait_idle(engine)
        states = await engine.block_states()
        assert "u" not in states and "s" not in states and states.count("c") >= 5
        assert await engine.reset_prefix_cache() == states.count("c")
        assert set(await engine.block_states()) == {"."}

    asyncio.run(main())


def test_a_loop_call_whose_caller_gave_up_does_not_stop_the_engine(engine):
    """A caller that stops waiting (the dashboard's block map has a deadline) cancels its future
    before the loop thread reaches it; the loop skips it and keeps serving."""

    async def main():
        import time

        busy = asyncio.ensure_future(engine.call_in_loop(lambda _: time.sleep(0.3)))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(engine.block_states(), 0.05)
        await busy
        prompt = {"prompt_token_ids": [5, 6, 7]}
        out = [o async for o in engine.generate(prompt, SamplingParams(max_tokens=3))]
        assert out[-1].finished and len(out[-1].outputs[0].token_ids) == 3
        assert len(await engine.block_states()) == 64

    asyncio.run(main())
