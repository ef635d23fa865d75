"""Gemma 3 270M (fp32) against transformers: logits over paged KV, and greedy generation through the
engine with prompts longer than its 512-token sliding window, at batch sizes 1 and 16, with
prefix caching, chunked prefill and preemption."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve import LLM, SamplingParams
from pagedserve.worker.kv_pool import KVPool
from pagedserve.worker.loader import load_model, load_tokenizer
from tests.cluster.test_beam_search import count_plans
from tests.cluster.test_engine import assert_pool_empty
from tests.worker.paged_batch import prefill_then_decode

pytestmark = pytest.mark.slow

MAX_NEW = 12
LOGITS_ATOL = 2e-3  # fp32; the logits themselves reach ~30 in magnitude


@functools.lru_cache(maxsize=1)
def hf_gemma3(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


def long_prompts(path: Path, n: int) -> list[list[int]]:
    """n prompts of 530-620 tokens (past the 512-token window) of English text; even ones share
    their first 256 tokens, so the prefix cache has something to find."""
    tok = load_tokenizer(path)
    ids = tok(Path(__file__).resolve().parents[2].joinpath("README.md").read_text()).input_ids
    prompts = []
    for i in range(n):
        length = 530 + (i * 37) % 90
        start = 0 if i % 2 == 0 else 300 + 41 * i
        prompts.append(ids[start : start + length])
    return prompts


@pytest.fixture(scope="module")
def prompts(gemma3_dir: Path) -> list[list[int]]:
    return long_prompts(gemma3_dir, 16)


@pytest.fixture(scope="module")
def expected(gemma3_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens, one prompt at a time."""
    model = hf_gemma3(str(gemma3_dir))
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0)  # fmt: skip
            out.append(ids[0, len(p) :].tolist())
    return out


def test_logits_close_to_transformers_past_the_window(gemma3_dir, prompts):
    """Paged prefill of two long prompts at once, then three decode steps: every logit row within
    LOGITS_ATOL of transformers' (eager attention, fp32)."""
    model, config = load_model(gemma3_dir, dtype="float32", device="cpu")
    assert config.sliding_window == 512 and max(len(p) for p in prompts[:2]) > 512
    pool = KVPool.for_model(config, num_blocks=100, block_size=16, dtype=torch.float32)
    checks = prefill_then_decode(model, pool.kv_caches, prompts[:2], 16, num_blocks=100, decode_steps=3)
    reference = hf_gemma3(str(gemma3_dir))
    with torch.no_grad():
        for tokens, logits in checks:
            want = reference(torch.tensor([tokens])).logits[0, -len(logits) :]
            torch.testing.assert_close(logits, want, atol=LOGITS_ATOL, rtol=0)


def test_greedy_batch_1_equals_transformers(gemma3_dir, prompts, expected):
    llm = LLM(str(gemma3_dir), dtype="float32", max_model_len=1024, kv_cache_memory=256 << 20)
    out = llm.generate([{"prompt_token_ids": prompts[1]}], SamplingParams(temperature=0, max_tokens=MAX_NEW))
    assert out[0].outputs[0].token_ids == expected[1]
    assert_pool_empty(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_batch_16_equals_transformers_with_caching_chunking_and_preemption(
    gemma3_dir, prompts, expected, mode
):
    """16 long prompts at once in chunks of 256 tokens; a pool of 76 blocks of 16 (two prompts' worth)
    so that decoding preempts; half the prompts share 256 tokens (prefix cache hits)."""
    llm = LLM(str(gemma3_dir), dtype="float32", max_model_len=1024, block_size=16, num_gpu_blocks_override=76,
              max_num_batched_tokens=256, preemption_mode=mode)  # fmt: skip
    counts = count_plans(llm)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    st = llm.stats()
    assert st.num_preemptions > 0 and st.prefix_cache_hits > 0
    if mode == "swap":
        assert counts["swap_out"] > 0
    assert_pool_empty(llm)
