"""EngineProcess: the engine in a child process, behind AsyncEngine's interface.

Oracles: the in-process LLM on the same model (greedy tokens and text), the block manager's own
figures (every block back in the pool), the OS (the child's pid, its exit).
"""

import asyncio
import os
import signal

import pytest

from pagedserve import LLM
from pagedserve.cluster.block_manager import RequestTooLong
from pagedserve.cluster.engine_process import ENGINE_NICE, EngineProcess, EngineProcessDied
from pagedserve.cluster.outputs import merge_deltas
from pagedserve.sampling import SamplingParams, SamplingParamsError
from tests.cluster.test_async_engine import wait_idle

FLAGS = dict(dtype="float32", num_gpu_blocks_override=64, max_model_len=128, block_size=8)


def _flags(model) -> dict:
    return {"model": str(model), **FLAGS}


def _apply(text: str, tokens: list[int], delta: dict) -> tuple[str, list[int]]:
    for sample in delta["outputs"]:
        text = text[: sample["text_start"]] + sample["text"]
        tokens = tokens + sample["token_ids"]
    return text, tokens


def test_the_process_streams_what_the_in_process_engine_generates(tiny_engine_model):
    prompts = [{"prompt_token_ids": list(range(100 + i, 120 + i))} for i in range(4)] + ["Hello, my name is"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def main():
        engine = await EngineProcess.start(_flags(tiny_engine_model))
        try:
            assert engine.pid != os.getpid() and os.path.exists(f"/proc/{engine.pid}")

            async def one(i):
                text, tokens, finished = "", [], []
                async for delta in engine.generate_deltas(prompts[i], params, request_id=f"r{i}"):
                    text, tokens = _apply(text, tokens, delta)
                    finished.append(delta["finished"])
                assert finished[-1] and not any(finished[:-1])
                return text, tokens

            got = await asyncio.gather(*(one(i) for i in range(len(prompts))))
            await wait_idle(engine, tries=300)
            stats = engine.stats()
            assert stats.generation_tokens == 12 * len(prompts) and stats.num_steps > 0
            return got
        finally:
            engine.shutdown()

    got = asyncio.run(main())
    llm = LLM(str(tiny_engine_model), **FLAGS)
    try:
        direct = llm.generate(prompts, params)
    finally:
        llm.shutdown()
    assert got == [(o.outputs[0].text, o.outputs[0].token_ids) for o in direct]


def test_errors_reach_the_caller_and_leaving_a_stream_frees_its_blocks(tiny_engine_model):
    async def main():
        engine = await EngineProcess.start(_flags(tiny_engine_model))
        try:
            with pytest.raises(RequestTooLong):  # 300 tokens need more blocks than the pool holds
                async for _ in engine.generate_deltas({"prompt_token_ids": list(range(300))}):
                    pass
            with pytest.raises(SamplingParamsError) as err:
                bad = SamplingParams(max_tokens=4)
                bad.top_p = 7.0  # past the dataclass's own check: the engine's must catch it
                async for _ in engine.generate_deltas("hi", bad):
                    pass
            assert err.value.param == "top_p"
            # a caller that leaves after two tokens aborts the request
            before = engine.stats().generation_tokens
            agen = engine.generate_deltas({"prompt_token_ids": list(range(60))},
                                          SamplingParams(max_tokens=100, ignore_eos=True))  # fmt: skip
            seen = 0
            async for delta in agen:
                seen += sum(len(s["token_ids"]) for s in delta["outputs"])
                if seen >= 2:
                    break
            await agen.aclose()
            await wait_idle(engine, tries=300)
            assert engine.stats().generation_tokens - before < 100, "the request ran on after its caller left"
            # the loop survived all of it
            three = SamplingParams(max_tokens=3, ignore_eos=True)
            deltas = [d async for d in engine.generate_deltas("hello", three)]
            assert deltas[-1]["finished"]
            assert sum(len(s["token_ids"]) for d in deltas for s in d["outputs"]) == 3
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_block_states_prefix_reset_kv_events_and_snapshot(tiny_engine_model):
    async def main():
        engine = await EngineProcess.start(_flags(tiny_engine_model), cpus=[0])
        try:
            assert os.sched_getaffinity(engine.pid) == {0}, "the child runs on the cores it was given"
            # a CPU engine raises its priority over the HTTP stack, every thread of it (where allowed)
            nices = {int(open(f"/proc/{engine.pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()[16])
                     for t in os.listdir(f"/proc/{engine.pid}/task")}  # fmt: skip
            expected = ENGINE_NICE if ENGINE_NICE else os.getpriority(os.PRIO_PROCESS, 0)
            assert nices == {expected} or (ENGINE_NICE < 0 and os.geteuid() != 0)
            prompt = {"prompt_token_ids": list(range(200, 240))}  # 5 full blocks of 8
            async for _ in engine.generate_deltas(prompt, SamplingParams(max_tokens=1)):
                pass
            await wait_idle(engine, tries=300)
            stored = [h for kind, hashes in engine.take_kv_events() if kind == "stored" for h in hashes]
            assert len(stored) == 5
            states = await engine.block_states()
            assert len(states) == engine.stats().num_blocks and states.count("c") == 5
            engine.request_kv_snapshot()
            for _ in range(100):
                events = engine.take_kv_events()
                if events:
                    break
                await asyncio.sleep(0.02)
            assert events == [("stored", stored)] or sorted(events[0][1]) == sorted(stored)
            assert await engine.reset_prefix_cache() == 5
            await asyncio.sleep(0.1)
            removed = [h for kind, hashes in engine.take_kv_events() if kind == "removed" for h in hashes]
            assert sorted(removed) == sorted(stored)
            assert (await engine.block_states()).count("c") == 0
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_a_killed_engine_fails_its_requests_and_says_so(tiny_engine_model):
    async def main():
        engine = await EngineProcess.start(_flags(tiny_engine_model))
        agen = engine.generate_deltas({"prompt_token_ids": list(range(40))},
                                      SamplingParams(max_tokens=100, ignore_eos=True))  # fmt: skip
        await agen.__anext__()
        os.kill(engine.pid, signal.SIGKILL)
        with pytest.raises(EngineProcessDied, match="exited"):
            async for _ in agen:
                pass
        assert engine.failure is not None
        with pytest.raises(EngineProcessDied):  # new requests fail at once, never hang
            await asyncio.wait_for(engine.generate_deltas("x").__anext__(), 5)
        engine.shutdown()

    asyncio.run(main())


def test_the_engine_exits_when_it_is_shut_down_or_its_replica_goes(tiny_engine_model):
    async def main():
        engine = await EngineProcess.start(_flags(tiny_engine_model))
        pid = engine.pid
        engine.shutdown()
        assert engine._proc.poll() == 0, "a polite shutdown ends with exit code 0"
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
        # the replica's end of the socket closing (its process gone) ends the child too
        engine = await EngineProcess.start(_flags(tiny_engine_model))
        engine._transport.close()
        assert await asyncio.to_thread(engine._proc.wait, 30) == 0

    asyncio.run(main())


def test_merged_deltas_equal_the_deltas_applied_in_turn():
    base = "Hello wor"
    d1 = {"outputs": [{"index": 0, "text_start": 9, "text": "ld STO", "token_ids": [1, 2], "logprobs": None,
                       "finish_reason": None, "stop_reason": None}], "finished": False,
          "num_prompt_tokens": 3, "num_cached_tokens": 0}  # fmt: skip
    # the stop string "STOP" is found: the tail already sent is cut
    d2 = {"outputs": [{"index": 0, "text_start": 12, "text": "", "token_ids": [3], "logprobs": None,
                       "finish_reason": "stop", "stop_reason": "STOP"},
                      {"index": 1, "text_start": 0, "text": "x", "token_ids": [9], "logprobs": None,
                       "finish_reason": None, "stop_reason": None}], "finished": True,
          "num_prompt_tokens": 3, "num_cached_tokens": 0}  # fmt: skip
    d3 = {"outputs": [{"index": 0, "text_start": 9, "text": "ld!", "token_ids": [4], "logprobs": None,
                       "finish_reason": None, "stop_reason": None}], "finished": False,
          "num_prompt_tokens": 3, "num_cached_tokens": 0}  # fmt: skip
    def index0(delta):
        return {"outputs": [s for s in delta["outputs"] if s["index"] == 0]}

    for first, then in ((d1, d2), (d1, d3)):
        text, tokens = _apply(base, [], index0(first))
        text, tokens = _apply(text, tokens, index0(then))
        merged = merge_deltas(first, then)
        assert _apply(base, [], index0(merged)) == (text, tokens)
        assert merged["finished"] == then["finished"]
    merged = merge_deltas(d1, d2)
    assert merged["outputs"][0]["finish_reason"] == "stop" and merged["outputs"][1]["token_ids"] == [9]
