"""Gemma 3 text models (``Gemma3ForCausalLM``, the text part of ``gemma3``) over paged attention.

Gemma 3 against Llama: embeddings scaled by sqrt(hidden_size); RMSNorm scaling by (1 + weight);
norms before and after both attention and MLP (no fused residual); query/key RMSNorm per head;
GeGLU (tanh-approximated GELU); attention scaled by ``query_pre_attn_scalar ** -0.5``; layers
of sliding-window attention (``sliding_window`` tokens, RoPE base ``rope_local_base_freq`` /
``rope_parameters["sliding_attention"]``) and of full attention (the global RoPE base, with its
scaling), per ``layer_types``; tied embeddings; final logit soft-capping when the config sets it.
The checkpoint's tensor names are Llama's plus the extra norms, so loading is Llama's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from pagedserve.worker.layers import (
    Attention,
    AttentionMetadata,
    GeluTanhAndMul,
    GemmaRMSNorm,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagedserve.worker.models.llama import LlamaForCausalLM, head_dim_of


def layer_types_of(config: PretrainedConfig) -> list[str]:
    """Each layer's attention: ``layer_types`` when the config lists them, else transformers'
    older ``sliding_window_pattern`` (every pattern-th layer global, the others sliding)."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    pattern = getattr(config, "sliding_window_pattern", 6)
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(config.num_hidden_layers)]  # fmt: skip


def rope_of(config: PretrainedConfig, layer_type: str) -> tuple[float, dict[str, Any] | None]:
    """(base, scaling) of one layer type: transformers 5's ``rope_parameters[layer_type]``, else
    the older ``rope_local_base_freq`` (sliding) and ``rope_theta`` + ``rope_scaling`` (full)."""
    params = getattr(config, "rope_parameters", None)
    if params and layer_type in params and params[layer_type]:
        return float(params[layer_type]["rope_theta"]), dict(params[layer_type])
    if layer_type == "sliding_attention":
        return float(getattr(config, "rope_local_base_freq", 10000.0)), None
    return float(getattr(config, "rope_theta", 1000000.0)), getattr(config, "rope_scaling", None)


class Gemma3Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_type: str, rotary_emb: RotaryEmbedding,
                 tp_rank: int, tp_size: int) -> None:  # fmt: skip
        super().__init__()
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise ValueError("attention logit soft-capping (Gemma 2) is not supported")
        head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=bias, tp_rank=tp_rank,
                                          tp_size=tp_size)  # fmt: skip
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias=bias,
                                        tp_rank=tp_rank, tp_size=tp_size)  # fmt: skip
        self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        self.rotary_emb = rotary_emb
        window = config.sliding_window if layer_type == "sliding_attention" else None
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim,
                              scale=config.query_pre_attn_scalar**-0.5, sliding_window=window)  # fmt: skip
        self.q_size, self.kv_size, self.head_dim = self.qkv_proj.q_size, self.qkv_proj.kv_size, head_dim

    def forward(self, positions: Tensor, hidden: Tensor, kv_cache: tuple[Tensor, Tensor],
                meta: AttentionMetadata) -> Tensor:  # fmt: skip
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class Gemma3MLP(nn.Module):
    def __init__(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)")
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], tp_rank=tp_rank,
                                                       tp_size=tp_size)  # fmt: skip
        self.act_fn = GeluTanhAndMul()
        self.down_proj = RowParallelLinear(size, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_type: str, rotary_emb: RotaryEmbedding,
                 tp_rank: int, tp_size: int) -> None:  # fmt: skip
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, layer_type, rotary_emb, tp_rank, tp_size)
        self.mlp = Gemma3MLP(config, tp_rank, tp_size)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, positions: Tensor, hidden: Tensor, kv_cache: tuple[Tensor, Tensor],
                meta: AttentionMetadata) -> Tensor:  # fmt: skip
        attn = self.self_attn(positions, self.input_layernorm(hidden), kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma3Model(nn.Module):
    def __init__(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   tp_rank=tp_rank, tp_size=tp_size)  # fmt: skip
        # transformers keeps sqrt(hidden_size) as an fp32 tensor and casts it to the weights' dtype
        self.embed_scale = float(torch.tensor(config.hidden_size**0.5, dtype=torch.float32))
        head_dim, max_pos = head_dim_of(config), config.max_position_embeddings
        types = layer_types_of(config)
        # one cos/sin cache per layer type, shared by its layers
        rotary = {t: RotaryEmbedding(head_dim, max_pos, *rope_of(config, t)) for t in sorted(set(types))}
        self.rotary = nn.ModuleDict(rotary)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, t, rotary[t], tp_rank, tp_size) for t in types)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[Tensor, Tensor]]) -> Tensor:  # fmt: skip
        embeds = self.embed_tokens(input_ids)
        hidden = embeds * torch.tensor(self.embed_scale, dtype=embeds.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(positions, hidden, kv_cache, meta)
        return self.norm(hidden)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """One tensor-parallel rank of a Gemma 3 text model (Llama's loading; its own decoder)."""

    model_class = Gemma3Model

    def __init__(self, config: PretrainedConfig, *, dtype: torch.dtype = torch.float32,
                 tp_rank: int = 0, tp_size: int = 1) -> None:  # fmt: skip
        super().__init__(config, dtype=dtype, tp_rank=tp_rank, tp_size=tp_size)
        self.softcap = getattr(config, "final_logit_softcapping", None)

    @torch.inference_mode()
    def compute_logits(self, hidden: Tensor) -> Tensor:
        logits = self.lm_head(hidden).float()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
