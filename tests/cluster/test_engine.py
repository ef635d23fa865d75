"""The engine end to end on CPU: greedy tokens equal transformers' generate, token for token."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve import LLM, SamplingParams
from pagedserve.cluster.block_manager import RequestTooLong
from pagedserve.config import ConfigError

MAX_NEW = 12


@functools.lru_cache(maxsize=4)
def hf_model(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


def hf_greedy(path: Path, prompts: list[list[int]], max_new: int, eos: int = 2) -> list[list[int]]:
    """transformers' own greedy generation, one prompt at a time (no padding effects)."""
    model = hf_model(str(path))
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(
                torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), do_sample=False,
                max_new_tokens=max_new, eos_token_id=eos, pad_token_id=eos,
            )  # fmt: skip
            out.append(ids[0, len(p) :].tolist())
    return out


def mixed_prompts(n: int = 16, seed: int = 0, shared: int = 40) -> list[list[int]]:
    """Prompts of 5..70 tokens; every other one starts with one of two shared prefixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 49000) for _ in range(shared)] for _ in range(2)]
    prompts = []
    for i in range(n):
        tail = [rng.randrange(100, 49000) for _ in range(rng.randrange(5, 30))]
        prompts.append(prefixes[i % 4 // 2] + tail if i % 2 == 0 else tail * 2)
    return prompts


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def assert_pool_empty(llm: LLM) -> None:
    st = llm.stats()
    assert st.num_running == st.num_waiting == st.num_swapped == 0
    assert st.free_blocks == st.num_blocks, "every KV block must be back in the pool"
    assert llm.engine.block_manager.seqs == {}


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def expected(tiny_engine_model: Path) -> list[list[int]]:
    return hf_greedy(tiny_engine_model, mixed_prompts(), MAX_NEW)


def test_greedy_with_prefix_caching_equals_transformers(tiny_engine_model, expected):
    llm = LLM(str(tiny_engine_model), dtype="float32", num_gpu_blocks_override=256, max_model_len=256,
              block_size=8)  # fmt: skip
    prompts = mixed_prompts()
    assert run(llm, prompts, GREEDY) == expected
    # Again: now the prompts' full blocks are all cached, and the result must not change.
    assert run(llm, prompts, GREEDY) == expected
    st = llm.stats()
    assert st.prefix_cache_hits > 0.5 * sum(len(p) for p in prompts)
    assert_pool_empty(llm)


@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
def test_other_families_greedy_with_prefix_caching_equals_transformers(kind, tiny_engine_qwen3,
                                                                      tiny_engine_gemma3):  # fmt: skip
    """Qwen3 and Gemma 3 (prompts of up to 70 tokens against its 16-token window) at size 1."""
    model = tiny_engine_qwen3 if kind == "qwen3" else tiny_engine_gemma3
    prompts = mixed_prompts(8, seed=3)
    llm = LLM(str(model), dtype="float32", num_gpu_blocks_override=64, max_model_len=160, block_size=8)
    assert run(llm, prompts, GREEDY) == hf_greedy(model, prompts, MAX_NEW)
    assert llm.stats().prefix_cache_hits > 0
    assert_pool_empty(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_under_preemption_equals_transformers(tiny_engine_model, expected, mode):
    llm = LLM(
        str(tiny_engine_model), dtype="float32", num_gpu_blocks_override=20, max_model_len=160, block_size=8,
        preemption_mode=mode, swap_space=0.002, max_num_batched_tokens=160,
    )  # fmt: skip
    assert run(llm, mixed_prompts(), GREEDY) == expected
    assert llm.stats().num_preemptions > 0, "the pool is small enough that preemption must happen"
    assert_pool_empty(llm)
    assert len(llm.engine.block_manager.host_free) == llm.engine.block_manager.num_host_blocks


def test_greedy_with_chunked_prefill_equals_transformers(tiny_engine_model, expected):
    llm = LLM(
        str(tiny_engine_model), dtype="float32", num_gpu_blocks_override=256, max_model_len=256,
        block_size=16, max_num_batched_tokens=24, enable_prefix_caching=False,
    )  # fmt: skip
    seen_partial = []
    step, scheduler = llm.engine.step, llm.engine.scheduler

    def spy():
        out = step()
        seen_partial.append(any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running))
        return out

    llm.engine.step = spy
    assert run(llm, mixed_prompts(), GREEDY) == expected
    assert any(seen_partial), "some prompt must have been split across steps"
    assert_pool_empty(llm)


def test_seeded_parallel_samples_do_not_depend_on_the_batch(tiny_engine_model):
    llm = LLM(str(tiny_engine_model), dtype="float32", num_gpu_blocks_override=256, max_model_len=256,
              block_size=8)  # fmt: skip
    prompt = {"prompt_token_ids": list(range(300, 333))}
    params = SamplingParams(n=3, temperature=1.0, top_p=0.95, seed=1234, max_tokens=10, ignore_eos=True)
    alone = [c.token_ids for c in llm.generate([prompt], params)[0].outputs]
    assert len(alone) == 3 and len({tuple(a) for a in alone}) == 3
    noise = [{"prompt_token_ids": p} for p in mixed_prompts(12, seed=5)]
    noise_params = [SamplingParams(temperature=0.8, max_tokens=15, ignore_eos=True)] * 12
    busy = llm.generate([*noise[:6], prompt, *noise[6:]], [*noise_params[:6], params, *noise_params[6:]])
    assert [c.token_ids for c in busy[6].outputs] == alone
    # The three samples shared the prompt's blocks: the partial last block was copied on write.
    assert_pool_empty(llm)


def test_parallel_samples_share_prompt_blocks(tiny_engine_model):
    llm = LLM(str(tiny_engine_model), dtype="float32", num_gpu_blocks_override=64, max_model_len=256,
              block_size=8)  # fmt: skip
    engine = llm.engine
    engine.add_request(
        "r",
        {"prompt_token_ids": list(range(500, 520))},
        SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True),
    )
    while not engine.scheduler.running or len(engine.scheduler.running) < 4:
        engine.step()
    tables = [engine.block_manager.block_table(r.request_id) for r in engine.scheduler.running]
    # 20 prompt tokens = 2 full blocks + a partial one: right after the fork all 4 share all 3
    assert all(t == tables[0] for t in tables)
    assert engine.block_manager.blocks[tables[0][2]].ref_count == 4
    engine.step()  # each sample appends its first token: 3 copy the partial block, the last writes in place
    tables = [engine.block_manager.block_table(r.request_id) for r in engine.scheduler.running]
    assert all(t[:2] == tables[0][:2] for t in tables)
    assert engine.block_manager.blocks[tables[0][0]].ref_count == 4
    assert len({t[2] for t in tables}) == 4
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_empty(llm)


def test_stops_lengths_and_errors(tiny_engine_model):
    llm = LLM(str(tiny_engine_model), dtype="float32", num_gpu_blocks_override=64, max_model_len=128,
              block_size=8)  # fmt: skip
    prompt = {"prompt_token_ids": list(range(1000, 1010))}
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 20
    # a stop token id ends generation at that token, which is kept in token_ids
    stop_id = base.token_ids[5]
    first = base.token_ids.index(stop_id)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id]))[0]
    assert out.outputs[0].token_ids == base.token_ids[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id
    # a stop string is cut from the text
    text = base.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if stop.strip():
        cut = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop=[stop]))[0].outputs[0]
        assert cut.text == text[: text.index(stop)] and cut.stop_reason == stop
    # min_tokens holds back EOS; max_model_len caps generation
    long = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(long.prompt_token_ids) + len(long.outputs[0].token_ids) == 128
    with pytest.raises(RequestTooLong):
        llm.generate([{"prompt_token_ids": list(range(200))}], SamplingParams())
    with pytest.raises(ValueError):
        llm.generate([{"prompt_token_ids": [49152]}], SamplingParams())
    assert_pool_empty(llm)


def test_abort_frees_blocks(tiny_engine_model):
    llm = LLM(str(tiny_engine_model), dtype="float32", num_gpu_blocks_override=64, max_model_len=128,
              block_size=8)  # fmt: skip
    engine = llm.engine
    engine.add_request("a", {"prompt_token_ids": list(range(40))}, SamplingParams(max_tokens=50))
    engine.add_request("b", {"prompt_token_ids": list(range(50, 90))}, SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    assert engine.stats().kv_cache_usage > 0
    out = engine.abort_request("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    engine.abort_request("b")
    assert not engine.has_unfinished_requests()
    assert_pool_empty(llm)


def test_pool_smaller_than_max_model_len_is_a_config_error(tiny_engine_model):
    with pytest.raises(ConfigError, match="max-model-len"):
        LLM(str(tiny_engine_model), dtype="float32", num_gpu_blocks_override=4, max_model_len=256,
            block_size=8)  # fmt: skip


def test_prompt_logprobs_equal_transformers(tiny_engine_model):
    llm = LLM(str(tiny_engine_model), dtype="float32", num_gpu_blocks_override=64, max_model_len=128,
              block_size=8,
              max_num_batched_tokens=16)  # fmt: skip
    prompt = list(range(2000, 2030))
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    with torch.no_grad():
        ref = hf_model(str(tiny_engine_model))(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        entry = out.prompt_logprobs[i]
        assert entry[prompt[i]].logprob == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4)
        top = ref[i - 1].topk(2).indices.tolist()
        assert {t for t, lp in entry.items() if lp.rank <= 2} == set(top)


def test_chat_and_incremental_detokenization(tiny_engine_model):
    llm = LLM(str(tiny_engine_model), dtype="float32", num_gpu_blocks_override=64, max_model_len=256,
              block_size=8)  # fmt: skip
    tok = llm.get_tokenizer()
    out = llm.chat(
        [{"role": "user", "content": "héllo wörld ✓"}],
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    )[0]
    assert tok.decode(out.prompt_token_ids).startswith("<|im_start|>")
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True).rstrip(
        "\ufffd"
    )


@pytest.mark.slow
def test_smollm2_greedy_equals_transformers_with_sharing_and_preemption(smollm2_dir):
    """The real default model in fp32: 16 mixed prompts together, shared prefixes, a pool small
    enough to preempt, chunked prefill; every token equal to transformers' greedy generation."""
    prompts = mixed_prompts(16, seed=7, shared=48)
    expected = hf_greedy(smollm2_dir, prompts, 16)
    llm = LLM(
        None, num_gpu_blocks_override=40, max_model_len=320, block_size=16, max_num_batched_tokens=320,
        dtype="float32",
    )  # fmt: skip
    assert run(llm, prompts, SamplingParams(temperature=0, max_tokens=16)) == expected
    st = llm.stats()
    assert st.num_preemptions > 0 and st.prefix_cache_hits > 0
    assert_pool_empty(llm)
