"""Shared model fixtures: tiny random Hugging Face checkpoints and the converted default model.

tiny_model_dir is parametrized over TINY_CONFIGS (GQA Llama with tied embeddings, Qwen2 with QKV
bias and one replicated KV head, Mistral with a sliding window and an explicit head_dim, Llama 3
RoPE scaling). Each is built by transformers with a fixed seed, every parameter (biases and norm
weights included) randomized so that none is a trivial 0 or 1, and saved as safetensors.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

_COMMON = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5)

TINY_CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": lambda: LlamaConfig(**_COMMON, num_key_value_heads=2, tie_word_embeddings=True,
                                 architectures=["LlamaForCausalLM"]),
    "qwen2": lambda: Qwen2Config(**_COMMON, num_key_value_heads=1, rope_parameters={
        "rope_type": "default", "rope_theta": 1000.0}, architectures=["Qwen2ForCausalLM"]),
    "mistral": lambda: MistralConfig(**_COMMON, num_key_value_heads=2, head_dim=32, sliding_window=5,
                                     architectures=["MistralForCausalLM"]),
    # Qwen3: no QKV bias, query/key RMSNorm per head, head_dim apart from hidden_size / heads, and
    # sliding-window layers after the first (layer_types)
    "qwen3": lambda: Qwen3Config(**_COMMON, num_key_value_heads=2, head_dim=32, use_sliding_window=True,
                                 sliding_window=5, max_window_layers=1, architectures=["Qwen3ForCausalLM"]),
    # Gemma 3: one KV head, (1 + w) norms around attention and MLP, query/key norms, GeGLU, a
    # sliding layer (window 5, local RoPE base) then a global one, soft-capped logits
    "gemma3": lambda: Gemma3TextConfig(**_COMMON, num_key_value_heads=1, head_dim=32, sliding_window=5,
                                       layer_types=["sliding_attention", "full_attention"],
                                       query_pre_attn_scalar=24, final_logit_softcapping=30.0,
                                       architectures=["Gemma3ForCausalLM"]),
    "llama3": lambda: LlamaConfig(**_COMMON, num_key_value_heads=2, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}, architectures=["LlamaForCausalLM"]),
}


def build_tiny_model(kind: str, seed: int = 0) -> torch.nn.Module:
    """The transformers fp32 model of TINY_CONFIGS[kind] (eager attention), randomized reproducibly."""
    torch.manual_seed(seed)
    config = TINY_CONFIGS[kind]()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.5 * torch.randn_like(param))
            else:
                param.copy_(0.1 * torch.randn_like(param))
    return model.eval()


def save_tiny_model(kind: str, folder: Path) -> Path:
    build_tiny_model(kind).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session", params=sorted(TINY_CONFIGS))
def tiny_model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny checkpoint per TINY_CONFIGS kind; the folder name is the kind."""
    return save_tiny_model(request.param, tmp_path_factory.mktemp("tiny") / request.param)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny GQA Llama (4 heads, 2 KV heads, tied embeddings, vocab 101) as a Hugging Face folder."""
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")


def _llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # llama.cpp's convert_hf_to_gguf interleaves each q/k head's two RoPE halves; the loader undoes it
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama_cpp_unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, seed: int = 0) -> torch.nn.Module:
    """Write a 2-layer Llama GGUF as llama.cpp would (permuted q/k, Q8_0 matrices, F32 norms) with
    the default model's tokenizer and chat template; return the transformers model holding exactly
    the dequantized weights, the oracle for the conversion."""
    import gguf

    from pagedserve.worker.loader import default_gguf_path

    source = gguf.GGUFReader(default_gguf_path())
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, rope_parameters={
                             "rope_type": "default", "rope_theta": 100000.0})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    writer = gguf.GGUFWriter(path, arch="llama")
    for name, field in source.fields.items():
        if name.startswith(("tokenizer.", "general.")) and name != "general.architecture":
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub_type)
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(96)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(16)
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}
    hf_to_gguf = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                  "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                  "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                  "post_attention_layernorm": "ffn_norm"}
    with torch.no_grad():
        for name, param in model.named_parameters():
            module = name.removesuffix(".weight")
            if module.startswith("model.layers."):
                _, _, layer, rest = module.split(".", 3)
                gguf_name = f"blk.{layer}.{hf_to_gguf[rest]}.weight"
            elif module in names:
                gguf_name = f"{names[module]}.weight"
            else:
                continue  # lm_head: tied to the embeddings, absent from the file as in llama.cpp
            if param.dim() == 1:
                param.copy_(1 + 0.2 * torch.randn_like(param))
                writer.add_tensor(gguf_name, param.numpy().copy())
                continue
            value = 0.1 * torch.randn_like(param)
            heads = {"attn_q": 4, "attn_k": 2}.get(gguf_name.split(".")[-2])
            stored = _llama_cpp_permute(value, heads) if heads else value
            quantized = gguf.quants.quantize(stored.numpy(), gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name, quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            # the oracle holds the file's Q8_0-rounded values; Q8_0 blocks lie within a row, so
            # rounding commutes with the row permutation
            rounded = gguf.quants.dequantize(quantized, gguf.GGMLQuantizationType.Q8_0)
            param.copy_(torch.from_numpy(rounded.reshape(stored.shape)))
            if heads:
                param.copy_(_llama_cpp_unpermute(param.clone(), heads))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """(path of a tiny Llama GGUF written like llama.cpp, the transformers model it encodes)."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf"
    return path, write_tiny_gguf(path)
