"""Tensor-parallel building blocks of a decoder over paged attention.

Every layer is written for rank `tp_rank` of `tp_size` (Megatron-style): column-parallel layers
split their output features, row-parallel layers split their input features and all-reduce the
partial sums, the vocabulary is split into contiguous ranges. With tp_size 1 no collective runs.
Collectives use torch.distributed's default process group, which the worker sets up.

Each parameter carries a `weight_loader(param, loaded[, shard_id])` that copies this rank's shard
of a full checkpoint tensor into it. `loaded` is a torch Tensor or a lazy safetensors slice (which
reads only the indexed rows/columns), so a rank never materializes the whole tensor it shards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from pagedserve import kernels


def loaded_shape(loaded: Any) -> tuple[int, ...]:
    """Shape of a checkpoint tensor, whether a Tensor or a lazy safetensors slice."""
    return tuple(loaded.shape) if isinstance(loaded, Tensor) else tuple(loaded.get_shape())


def narrow_loaded(loaded: Any, dim: int, start: int, size: int) -> Tensor:
    """Rows/columns start:start+size along `dim` of a checkpoint tensor, reading only those."""
    if isinstance(loaded, Tensor):
        return loaded.narrow(dim, start, size)
    index = [slice(None)] * len(loaded_shape(loaded))
    index[dim] = slice(start, start + size)
    return loaded[tuple(index)]


def full_loaded(loaded: Any) -> Tensor:
    """The whole checkpoint tensor as a Tensor."""
    return loaded if isinstance(loaded, Tensor) else loaded[:]


def default_weight_loader(param: Tensor, loaded: Any) -> None:
    """Copy an unsharded checkpoint tensor into `param` (shapes must match)."""
    if loaded_shape(loaded) != tuple(param.shape):
        raise ValueError(f"checkpoint shape {loaded_shape(loaded)} != parameter shape {tuple(param.shape)}")
    param.copy_(full_loaded(loaded))


def _parameter(*shape: int, loader: Any = default_weight_loader) -> nn.Parameter:
    # empty: every value is overwritten by load_weights, and fresh memory is slow to fill
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = loader
    return param


def _all_reduce(x: Tensor, tp_size: int) -> Tensor:
    if tp_size > 1:
        dist.all_reduce(x)
    return x


def _all_gather_last(x: Tensor, tp_size: int) -> Tensor:
    if tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


# Rows up to which a linear layer runs the kernels of cpu_gemm.cpp rather than oneDNN, by dtype.
# fp32 (AVX2, no AVX-512): all. SmolLM2's 30 layers and LM head against oneDNN on prepacked weights
# (2 vCPUs of a Zen 3 EPYC, 2026-12-03): one thread 0.83x the time at 1 row, 0.59x at 4, 0.70x at
# 16 (61 against 87 ms), 0.81x at 64; two threads (prefill) 0.68x at 16, 0.92-0.94x at 128-1024
# rows. (On a Zen 5 core with oneDNN capped at AVX2 an earlier build lost from 8 rows on; there
# fp32 runs oneDNN's AVX-512 kernels, not these.)
# bf16 (AVX512-BF16, no AMX): against oneDNN's AVX512-BF16 kernels on prepacked weights, one Zen 5
# core: 0.66-0.72x the time at 1-12 rows (39 against 26 GB/s of weights at 1 row), 0.85-0.93x at
# 16-32, 0.99x at 64.
GEMM_MAX_ROWS = {torch.float32: math.inf, torch.bfloat16: 32}


# bf16 on CPUs with AMX: rows up to which a linear layer whose weights are exact GGUF block values
# runs cpu_blocks_bf16.cpp's kernel over those blocks rather than oneDNN over the dense bf16 weights.
# SmolLM2's 30 layers and LM head, 2-vCPU Xeon with AMX, two threads (2026-12-05): 1 row 7.5 ms
# against oneDNN's 13.0, 2 rows 8.6 / 13.1, 4 rows 11.3 / 12.8, 8 rows 19.4 / 12.7 (the kernel's
# work grows with rows, oneDNN's time hardly does).
BF16_BLOCKS_MAX_ROWS = 4

# The same through AMX tiles (cpu.blocks_amx_enabled): one tile product a block for 16 rows, so the
# work hardly grows with the rows. SmolLM2's 30 layers and LM head, same VM in a slow phase
# (2026-12-06 night), against oneDNN on the dense bf16 weights: one thread 11.6 / 33.5 ms at 1 row,
# 16.1 / 34.8 at 16, 30.2 / 38.7 at 32, 42.9 / 41.7 at 48, 55.6 / 47.6 at 64 (passes of 16 rows,
# each expanding the blocks again); as served, one torch thread and the decode pool's helper for
# the blocks: 9.1 / 36.2 at 1, 13.8 / 37.6 at 16, 30.1 / 44.9 at 48, 39.9 / 52.4 at 64.
BF16_BLOCKS_AMX_MAX_ROWS = 64


@dataclass(frozen=True)
class Bf16Blocks:
    """A weight kept as cpu_blocks_bf16.cpp's records of its GGUF blocks (cpu.gguf_blocks_bf16),
    run on AMX tiles (`amx`) or by the AVX512-BF16 loop."""

    records: Tensor
    q8: bool
    amx: bool = False

    @property
    def max_rows(self) -> int:
        """Rows up to which a step takes the blocks rather than oneDNN's dense bf16 weights."""
        return BF16_BLOCKS_AMX_MAX_ROWS if self.amx else BF16_BLOCKS_MAX_ROWS


