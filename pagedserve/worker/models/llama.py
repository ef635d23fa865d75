"""The Llama family over paged attention: Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2.

One tensor-parallel rank of the decoder; the variants differ only in config fields:
QKV bias (Qwen2, or `attention_bias`), query/key RMSNorm per head (Qwen3), sliding window
(Mistral's `sliding_window`, Qwen2's and Qwen3's per-layer `layer_types`), RoPE scaling
(`rope_parameters`), tied embeddings, `head_dim`.
Tokens of all sequences in a step are one flat batch [T]; the attention metadata says which
rows belong to which sequence and where their KV lives.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from pagedserve.worker.layers import (
    GEMM_MAX_ROWS,
    Attention,
    AttentionMetadata,
    Bf16Blocks,
    MergedColumnParallelLinear,
    OnednnParts,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
    default_weight_loader,
)

# Hugging Face parameter name piece -> (our merged parameter piece, shard id)
_STACKED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)


def rope_parameters(config: PretrainedConfig) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from a transformers 5 `rope_parameters` dict or the
    older `rope_theta` + `rope_scaling` fields."""
    params = getattr(config, "rope_parameters", None)
    if params and "rope_theta" in params:
        return float(params["rope_theta"]), dict(params)
    return float(getattr(config, "rope_theta", 10000.0)), getattr(config, "rope_scaling", None)


def sliding_window_of(config: PretrainedConfig, layer_idx: int) -> int | None:
    """The attention window of one layer: per `layer_types` when the config lists them (Qwen2),
    else the config's `sliding_window` for every layer (Mistral), else none."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window


def head_dim_of(config: PretrainedConfig) -> int:
    """Per-head size: the config's `head_dim` when set, else hidden_size / num_attention_heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int, rotary_emb: RotaryEmbedding,
                 tp_rank: int, tp_size: int) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
        attention_bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, config.num_attention_heads, config.num_key_value_heads,
            bias=attention_bias or config.model_type == "qwen2", tp_rank=tp_rank, tp_size=tp_size,
        )
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size,
                                        bias=attention_bias, tp_rank=tp_rank, tp_size=tp_size)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim,
                              scale=head_dim**-0.5, sliding_window=sliding_window_of(config, layer_idx))
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.head_dim = head_dim
        # Qwen3: each head's query and key are RMS-normalized (weights over head_dim) before RoPE
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)

    def forward(self, positions: Tensor, hidden: Tensor, kv_cache: tuple[Tensor, Tensor],
                meta: AttentionMetadata) -> Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        bias = bool(getattr(config, "mlp_bias", False))
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], bias=bias,
                                                       tp_rank=tp_rank, tp_size=tp_size)
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=bias,
                                           tp_rank=tp_rank, tp_size=tp_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int, rotary_emb: RotaryEmbedding,
                 tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, rotary_emb, tp_rank, tp_size)
        self.mlp = LlamaMLP(config, tp_rank, tp_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: Tensor, hidden: Tensor, residual: Tensor | None,
                kv_cache: tuple[Tensor, Tensor], meta: AttentionMetadata) -> tuple[Tensor, Tensor]:
        # the residual add is fused into the next norm: (hidden, residual) flow between layers
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   tp_rank=tp_rank, tp_size=tp_size)
        theta, scaling = rope_parameters(config)
        # one cos/sin cache for all layers (a 128k-position cache is 64 MB)
        rotary_emb = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings, theta, scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, rotary_emb, tp_rank, tp_size)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[Tensor, Tensor]]) -> Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        in_cpp = _cpu_layers(self, hidden, positions, meta, kv_caches)
        if in_cpp is not None:
            hidden, residual = in_cpp
        else:
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


