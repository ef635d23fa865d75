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


def count_slides(llm: LLM) -> dict[str, int]:
    """Counts the blocks the sliding-window groups give back as requests move past their window."""
    bm = llm.engine.block_manager
    seen = {"blocks": 0}
    slide = bm._slide

    def counting(seq, position):
        before = sum(len(bm.held(t)) for t in seq.tables)
        slide(seq, position)
        seen["blocks"] += before - sum(len(bm.held(t)) for t in seq.tables)

    bm._slide = counting
    return seen


def track_blocks(llm: LLM) -> list[list[int]]:
    """After each allocation, the blocks the request holds in each KV group (null entries not counted)."""
    bm = llm.engine.block_manager
    peak: list[list[int]] = []
    allocate = bm.allocate

    def tracking(req_id, *args, **kwargs):
        out = allocate(req_id, *args, **kwargs)
        peak.append([len(bm.held(t)) for t in bm.block_tables(req_id)])
        return out

    bm.allocate = tracking
    return peak


def test_long_prompt_keeps_only_the_window_in_sliding_groups(gemma3_dir):
    """A 1,400-token prompt (almost 3 windows) in chunks of 256: greedy tokens equal transformers';
    at its last decode step each sliding-window group holds only the window's blocks (33 of 16),
    the full-attention group every block; the disabled manager keeps every layer's blocks."""
    tok = load_tokenizer(gemma3_dir)
    readme = Path(__file__).resolve().parents[2].joinpath("README.md").read_text()
    prompt = tok(readme).input_ids[:1400]
    assert len(prompt) == 1400
    model = hf_gemma3(str(gemma3_dir))
    with torch.no_grad():
        mask = torch.ones(1, len(prompt), dtype=torch.long)
        ids = model.generate(torch.tensor([prompt]), attention_mask=mask, do_sample=False, max_new_tokens=8,
                             pad_token_id=0)  # fmt: skip
    want = ids[0, len(prompt) :].tolist()
    held = []
    for disable in (False, True):
        llm = LLM(str(gemma3_dir), dtype="float32", max_model_len=2048, block_size=16,
                  max_num_batched_tokens=256, disable_hybrid_kv_cache_manager=disable)  # fmt: skip
        peak = track_blocks(llm)
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8))
        assert out[0].outputs[0].token_ids == want
        held.append(peak[-1])
        assert_pool_empty(llm)
        llm.shutdown()
    hybrid, plain = held
    blocks = -(-(1400 + 7) // 16)
    assert hybrid[0] == blocks and all(n <= 512 // 16 + 1 for n in hybrid[1:]), hybrid
    assert plain == [blocks]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_batch_16_equals_transformers_with_caching_chunking_and_preemption(
    gemma3_dir, prompts, expected, mode
):
    """16 long prompts at once in chunks of 256 tokens; a pool of 480 blocks of 16 tokens of one KV
    group (hybrid KV: 3 layers a block; two prompts' worth over the 6 groups) so that decoding
    preempts; half the prompts share 256 tokens (prefix cache hits); the sliding-window groups
    give back the blocks that leave their window as the requests decode past 512 tokens."""
    llm = LLM(str(gemma3_dir), dtype="float32", max_model_len=700, block_size=16, num_gpu_blocks_override=480,
              max_num_batched_tokens=256, preemption_mode=mode)  # fmt: skip
    assert [g.window for g in llm.engine.kv_groups] == [None] + [512] * 5
    counts = count_plans(llm)
    slid = count_slides(llm)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    st = llm.stats()
    assert st.num_preemptions > 0 and st.prefix_cache_hits > 0
    assert slid["blocks"] > 0
    if mode == "swap":
        assert counts["swap_out"] > 0
    assert_pool_empty(llm)