@dataclass(frozen=True)
class OnednnParts:
    """A weight prepacked for oneDNN whole and in parts of consecutive output features,
    [starts[i], starts[i + 1]), for the decode pool's threads (cpu_onednn_split.cpp; see
    split_onednn_weights)."""

    parts: list[Tensor]
    starts: list[int]
    whole: Tensor


# a linear layer's weight for cpu_gemm.cpp (dense panels; GGUF blocks: q, scales, is_q8) or
# cpu_blocks_bf16.cpp, see prepack_linear_weights
GemmWeight = Tensor | tuple[Tensor, Tensor, bool] | Bf16Blocks | None


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, packed: Tensor | OnednnParts | None = None,
           gemm: GemmWeight = None) -> Tensor:  # fmt: skip
    """x W^T + b: through cpu_gemm.cpp's packed weight (`gemm`: dense panels for up to
    GEMM_MAX_ROWS rows, or GGUF blocks for any row count), or cpu_blocks_bf16.cpp's GGUF blocks for
    up to `gemm.max_rows` rows (AMX tiles: BF16_BLOCKS_AMX_MAX_ROWS, else BF16_BLOCKS_MAX_ROWS),
    else the weight prepacked for oneDNN (`packed`: whole, or in parts over the decode pool's
    threads) when there is one (CPU), else torch's linear."""
    if isinstance(gemm, Bf16Blocks):
        if x.numel() <= gemm.max_rows * x.shape[-1]:
            from pagedserve.kernels import cpu

            n = weight.shape[0]
            return cpu.extension().linear_blocks_bf16(x, gemm.records, bias, n, gemm.q8, gemm.amx)
    elif isinstance(gemm, tuple):
        from pagedserve.kernels import cpu

        return cpu.extension().linear_blocks(x, gemm[0], gemm[1], bias, weight.shape[0], gemm[2])
    elif gemm is not None and x.numel() <= GEMM_MAX_ROWS[gemm.dtype] * x.shape[-1]:
        from pagedserve.kernels import cpu

        return cpu.extension().linear_packed(x, gemm, bias, weight.shape[0])
    if isinstance(packed, OnednnParts):
        if torch.get_num_threads() == 1:
            from pagedserve.kernels import cpu

            return cpu.extension().linear_onednn_split(x, packed.parts, packed.starts, bias)
        packed = packed.whole
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def prepack_linear_weights(model: nn.Module, onednn_always: bool = False, gguf_blocks: bool | None = None,
                           exact: nn.Module | None = None) -> int:  # fmt: skip
    """Reorder every linear layer's weight once into oneDNN's blocked layout (CPU only), and where
    cpu.gemm_enabled says also into the panels of cpu_gemm.cpp's kernels (fp32 on CPUs without
    AVX-512, for steps of any size; bf16 on CPUs with AVX512-BF16 but no AMX, for steps of few rows).

    torch's plain CPU linear repacks the weight on every call; at decode batch sizes that doubles
    the memory traffic of what is a weight-streaming workload. Measured on 2 cores for SmolLM2's
    30 layers (cold weights): bf16 13.3 -> 6.1 ms at batch 1 and 18.1 -> 10.9 ms at batch 16; fp32
    23.5 -> 8.4 and 45.2 -> 13.7 ms, with fp32 results equal to the plain path's to ~1e-6 (what
    vLLM's CPU backend and inductor's freezing do). The kernels of cpu_gemm.cpp beat oneDNN where
    they run (GEMM_MAX_ROWS gives the figures and the rows up to which they run). The plain
    weights stay (a tied LM head shares the embedding's; the loader's tests read them). Where the
    kernels take every row count (fp32 on AVX2) there is no oneDNN copy, which would never run and
    would double the weights' memory, unless `onednn_always` (bench-step's comparison).

    A weight whose every value is an exact GGUF Q4_1 or Q8_0 block value (cpu.gguf_blocks: the
    default model, converted from its GGUF file) is kept in those blocks instead, where the fp32
    kernels run (`gguf_blocks`, default cpu.GGUF_BLOCKS): the same weights in 5-6x fewer bytes,
    every row count through cpu_gemm.cpp's linear_blocks. A bf16 model on a CPU with AMX keeps
    them in cpu_blocks_bf16.cpp's records beside oneDNN's dense copy (steps of up to
    BF16_BLOCKS_AMX_MAX_ROWS rows on AMX tiles, BF16_BLOCKS_MAX_ROWS without, take the blocks,
    multiplying by the exact weights, not their bf16 roundings): its own weights are those
    roundings, so the block values are read from `exact`, the same model loaded in fp32 (module
    names match). Returns the number of layers prepacked.
    """
    if not torch.backends.mkldnn.is_available():
        return 0
    from pagedserve.kernels import cpu

    if gguf_blocks is None:
        gguf_blocks = cpu.GGUF_BLOCKS
    exact_modules = exact.named_modules() if exact is not None else ()
    exact_weights = {name: m.weight for name, m in exact_modules if isinstance(m, _LINEARS)}
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, _LINEARS):
            weight = module.weight
            if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
                continue
            if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
                continue
            gemm = cpu.gemm_enabled(weight.dtype)
            blocks = cpu.gguf_blocks(weight) if gemm and gguf_blocks and not onednn_always else None
            if blocks is not None:  # exact GGUF block values: kept in their blocks, all row counts
                module.gemm_weight = blocks
                count += 1
                continue
            if gemm:
                module.gemm_weight = cpu.extension().pack_linear(weight.detach())
            elif (weight.dtype == torch.bfloat16 and gguf_blocks and name in exact_weights
                  and not onednn_always and cpu.blocks_bf16_enabled()):  # fmt: skip
                found = cpu.gguf_blocks_bf16(exact_weights[name])
                amx = cpu.blocks_amx_enabled()
                module.gemm_weight = Bf16Blocks(*found, amx) if found is not None else None
            if onednn_always or not gemm or GEMM_MAX_ROWS[weight.dtype] < math.inf:
                module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            count += 1
    return count


