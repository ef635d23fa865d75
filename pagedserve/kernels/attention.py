"""Triton paged attention: one kernel for prefill, chunked prefill (extend) and decode.

Each program owns one tile of BLOCK_Q query tokens of one sequence times the GROUP query heads
that share one KV head (BLOCK_M = BLOCK_Q * GROUP_PAD rows), so GQA reads each KV tile once.
It walks KV tiles of TILE_N keys, gathering each key's row through the block table (so TILE_N
and the cache block size are independent), with an online softmax. Programs map to
(sequence, query tile) by a binary search over query_start_loc, so the grid needs no host sync.

Decode and short chunks over long contexts split the KV range over a third grid axis
(flash-decoding): each split writes its normalized partial output and log-sum-exp, and a second
small kernel merges the splits. The contract is reference.paged_attention's.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

# The split heuristic aims for this many programs per SM so a few long sequences fill the GPU.
_PROGRAMS_PER_SM = 4
# A split should read at least this many KV tiles, or merging costs more than it hides.
_MIN_TILES_PER_SPLIT = 4
_MAX_SPLITS = 64


@triton.jit
def _find_sequence(query_start_loc_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest b with query_start_loc[b] // BLOCK_Q + b <= pid: sequence b owns programs from there."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tile(q, m_i, l_i, acc, tile, k_ptr, v_ptr, table_ptr, seq_len, q_pos, window, scale_log2,
                 stride_kb, stride_ks, stride_vb, stride_vs, dims, dim_ok,
                 BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, MASKED: tl.constexpr,
                 HAS_WINDOW: tl.constexpr, UPCAST_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax step over KV tile `tile`; MASKED tiles apply causal/length/window masks."""
    keys = tile * TILE_N + tl.arange(0, TILE_N)
    key_ok = keys < seq_len
    block = tl.load(table_ptr + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    k_rows = block * stride_kb + (keys % BLOCK_SIZE) * stride_ks
    v_rows = block * stride_vb + (keys % BLOCK_SIZE) * stride_vs
    k = tl.load(k_ptr + k_rows[None, :] + dims[:, None], mask=key_ok[None, :] & dim_ok[:, None], other=0.0)
    if UPCAST_DOT:
        k = k.to(tl.float32)
    s = tl.dot(q, k, input_precision=PRECISION) * scale_log2
    if MASKED:
        visible = (keys[None, :] <= q_pos[:, None]) & key_ok[None, :]
        if HAS_WINDOW:
            visible &= keys[None, :] > q_pos[:, None] - window
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row that has seen no key yet keeps m = -inf; offset it by 0 so exp2 gives 0, not NaN
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + v_rows[:, None] + dims[None, :], mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST_DOT:
        v = v.to(tl.float32)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_ptr, lse_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale_log2, window, num_seqs, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr,
    UPCAST_DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_sequence(query_start_loc_ptr, pid, num_seqs, BLOCK_Q)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    q_tile = pid - (q_begin // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (tok < q_len) & (rows % GROUP_PAD < GROUP)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    token = (q_begin + tok).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    q_pos = context + tok

    # keys this tile of queries can see: [kv_lo, kv_hi), cut into num_splits runs of whole tiles
    first_pos = context + q_tile * BLOCK_Q
    kv_hi = tl.minimum(first_pos + BLOCK_Q, seq_len)
    kv_lo = 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(first_pos - window + 1, 0)
    tile_lo = kv_lo // TILE_N
    tile_hi = tl.cdiv(kv_hi, TILE_N)
    per_split = tl.cdiv(tile_hi - tile_lo, num_splits)
    t0 = tile_lo + split * per_split
    t1 = tl.minimum(t0 + per_split, tile_hi)
    # tiles wholly at or before the first query's position are visible to every row: no mask
    t_full = t0
    if not HAS_WINDOW:
        t_full = tl.maximum(t0, tl.minimum(t1, (first_pos + 1) // TILE_N))

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(t0, t_full):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, tile, k_head, v_head, table, seq_len, q_pos, window,
                                     scale_log2, stride_kb, stride_ks, stride_vb, stride_vs, dims, dim_ok,
                                     BLOCK_SIZE, TILE_N, False, HAS_WINDOW, UPCAST_DOT, PRECISION)
    for tile in range(t_full, t1):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, tile, k_head, v_head, table, seq_len, q_pos, window,
                                     scale_log2, stride_kb, stride_ks, stride_vb, stride_vs, dims, dim_ok,
                                     BLOCK_SIZE, TILE_N, True, HAS_WINDOW, UPCAST_DOT, PRECISION)

    # rows that saw no key (empty split, empty sequence) give 0 and, when split, lse = -inf
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    io_mask = row_ok[:, None] & dim_ok[None, :]
    if SPLIT:
        part_row = (token * NUM_Q_HEADS + head) * num_splits + split
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(lse_ptr + part_row, lse, mask=row_ok)
        tl.store(part_ptr + part_row[:, None] * HEAD_DIM_PAD + dims[None, :], out, mask=io_mask)
    else:
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _merge_splits_kernel(out_ptr, part_ptr, lse_ptr, num_splits, stride_ot, stride_oh,
                         NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                         SPLITS_PAD: tl.constexpr):
    """out[t, h] = sum_s w_s * part[t, h, s] / sum_s w_s with w_s = 2^(lse_s - max lse)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    row = (token * NUM_Q_HEADS + head) * num_splits + splits
    split_ok = splits < num_splits
    lse = tl.load(lse_ptr + row, mask=split_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.math.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    part = tl.load(part_ptr + row[:, None] * HEAD_DIM_PAD + dims[None, :], mask=split_ok[:, None], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def _interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    # the interpreter: a small "GPU" so that tests still exercise the split path
    return 4


def _num_splits(num_programs: int, num_tiles: int, device: torch.device) -> int:
    """KV splits per query tile: enough programs to fill the SMs, each split still a few tiles long."""
    want = triton.cdiv(_PROGRAMS_PER_SM * _num_sms(device), max(num_programs, 1))
    return max(1, min(want, triton.cdiv(num_tiles, _MIN_TILES_PER_SPLIT), _MAX_SPLITS))


def _tile_config(max_query_len: int, dtype: torch.dtype, group_pad: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, TILE_N, num_warps, num_stages) for this batch's shape."""
    wide = dtype == torch.float32  # fp32 tiles take twice the shared memory
    if max_query_len == 1:
        # decode is bandwidth-bound: small query tile, deep KV pipeline
        return max(16, group_pad), 32 if wide else 64, 4, 3
    return max(64 if wide else 128, group_pad), 32 if wide else 64, 8, 3 if not wide else 2


def paged_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> Tensor:
    """Triton paged attention; same contract as reference.paged_attention.

    Without max_query_len (and, for decode, max_seq_len) this reads them from the device, which
    syncs; pass them from the host to keep the launch asynchronous (and CUDA-graph capturable).
    """
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads is not a multiple of {num_kv_heads} KV heads")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head_dim must be contiguous")
    query = query if query.stride(-1) == 1 else query.contiguous()
    # the interpreter rounds fp32 -> bf16 toward zero (GPUs round to nearest even): let torch round
    round_on_host = query.dtype == torch.bfloat16 and _interpreting()
    out_dtype = torch.float32 if round_on_host else query.dtype
    out = torch.empty(query.shape, dtype=out_dtype, device=query.device)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out.to(query.dtype)
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_m, tile_n, num_warps, num_stages = _tile_config(max_query_len, query.dtype, group_pad)
    block_q = block_m // group_pad
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16

    # real query tiles: one per decode sequence, about num_tokens / block_q for prefill
    programs = (min(num_seqs, num_tokens) if max_query_len == 1 else triton.cdiv(num_tokens, block_q))
    num_splits = 1
    if programs * num_kv_heads < _PROGRAMS_PER_SM * _num_sms(query.device):
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        num_splits = _num_splits(programs * num_kv_heads, triton.cdiv(max_seq_len, tile_n), query.device)
    part = lse = out  # unused placeholders when not split
    if num_splits > 1:
        part = torch.empty(num_tokens, num_q_heads, num_splits, head_dim_pad, dtype=torch.float32,
                           device=query.device)
        lse = torch.empty(num_tokens, num_q_heads, num_splits, dtype=torch.float32, device=query.device)

    # the upper bound on query tiles that _find_sequence's numbering can produce; extras exit at once
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        query, k_cache, v_cache, out, part, lse,
        block_tables, seq_lens, query_start_loc,
        scale * math.log2(math.e), sliding_window or 0, num_seqs, num_splits,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=block_m,
        TILE_N=tile_n, BLOCK_SIZE=block_size, HAS_WINDOW=sliding_window is not None,
        SPLIT=num_splits > 1,
        # the interpreter multiplies bf16 as raw uint16 bits: give it fp32 operands
        UPCAST_DOT=query.dtype == torch.bfloat16 and _interpreting(),
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            out, part, lse, num_splits, out.stride(0), out.stride(1),
            NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
        )
    return out.to(query.dtype)