def _cpu_layers(model: LlamaModel, hidden: Tensor, positions: Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor] | None:  # fmt: skip
    """A step's decoder layers in one C++ call (kernels/cpu_layers.cpp: the same kernels in the
    same order as the modules, results equal bit for bit) where every piece of them has one: bf16
    on the CPU backend with the fused ops, one KV group of bf16 pools, every linear layer without
    bias and in bf16 GGUF block records or cpu_gemm.cpp's dense bf16 panels (AVX512-BF16 without
    AMX) for this many rows, or prepacked for oneDNN (past the panels' rows layers.linear runs
    oneDNN too), no per-head norms, one tensor-parallel rank;
    a step with prefill chunks also needs cpu_prefill.cpp's kernel for them (cpu.prefill_enabled).
    Returns the final norm's (hidden, residual), or None where the modules' loop runs
    (``PAGEDSERVE_CPU_DECODE_LAYERS=0``: decode steps, ``PAGEDSERVE_CPU_PREFILL_LAYERS=0``: steps
    with prefill chunks)."""
    from pagedserve import kernels

    ops = kernels.fused_ops(hidden)
    rows = hidden.shape[0]
    if (ops is None or hidden.dtype != torch.bfloat16 or hidden.dim() != 2 or meta.groups
            or positions.dtype != torch.int64 or meta.slot_mapping.dtype != torch.int64):
        return None  # fmt: skip
    from pagedserve.kernels import cpu, reference

    if not hasattr(ops, "llama_layers"):
        return None
    decode = meta.max_query_len == 1 and meta.block_tables.shape[0] == rows
    if not (cpu.DECODE_LAYERS if decode else cpu.PREFILL_LAYERS):
        return None
    first = model.layers[0].self_attn
    k0 = kv_caches[0][0]
    if not decode and not (first.head_dim % 16 == 0 and first.head_dim <= 256 and cpu.prefill_enabled()):
        return None
    norms, records, packed, parts, starts_of, features, q8, amx, max_rows, windows = ([] for _ in range(10))
    eps = model.layers[0].input_layernorm.eps
    none = hidden.new_empty(0)
    for layer, (k_cache, v_cache) in zip(model.layers, kv_caches, strict=True):
        attn = layer.self_attn
        if (attn.qk_norm or attn.o_proj.tp_size != 1 or k_cache.dtype != torch.bfloat16
                or v_cache.dtype != torch.bfloat16 or layer.input_layernorm.eps != eps
                or layer.post_attention_layernorm.eps != eps
                or not (decode or (k_cache.is_contiguous() and v_cache.is_contiguous()))):
            return None  # fmt: skip
        for linear in (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            blocks, dense = linear.gemm_weight, linear.packed_weight
            panels = isinstance(blocks, Tensor) and blocks.dtype == torch.bfloat16  # cpu_gemm.cpp's
            if panels and rows > GEMM_MAX_ROWS[blocks.dtype]:
                blocks, panels = None, False  # past the panels' rows layers.linear takes oneDNN too
            known = blocks is None or panels or isinstance(blocks, Bf16Blocks)
            if linear.bias is not None or not known:
                return None
            limit = GEMM_MAX_ROWS[torch.bfloat16] if panels else blocks.max_rows if blocks is not None else 0
            if not (blocks is not None and rows <= limit) and dense is None:
                return None
            if isinstance(dense, OnednnParts):  # layers.linear's split over the decode pool
                parts.append(dense.parts)
                starts_of.append(dense.starts)
                dense = dense.whole
            else:
                parts.append([])
                starts_of.append([])
            records.append(blocks if panels else blocks.records if blocks is not None else none)
            q8.append(not panels and blocks is not None and blocks.q8)
            amx.append(not panels and blocks is not None and blocks.amx)
            max_rows.append(limit)
            packed.append(dense if dense is not None else none)
            features.append(linear.weight.shape[0])
        norms += (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        windows.append(attn.attn.sliding_window or 0)
    starts, lens, seq_lens, tables = [], [], [], []
    if decode:
        decode_rows = positions.new_empty(0)
        decode_tables, decode_lens = (t if t.dtype == torch.int32 else t.int() for t in (meta.block_tables,
                                                                                         meta.seq_lens))
        decode_tables, decode_lens = decode_tables.contiguous(), decode_lens.contiguous()
    else:  # kernels/cpu.py's paged_attention over the same layout
        layout = reference._layout(meta.block_tables, meta.seq_lens, meta.query_start_loc, k0)
        if not layout.extends:
            return None
        if layout.decode:
            decode_rows = layout.decode_rows
            decode_tables, decode_lens = layout.decode_tables
        else:
            decode_rows = positions.new_empty(0)
            decode_tables = decode_lens = torch.empty(0, dtype=torch.int32)
        for b in layout.extends:
            starts.append(layout.starts[b])
            lens.append(layout.q_lens[b])
            seq_lens.append(layout.lens[b])
            table = meta.block_tables[b]
            tables.append(table if table.dtype == torch.int32 else table.int())
    heads = first.attn
    hidden, residual = ops.llama_layers(
        hidden, positions.contiguous(), meta.slot_mapping, decode_rows, decode_tables, decode_lens, starts,
        lens, seq_lens, tables, first.rotary_emb.cos_sin_cache, norms, records, packed, parts, starts_of,
        features, q8, amx, max_rows,
        [k for k, _ in kv_caches], [v for _, v in kv_caches], windows, heads.num_heads, heads.num_kv_heads,
        first.head_dim, eps, heads.scale, cpu.SHARE_BLOCKS, cpu.decode_threads(), cpu.prefill_amx_enabled(),
    )  # fmt: skip
    return hidden, residual


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class LlamaForCausalLM(nn.Module):
    """One tensor-parallel rank of a Llama-family causal LM over paged KV.

    Parameters are created uninitialized in `dtype` on the current default device (build it under
    `with torch.device(...)`); load_weights fills them. The RoPE cos/sin cache stays fp32.
    Other families with Llama's checkpoint names (Gemma 3) only swap `model_class`.
    """

    model_class: type[nn.Module] = LlamaModel

    def __init__(self, config: PretrainedConfig, *, dtype: torch.dtype = torch.float32,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.config, self.dtype = config, dtype
        self.tp_rank, self.tp_size = tp_rank, tp_size
        with _default_dtype(dtype):
            self.model = self.model_class(config, tp_rank, tp_size)
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size,
                                          tp_rank=tp_rank, tp_size=tp_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[Tensor, Tensor]]) -> Tensor:
        """Run one step's tokens (int64 [T], at int64 positions [T]) through the decoder.

        Writes their K/V into kv_caches (one (K, V) pool pair per layer) at meta.slot_mapping and
        returns the final-norm hidden states [T, hidden_size] in the model dtype.
        """
        return self.model(input_ids, positions, meta, kv_caches)

    @torch.inference_mode()
    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Logits fp32 [N, vocab_size] of hidden states [N, hidden_size] (full vocab on every rank)."""
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Load Hugging Face-named checkpoint tensors (Tensors or lazy safetensors slices).

        q/k/v_proj merge into qkv_proj and gate/up_proj into gate_up_proj; each rank copies only
        its shard. RoPE buffers and, with tied embeddings, lm_head.weight are skipped. Returns the
        names of our parameters that received all their data (a merged one: every shard); raises
        KeyError on an unknown tensor name.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        # a merged parameter counts as loaded once all its shards are: {name: shard ids still due}
        pending: dict[str, set[Any]] = {}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight"):
                continue
            for hf_piece, our_piece, shard_id in _STACKED:
                if hf_piece in name:
                    target = name.replace(hf_piece, our_piece)
                    param = self._param(params, target, name)
                    param.weight_loader(param, tensor, shard_id)
                    due = pending.setdefault(target, {s for _, t, s in _STACKED if t == our_piece})
                    due.discard(shard_id)
                    if not due:
                        loaded.add(target)
                    break
            else:
                target = name
                param = self._param(params, target, name)
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                loaded.add(target)
        return loaded

    @staticmethod
    def _param(params: dict[str, nn.Parameter], target: str, source: str) -> nn.Parameter:
        if target not in params:
            raise KeyError(f"checkpoint tensor {source!r} matches no parameter of this model")
        return params[target]