# output features of a part of split_onednn_weights: a multiple of oneDNN's AMX / AVX-512 column
# blocks, and layers narrower than two of them stay whole
ONEDNN_PART_ALIGN = 32


def split_onednn_weights(model: nn.Module, parts: int, max_bytes: int | None = None) -> int:
    """Prepack every linear layer's whole oneDNN weight (prepack_linear_weights) once more, as
    `parts` parts of consecutive output features (OnednnParts), for the decode pool's threads:
    steps on one torch thread (served: every step, prefill chunks included; the other cores are
    the HTTP stack's too) then multiply a part on the caller and one on each helper
    (cpu_onednn_split.cpp), and a helper whose core is busy takes none. Steps on more torch threads
    keep the whole weight on oneDNN's OpenMP threads (on the pool beside an OpenMP team three
    threads would share two cores). In process, one thread (2-vCPU Xeon VM with AMX, 2026-12-07,
    SmolLM2's four linears at 256 rows, bf16): two parts one after the other took 1.06x the whole
    weight's time, three 1.19x, four 1.26x. Results are the whole weight's to within
    one rounding (oneDNN may pick another kernel for a narrower weight).

    The parts are a second copy of the oneDNN weights: nothing is split where that copy would
    take more than `max_bytes`. Returns the number of layers split."""
    if parts < 2:
        return 0
    plans = []
    for module in model.modules():
        packed = getattr(module, "packed_weight", None)
        if not isinstance(packed, Tensor):
            continue
        n = module.weight.shape[0]
        step = -(-n // parts)
        step = -(-step // ONEDNN_PART_ALIGN) * ONEDNN_PART_ALIGN
        if step < n:
            plans.append((module, [*range(0, n, step), n]))
    copy = sum(m.weight.numel() * m.weight.element_size() for m, _ in plans)
    if max_bytes is not None and copy > max_bytes:
        return 0
    for module, starts in plans:
        weight = module.weight.detach()
        parts_of = [weight[a:b].contiguous() for a, b in zip(starts, starts[1:])]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in parts_of]
        module.packed_weight = OnednnParts(packed, starts, module.packed_weight)
    return len(plans)


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({d})")
    return n // d


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output features split over ranks; each rank returns its slice,
    or (gather_output) the full output gathered from all ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *, gather_output: bool = False,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.tp_rank, self.tp_size, self.gather_output = tp_rank, tp_size, gather_output
        self.output_size_per_partition = _divide(output_size, tp_size, "output features")
        self.weight = _parameter(self.output_size_per_partition, input_size, loader=self.weight_loader)
        self.packed_weight: Tensor | OnednnParts | None = None  # see prepack_linear_weights
        self.gemm_weight: GemmWeight = None  # see prepack_linear_weights
        self.bias = _parameter(self.output_size_per_partition, loader=self.weight_loader) if bias else None

    def weight_loader(self, param: Tensor, loaded: Any) -> None:
        size = param.shape[0]
        param.copy_(narrow_loaded(loaded, 0, self.tp_rank * size, size))

    def forward(self, x: Tensor) -> Tensor:
        y = linear(x, self.weight, self.bias, self.packed_weight, self.gemm_weight)
        return _all_gather_last(y, self.tp_size) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (gate and up of a gated MLP).

    Rank r holds, for each projection i, its rank-r slice, laid out one after the other; checkpoint
    tensor i is loaded with shard_id i.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, *,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, tp_rank=tp_rank, tp_size=tp_size)

    def weight_loader(self, param: Tensor, loaded: Any, shard_id: int | None = None) -> None:
        if shard_id is None:
            raise ValueError("a merged projection loads one checkpoint tensor per shard_id")
        size = _divide(self.output_sizes[shard_id], self.tp_size, "projection size")
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        param.narrow(0, offset, size).copy_(narrow_loaded(loaded, 0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections in one matmul, split by attention heads.

    Each rank keeps num_heads / tp query heads. KV heads are split the same way while tp <= the
    number of KV heads; beyond that each KV head is replicated on tp / num_kv_heads ranks, so
    every rank holds exactly the KV heads its query heads read. Output: [q | k | v] of this rank.
    """

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False, *, tp_rank: int = 0, tp_size: int = 1) -> None:
        self.head_dim = head_dim
        self.num_heads = _divide(total_num_heads, tp_size, "attention heads")
        if tp_size >= total_num_kv_heads:
            _divide(tp_size, total_num_kv_heads, "KV heads replicated")  # tp must be a multiple
            self.num_kv_heads = 1
            self.kv_head_start = tp_rank * total_num_kv_heads // tp_size
        else:
            self.num_kv_heads = _divide(total_num_kv_heads, tp_size, "KV heads")
            self.kv_head_start = tp_rank * self.num_kv_heads
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        output = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output, bias, tp_rank=tp_rank, tp_size=tp_size)

    def weight_loader(self, param: Tensor, loaded: Any, shard_id: str | None = None) -> None:
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.tp_rank * self.q_size
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, start = self.kv_size, self.kv_head_start * self.head_dim
        else:
            raise ValueError(f"QKV shard_id must be 'q', 'k' or 'v', not {shard_id!r}")
        param.narrow(0, offset, size).copy_(narrow_loaded(loaded, 0, start, size))


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input features split over ranks: x is this rank's slice of the input
    (a column-parallel layer's output); partial products are summed over ranks (all_reduce)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *, reduce_results: bool = True,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.tp_rank, self.tp_size, self.reduce_results = tp_rank, tp_size, reduce_results
        self.input_size_per_partition = _divide(input_size, tp_size, "input features")
        self.weight = _parameter(output_size, self.input_size_per_partition, loader=self.weight_loader)
        self.packed_weight: Tensor | OnednnParts | None = None  # see prepack_linear_weights
        self.gemm_weight: GemmWeight = None  # see prepack_linear_weights
        self.bias = _parameter(output_size) if bias else None

    def weight_loader(self, param: Tensor, loaded: Any) -> None:
        size = param.shape[1]
        param.copy_(narrow_loaded(loaded, 1, self.tp_rank * size, size))

    def forward(self, x: Tensor) -> Tensor:
        # the bias joins once, on rank 0, so the all_reduce adds it exactly once
        bias = self.bias if self.tp_rank == 0 else None
        y = linear(x, self.weight, bias, self.packed_weight, self.gemm_weight)
        return _all_reduce(y, self.tp_size) if self.reduce_results else y


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split into contiguous ranges of ceil(vocab / tp) rows.

    Rows past the real vocabulary (padding of the last range) are zero. Each rank embeds the ids
    in its range, zeros the rest, and the all_reduce assembles the full embeddings.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        super().__init__()
        self.num_embeddings, self.tp_rank, self.tp_size = num_embeddings, tp_rank, tp_size
        self.num_embeddings_per_partition = math.ceil(num_embeddings / tp_size)
        self.vocab_start = tp_rank * self.num_embeddings_per_partition
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        self.weight = _parameter(self.num_embeddings_per_partition, embedding_dim, loader=self.weight_loader)

    def weight_loader(self, param: Tensor, loaded: Any) -> None:
        rows = max(0, self.vocab_end - self.vocab_start)
        param.narrow(0, rows, param.shape[0] - rows).zero_()
        if rows:
            param.narrow(0, 0, rows).copy_(narrow_loaded(loaded, 0, self.vocab_start, rows))

    def forward(self, input_ids: Tensor) -> Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill(outside, 0)
        y = F.embedding(local, self.weight).masked_fill(outside[:, None], 0)
        return _all_reduce(y, self.tp_size)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection hidden -> vocabulary logits, vocabulary split like VocabParallelEmbedding
    (so tied embeddings share one weight). forward gathers the full [N, vocab] logits on every rank."""

    packed_weight: Tensor | OnednnParts | None = None  # see prepack_linear_weights
    gemm_weight: GemmWeight = None

    def forward(self, hidden: Tensor) -> Tensor:
        logits = linear(hidden, self.weight, None, self.packed_weight, self.gemm_weight)
        logits = _all_gather_last(logits, self.tp_size)
        return logits[..., : self.num_embeddings]


_LINEARS = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, as Hugging Face's Llama does.

    forward(x) returns norm(x). forward(x, residual) is the fused pre-norm step: it returns
    (norm(x + residual), x + residual), the second being the next layer's residual.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _parameter(hidden_size)

    def _norm(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """With a residual, x and residual are consumed: on CPU the fused kernel overwrites them
        (residual <- x + residual, x <- the norm) and returns them."""
        ops = kernels.fused_ops(x)
        if ops is not None and x.dim() == 2 and x.stride(-1) == 1:
            if residual is None:
                return ops.rms_norm(x, self.weight, self.eps)
            if residual.shape == x.shape and residual.stride(-1) == 1 and residual.dtype == x.dtype:
                ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
                return x, residual
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scales by (1 + weight), multiplied in fp32 before the cast back (Llama's
    casts first, then multiplies). No fused residual: Gemma normalizes after each block too."""

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GeluTanhAndMul(nn.Module):
    """gelu_tanh(x[..., :d]) * x[..., d:]: Gemma's gated MLP activation (GeGLU, tanh-approximated)."""

    def forward(self, x: Tensor) -> Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:] for x of last dimension 2d (the gated MLP activation)."""

    def forward(self, x: Tensor) -> Tensor:
        ops = kernels.fused_ops(x)
        if ops is not None and x.dim() == 2 and x.stride(-1) == 1:
            return ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def rope_inv_freq(head_dim: int, base: float, scaling: dict[str, Any] | None = None) -> Tensor:
    """Inverse frequencies of rotary embedding (fp32 [head_dim / 2]).

    scaling: None or rope_type "default" (plain RoPE), "linear" (positions / factor) or "llama3"
    (Llama 3.1's frequency-dependent scaling: long wavelengths divided by `factor`, short ones
    kept, a smooth blend between low_freq_factor and high_freq_factor).
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, blended, scaled)
    raise ValueError(f"rope_type {rope_type!r} is not supported (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (GPT-NeoX layout: the two halves of each head rotate together),
    with cos/sin for positions 0..max_position-1 precomputed in fp32 and gathered by position."""

    def __init__(self, head_dim: int, max_position: int, base: float,
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = rope_inv_freq(head_dim, base, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # fp32 whatever the model dtype: positions up to 128k need the mantissa
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def forward(self, positions: Tensor, query: Tensor, key: Tensor) -> tuple[Tensor, Tensor]:
        """Rotate query [T, Hq * D] and key [T, Hkv * D] (or [T, H, D]) of tokens at `positions` [T].

        On CPU, 2-D query and key (views into the QKV output) are rotated in place and returned."""
        ops = kernels.fused_ops(query)
        if (ops is not None and query.dim() == 2 and key.dim() == 2 and query.stride(-1) == 1
                and key.stride(-1) == 1 and positions.dtype == torch.int64):
            ops.rotary_neox(positions.contiguous(), query, key, self.cos_sin_cache, self.head_dim)
            return query, key
        cos, sin = self.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def _rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(shape[0], -1, self.head_dim)
        x1, x2 = x.chunk(2, dim=-1)
        cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).view(shape)


@dataclass
class AttentionMetadata:
    """Where this step's tokens sit in the paged KV pool; shared by every attention layer.

    slot_mapping: int64 [T], KV slot (block * block_size + offset) of each token, <0 = padding.
    block_tables: int32 [B, max_blocks], physical blocks of each sequence in logical order.
    seq_lens: int32 [B], KV length of each sequence including this step's tokens.
    query_start_loc: int32 [B + 1], sequence b's tokens are rows query_start_loc[b]:[b + 1].
    max_query_len, max_seq_len: host-side maxima of the query and KV lengths.
    groups: with hybrid KV (several KV groups), each group's (slot_mapping, block_tables); the
    fields above are then group 0's. A layer reads its group's (``Attention.kv_group``).
    """

    slot_mapping: Tensor
    block_tables: Tensor
    seq_lens: Tensor
    query_start_loc: Tensor
    max_query_len: int
    max_seq_len: int
    groups: tuple[tuple[Tensor, Tensor], ...] = ()


class Attention(nn.Module):
    """Paged attention of this rank's heads: store this step's K/V at their slots, then attend."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.sliding_window = scale, sliding_window
        self.kv_group = 0  # which KV group's block tables this layer reads (set with the pool)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: tuple[Tensor, Tensor],
                meta: AttentionMetadata) -> Tensor:
        """q [T, Hq * D], k and v [T, Hkv * D] -> attention output [T, Hq * D]."""
        num_tokens = q.shape[0]
        k_cache, v_cache = kv_cache
        slot_mapping, block_tables = meta.groups[self.kv_group] if meta.groups else (
            meta.slot_mapping, meta.block_tables)
        kernels.write_kv(k.view(num_tokens, self.num_kv_heads, self.head_dim),
                         v.view(num_tokens, self.num_kv_heads, self.head_dim),
                         k_cache, v_cache, slot_mapping)
        out = kernels.paged_attention(
            q.view(num_tokens, self.num_heads, self.head_dim), k_cache, v_cache, block_tables,
            meta.seq_lens, meta.query_start_loc, scale=self.scale, sliding_window=self.sliding_window,
            max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len,
        )
        return out.view(num_tokens, self.num_heads * self.head_dim)
