"""Engine-level fixtures: a tiny random Llama with the real SmolLM2 tokenizer, and the real model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from pagedserve.worker.loader import load_tokenizer


@pytest.fixture(scope="session")
def tiny_engine_model(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A 2-layer GQA Llama with SmolLM2's vocabulary and tokenizer, weights random but spread out
    enough that greedy choices are not near-ties (so fp32 reduction order cannot flip them)."""
    folder = tmp_path_factory.mktemp("tiny_engine")
    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(
                1 + 0.2 * torch.randn_like(param) if "norm" in name else 0.15 * torch.randn_like(param)
            )
    model.save_pretrained(folder)
    load_tokenizer(smollm2_dir).save_pretrained(folder)
    return folder
