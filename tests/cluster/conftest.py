"""Engine-level fixtures: tiny random Llama and Qwen2 with the real SmolLM2 tokenizer, and the real model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from pagedserve.worker.loader import load_tokenizer

_TINY = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def save_tiny_engine_model(folder: Path, tokenizer_dir: Path, kind: str = "llama") -> Path:
    """A 2-layer model with SmolLM2's vocabulary and tokenizer, weights random but spread out enough
    that greedy choices are not near-ties (so fp32 reduction order cannot flip them).

    kind "llama": GQA, 2 KV heads. kind "qwen2": one KV head (replicated under tensor parallelism)
    and QKV biases.
    """
    if kind == "llama":
        config = LlamaConfig(**_TINY, num_key_value_heads=2, architectures=["LlamaForCausalLM"])
    else:
        config = Qwen2Config(**_TINY, num_key_value_heads=1, architectures=["Qwen2ForCausalLM"],
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(
                1 + 0.2 * torch.randn_like(param) if "norm" in name else 0.15 * torch.randn_like(param)
            )
    model.save_pretrained(folder)
    load_tokenizer(tokenizer_dir).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_engine_model(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """The tiny GQA Llama (4 heads, 2 KV heads) with SmolLM2's tokenizer."""
    return save_tiny_engine_model(tmp_path_factory.mktemp("tiny_engine"), smollm2_dir)


@pytest.fixture(scope="session")
def tiny_engine_qwen2(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """The tiny Qwen2 (4 heads, 1 KV head, QKV bias) with SmolLM2's tokenizer."""
    return save_tiny_engine_model(tmp_path_factory.mktemp("tiny_qwen2"), smollm2_dir, "qwen2")
