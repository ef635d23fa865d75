"""LlamaForCausalLM over paged KV against transformers' own implementation (fp32, eager attention)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from pagedserve import kernels
from pagedserve.worker.kv_pool import KVPool
from pagedserve.worker.layers import RotaryEmbedding, rope_inv_freq
from pagedserve.worker.loader import load_model
from pagedserve.worker.models import UnsupportedModel, get_model_class
from pagedserve.worker.models.llama import LlamaForCausalLM, sliding_window_of
from tests.worker.paged_batch import PagedSequences, prefill_then_decode

ATOL = 1e-4
PROMPT_LENS = [7, 13, 1, 10]


def _prompts(vocab: int, lens: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def _reference(folder: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", local_files_only=True)
    return model.eval()


@torch.no_grad()
def _assert_matches_reference(reference: torch.nn.Module,
                              checks: list[tuple[list[int], torch.Tensor]]) -> None:
    for tokens, logits in checks:
        expected = reference(torch.tensor([tokens])).logits[0, -len(logits):]
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0, msg=lambda m, t=tokens: f"{t}: {m}")


@pytest.mark.parametrize("block_size", [4, 8])
def test_ragged_prefill_and_decode_match_transformers(tiny_model_dir: Path, block_size: int) -> None:
    model, config = load_model(tiny_model_dir, dtype="float32", device="cpu")
    pool = KVPool.for_model(config, num_blocks=32, block_size=block_size, dtype=torch.float32)
    prompts = _prompts(config.vocab_size, PROMPT_LENS)
    checks = prefill_then_decode(model, pool.kv_caches, prompts, block_size, num_blocks=32, decode_steps=3)
    assert len(checks) == len(prompts) + 3 * len(prompts) - 1
    _assert_matches_reference(_reference(tiny_model_dir), checks)


def test_chunked_prefill_equals_one_shot(tiny_model_dir: Path) -> None:
    """A prompt split over two forwards (the second shared with another sequence's prefill and a
    third one's decode) gives the one-shot prefill's logits."""
    model, config = load_model(tiny_model_dir, dtype="float32", device="cpu")
    prompt, other, decoding = _prompts(config.vocab_size, [13, 6, 4], seed=2)

    one_shot_pool = KVPool.for_model(config, num_blocks=8, block_size=4, dtype=torch.float32)
    seqs = PagedSequences(1, 13, 4, 8, seed=3)
    ids, positions, meta = seqs.step({0: prompt})
    one_shot = model.compute_logits(model(ids, positions, meta, one_shot_pool.kv_caches))

    pool = KVPool.for_model(config, num_blocks=16, block_size=4, dtype=torch.float32)
    seqs = PagedSequences(3, 13, 4, 16, seed=4)
    ids, positions, meta = seqs.step({0: prompt[:6], 2: decoding})
    first = model.compute_logits(model(ids, positions, meta, pool.kv_caches))[:6]
    ids, positions, meta = seqs.step({2: [5], 0: prompt[6:], 1: other})
    second = model.compute_logits(model(ids, positions, meta, pool.kv_caches))
    torch.testing.assert_close(torch.cat([first, second[1:8]]), one_shot, atol=1e-5, rtol=0)
    _assert_matches_reference(_reference(tiny_model_dir), [
        (prompt, one_shot), (decoding + [5], second[:1]), (other, second[8:]),
    ])


def test_sliding_window_per_layer() -> None:
    mistral = LlamaConfig(sliding_window=7, num_hidden_layers=2)
    assert [sliding_window_of(mistral, i) for i in range(2)] == [7, 7]
    from transformers import Qwen2Config

    qwen = Qwen2Config(use_sliding_window=True, sliding_window=7, max_window_layers=1, num_hidden_layers=2)
    assert [sliding_window_of(qwen, i) for i in range(2)] == [None, 7]
    assert sliding_window_of(Qwen2Config(num_hidden_layers=2, sliding_window=7), 1) is None


def test_llama3_rope_matches_transformers() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    config = LlamaConfig(hidden_size=512, num_attention_heads=4, rope_parameters=scaling)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    torch.testing.assert_close(rope_inv_freq(128, 500000.0, scaling), expected, atol=0, rtol=0)
    with pytest.raises(ValueError, match="not supported"):
        RotaryEmbedding(16, 8, 10000.0, {"rope_type": "yarn", "factor": 2.0})


def test_registry_names_supported_architectures() -> None:
    from pagedserve.worker.models.gemma3 import Gemma3ForCausalLM

    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert get_model_class(LlamaConfig(architectures=[arch])) is LlamaForCausalLM
    assert get_model_class(LlamaConfig(architectures=["Gemma3ForCausalLM"])) is Gemma3ForCausalLM
    supported = "supported: \\['Gemma3ForCausalLM', 'LlamaForCausalLM'"
    with pytest.raises(UnsupportedModel, match=f"GPT2LMHeadModel.*{supported}"):
        get_model_class(LlamaConfig(architectures=["GPT2LMHeadModel"]))


def test_triton_kernels_match_transformers(tiny_model_dir: Path) -> None:
    """The same model through the Triton kernels (Triton's interpreter on CPU)."""
    pytest.importorskip("triton")
    model, config = load_model(tiny_model_dir, dtype="float32", device="cpu")
    pool = KVPool.for_model(config, num_blocks=16, block_size=4, dtype=torch.float32)
    with kernels.use_backend("triton"):
        checks = prefill_then_decode(model, pool.kv_caches, _prompts(config.vocab_size, [6, 9]), 4, 16,
                                     decode_steps=2)
    _assert_matches_reference(_reference(tiny_model_dir), checks)
