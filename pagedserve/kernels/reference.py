"""Plain-torch paged attention and KV cache ops: the CPU serving path and the oracle for the kernels.

Layout shared with the Triton kernels: each layer has one K pool and one V pool, each
[num_blocks, block_size, num_kv_heads, head_dim]; token slot s lives at block s // block_size,
offset s % block_size. A sequence's block table lists its physical blocks in logical order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def write_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Store each token's K and V at its slot, in place.

    key, value: [num_tokens, num_kv_heads, head_dim]; k_cache, v_cache: contiguous
    [num_blocks, block_size, num_kv_heads, head_dim]; slot_mapping: int64 [num_tokens] with
    slot = block_id * block_size + offset, and a negative slot marks a padding token that is skipped.
    Values are cast to the cache dtype. Slots must be distinct among the written tokens.
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    # view (not reshape): a copy would silently drop the in-place write
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k_flat.index_copy_(0, slots, key[keep].to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value[keep].to(v_cache.dtype))


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
    """Causal attention of a ragged batch of queries over paged KV.

    query: [num_tokens, num_q_heads, head_dim]; sequence b owns rows
    query_start_loc[b]:query_start_loc[b + 1] (int32 [B + 1]). block_tables: int32
    [B, max_blocks_per_seq], entries past a sequence's last block are ignored. seq_lens: int32 [B],
    the KV length of each sequence including this step's tokens (already written with write_kv).
    Query token i of a sequence with q_len tokens sits at position seq_len - q_len + i and sees KV
    positions p <= its own, and p > pos - sliding_window when a window is given. Query head h
    reads KV head h // (num_q_heads // num_kv_heads). A row that sees no key (seq_len 0) is zero.
    Returns [num_tokens, num_q_heads, head_dim] in query's dtype; rows past
    query_start_loc[B] (token padding) are left unspecified. max_query_len and max_seq_len are
    accepted for signature parity with the kernels; this path reads the lengths on the host.

    All single-token (decode) sequences go through one batched SDPA; each longer query chunk
    (prefill, extend) through one SDPA of its own. KV is gathered into a reused workspace.
    """
    num_q_heads = query.shape[1]
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads is not a multiple of {num_kv_heads} KV heads")
    out = torch.empty_like(query)
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    starts = query_start_loc[:-1].tolist()
    lens = seq_lens.tolist()
    # padding entries of a table may hold anything: keep every gathered index inside the pool
    tables = block_tables.long().clamp(0, k_cache.shape[0] - 1)
    decode = [b for b, n in enumerate(q_lens) if n == 1]
    if decode:
        rows = torch.tensor([starts[b] for b in decode], device=query.device)
        o = _decode(query.index_select(0, rows), k_cache, v_cache, tables[decode],
                    [lens[b] for b in decode], scale, sliding_window)
        out.index_copy_(0, rows, o)
    for b, n in enumerate(q_lens):
        if n > 1:
            rows = slice(starts[b], starts[b] + n)
            out[rows] = _extend(query[rows], k_cache, v_cache, tables[b], lens[b], scale, sliding_window)
    return out


_workspace: dict[tuple[torch.device, torch.dtype, int], Tensor] = {}


def _gather(cache: Tensor, blocks: Tensor, length: int, which: int) -> Tensor:
    """KV of `blocks` ([B, n] block ids) as a contiguous [B, num_kv_heads, n * block_size, head_dim].

    The result is a view of a buffer reused across calls (fresh memory is slow on small hosts,
    PITFALLS): it is valid until the next gather with the same `which`. Not thread-safe.
    """
    num_seqs, n = blocks.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    assert n * block_size == length
    # row (slot * H + h) of the [slots * H, D] view is head h of that slot
    offsets = torch.arange(block_size, device=cache.device)
    slots = (blocks[:, :, None] * block_size + offsets).view(num_seqs, 1, -1)
    rows = (slots * num_kv_heads + torch.arange(num_kv_heads, device=cache.device)[None, :, None]).view(-1)
    key = (cache.device, cache.dtype, which)
    numel = rows.numel() * head_dim
    buf = _workspace.get(key)
    if buf is None or buf.numel() < numel:
        # a normal tensor even when first made under inference_mode (the engine's forward), so that
        # later calls outside it (tests, benchmarks) may still write into it
        with torch.inference_mode(False):
            buf = _workspace[key] = torch.empty(numel, dtype=cache.dtype, device=cache.device)
    out = buf[:numel].view(-1, head_dim)
    torch.index_select(cache.view(-1, head_dim), 0, rows, out=out)
    return out.view(num_seqs, num_kv_heads, length, head_dim)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """SDPA with the query heads of one KV head grouped, q [..., Hkv, G or 1, M, D], against k, v
    [..., Hkv, L, D] or expanded views of them. CPU SDPA runs these shapes 2-5x faster than
    enable_gqa or size-1 broadcasting (measured on torch 2.13); a None mask means fresh causal."""
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
                                          is_causal=mask is None)


def _decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, lens: list[int], scale: float,
            window: int | None) -> Tensor:
    """One masked SDPA for all single-token sequences, KV padded to the longest: q [B, Hq, D]."""
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    nb = max(1, -(-max(lens) // block_size))
    length = nb * block_size
    k = _gather(k_cache, tables[:, :nb], length, 0)
    v = _gather(v_cache, tables[:, :nb], length, 1)
    sl = torch.tensor(lens, device=q.device)[:, None]
    pos = torch.arange(length, device=q.device)[None]
    mask = pos < sl
    if window is not None:
        mask &= pos >= sl - window
    # an empty sequence would softmax over nothing (NaN): let it see slot 0, then zero its row
    empty = sl[:, 0] <= 0
    mask[:, 0] |= empty
    group = num_q_heads // num_kv_heads
    # the G query heads of a KV head are G query rows against its keys: plain batched attention
    o = _sdpa(q.view(num_seqs, num_kv_heads, group, head_dim), k, v, mask[:, None, None, :], scale)
    return o.view(num_seqs, num_q_heads, head_dim).masked_fill(empty[:, None, None], 0)


def _extend(q: Tensor, k_cache: Tensor, v_cache: Tensor, table: Tensor, seq_len: int, scale: float,
            window: int | None) -> Tensor:
    """A prefill chunk of one sequence: its q_len queries end at seq_len, over the blocks they can see."""
    q_len, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    first = seq_len - q_len
    # with a window, blocks wholly before the first query's window are never read
    lo = max(0, first - window + 1) // block_size if window is not None else 0
    hi = -(-seq_len // block_size)
    k = _gather(k_cache, table[None, lo:hi], (hi - lo) * block_size, 0)[0]
    v = _gather(v_cache, table[None, lo:hi], (hi - lo) * block_size, 1)[0]
    group = num_q_heads // num_kv_heads
    qg = q.reshape(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    kg = k[:, None].expand(-1, group, -1, -1)
    vg = v[:, None].expand(-1, group, -1, -1)
    mask = None
    if first > 0 or window is not None:
        q_pos = torch.arange(first, seq_len, device=q.device)[:, None]
        kv_pos = torch.arange(lo * block_size, hi * block_size, device=q.device)[None]
        mask = (kv_pos <= q_pos) & (kv_pos < seq_len)
        if window is not None:
            mask &= kv_pos > q_pos - window
    # with no mask, SDPA's top-left causal mask is right: query i is at position i, and the
    # padding keys past seq_len sit after every query
    o = _sdpa(qg, kg, vg, mask, scale)
    return o.permute(2, 0, 1, 3).reshape(q_len, num_q_heads, head_dim)


def copy_blocks(k_caches: list[Tensor], v_caches: list[Tensor], block_mapping: Tensor) -> None:
    """Copy-on-write: for each (src, dst) row of block_mapping (int64 [N, 2]) copy block src to dst
    in every layer's K and V pool, in place. Destinations must be distinct and not also sources."""
    if block_mapping.numel() == 0:
        return
    src = block_mapping[:, 0].long()
    dst = block_mapping[:, 1].long()
    for cache in (*k_caches, *v_caches):
        cache.index_copy_(0, dst.to(cache.device), cache.index_select(0, src.to(cache.device)))


def swap_blocks(src: Tensor, dst: Tensor, block_mapping: Tensor) -> None:
    """dst[d] = src[s] for each (s, d) row of block_mapping (int64 [N, 2]), in place.

    src and dst are one layer's K (or V) pools, possibly on different devices (swap out to a host
    pool, swap in back); block shape and dtype must match.
    """
    if block_mapping.numel() == 0:
        return
    mapping = block_mapping.cpu()
    # gather on the source device, one transfer, scatter on the destination device
    blocks = src.index_select(0, mapping[:, 0].long().to(src.device))
    dst.index_copy_(0, mapping[:, 1].long().to(dst.device), blocks.to(dst.device))
