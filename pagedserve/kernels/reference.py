"""Plain-torch paged attention and KV cache ops: the CPU serving path and the oracle for the kernels.

Layout shared with the Triton kernels: each layer has one K pool and one V pool, each
[num_blocks, block_size, num_kv_heads, head_dim]; token slot s lives at block s // block_size,
offset s % block_size. A sequence's block table lists its physical blocks in logical order.
"""

from __future__ import annotations

import functools

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
    slots, keep = _valid_slots(slot_mapping)
    if keep is not None:
        key, value = key[keep], value[keep]
    # view (not reshape): a copy would silently drop the in-place write
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k_flat.index_copy_(0, slots, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value.to(v_cache.dtype))


# Every layer of a step passes the same metadata tensors: what is derived from them (host-side
# lengths, gather indices, masks) is computed once per step and reused by the other layers. A
# cache entry holds the tensors themselves and their version counters, so a new step (new
# tensors) or an in-place change (a new version) is never served a stale entry. Tensors made
# under inference_mode (the engine's) have no version counter: those must not change in place
# while a step uses them (the worker builds fresh ones each step). With hybrid KV the layers of
# one step read a few KV groups' tables in turn: each name keeps the last MEMO_ENTRIES entries.
MEMO_ENTRIES = 8
_memo: dict[str, list[tuple[tuple, object, tuple[Tensor, ...]]]] = {}


def _memoized(name: str, tensors: tuple[Tensor, ...], extra: tuple, build):
    key = (*(id(t) for t in tensors), *(0 if t.is_inference() else t._version for t in tensors), *extra)
    entries = _memo.setdefault(name, [])
    for entry in entries:
        if entry[0] == key:
            return entry[1]
    value = build()
    # the tensors ride along so that their ids cannot be reused while the entry lives
    entries.insert(0, (key, value, tensors))
    del entries[MEMO_ENTRIES:]
    return value


def _valid_slots(slot_mapping: Tensor) -> tuple[Tensor, Tensor | None]:
    """(int64 slots of the real tokens, the keep mask or None when no token is padding)."""

    def build():
        keep = slot_mapping >= 0
        if bool(keep.all()):
            return slot_mapping.long(), None
        return slot_mapping[keep].long(), keep

    return _memoized("slots", (slot_mapping,), (), build)


class _Layout:
    """The host-side shape of one step's batch over a pool of a given block geometry."""

    def __init__(self, block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                 num_blocks: int, block_size: int, num_kv_heads: int) -> None:  # fmt: skip
        device = block_tables.device
        self.block_size, self.num_kv_heads = block_size, num_kv_heads
        self.q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
        self.starts = query_start_loc[:-1].tolist()
        self.lens = seq_lens.tolist()
        # padding entries of a table may hold anything: keep every gathered index inside the pool
        self.tables = block_tables.long().clamp(0, num_blocks - 1)
        self.decode = [b for b, n in enumerate(self.q_lens) if n == 1]
        self.all_decode = len(self.decode) == len(self.q_lens) and self.starts == self.decode
        self.extends = [b for b, n in enumerate(self.q_lens) if n > 1]
        self._windows: dict[tuple, object] = {}
        if self.decode:
            self.decode_rows = torch.tensor([self.starts[b] for b in self.decode], device=device)
            lens = [self.lens[b] for b in self.decode]
            self.decode_nb = max(1, -(-max(lens) // block_size))
            self.decode_len = self.decode_nb * block_size
            self.decode_lens = torch.tensor(lens, device=device)[:, None]

    @functools.cached_property
    def decode_gather(self) -> Tensor:
        """Gather rows of the decode sequences' KV (the reference's decode; the C++ path reads in place)."""
        return self.gather_rows(self.tables[self.decode, : self.decode_nb])

    @functools.cached_property
    def decode_tables(self) -> tuple[Tensor, Tensor]:
        """(int32 block tables, int32 lengths) of the decode sequences alone, for the C++ kernel."""
        return self.tables[self.decode].int(), self.decode_lens[:, 0].int()

    def gather_rows(self, blocks: Tensor) -> Tensor:
        """Rows of the [slots * H, D] view of a pool holding blocks' KV as [B, H, n * block_size, D]."""
        num_seqs = blocks.shape[0]
        offsets = torch.arange(self.block_size, device=blocks.device)
        slots = (blocks[:, :, None] * self.block_size + offsets).view(num_seqs, 1, -1)
        heads = torch.arange(self.num_kv_heads, device=blocks.device)[None, :, None]
        return (slots * self.num_kv_heads + heads).view(-1)

    def decode_mask(self, window: int | None) -> tuple[Tensor, Tensor]:
        """(mask [B, 1, 1, L] of the keys each decode row sees, rows with no key at all)."""
        key = ("decode", window)
        if key not in self._windows:
            sl = self.decode_lens
            pos = torch.arange(self.decode_len, device=sl.device)[None]
            mask = pos < sl
            if window is not None:
                mask &= pos >= sl - window
            # an empty sequence would softmax over nothing (NaN): let it see slot 0, then zero its row
            empty = sl[:, 0] <= 0
            mask[:, 0] |= empty
            self._windows[key] = (mask[:, None, None, :], empty)
        return self._windows[key]

    def extend(self, b: int, window: int | None) -> tuple[int, int, Tensor, Tensor | None]:
        """(first block, last block + 1, gather rows, mask or None) of prefill chunk b."""
        key = (b, window)
        if key not in self._windows:
            q_len, seq_len = self.q_lens[b], self.lens[b]
            first = seq_len - q_len
            bs = self.block_size
            # with a window, blocks wholly before the first query's window are never read
            lo = max(0, first - window + 1) // bs if window is not None else 0
            hi = -(-seq_len // bs)
            rows = self.gather_rows(self.tables[b][None, lo:hi])
            mask = None
            if first > 0 or window is not None:
                device = rows.device
                q_pos = torch.arange(first, seq_len, device=device)[:, None]
                kv_pos = torch.arange(lo * bs, hi * bs, device=device)[None]
                mask = (kv_pos <= q_pos) & (kv_pos < seq_len)
                if window is not None:
                    mask &= kv_pos > q_pos - window
            self._windows[key] = (lo, hi, rows, mask)
        return self._windows[key]


def _layout(block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor, k_cache: Tensor) -> _Layout:
    geometry = (k_cache.shape[0], k_cache.shape[1], k_cache.shape[2], k_cache.device)
    return _memoized("layout", (block_tables, seq_lens, query_start_loc), geometry,
                     lambda: _Layout(block_tables, seq_lens, query_start_loc, *geometry[:3]))


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
    (prefill, extend) through one SDPA of its own. KV is gathered into a reused workspace. What
    the metadata implies (lengths, gather indices, masks) is computed once per step, not per layer.
    """
    num_q_heads = query.shape[1]
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads is not a multiple of {num_kv_heads} KV heads")
    layout = _layout(block_tables, seq_lens, query_start_loc, k_cache)
    if layout.all_decode and query.shape[0] == len(layout.decode):
        return _decode(query, k_cache, v_cache, layout, scale, sliding_window)
    out = torch.empty_like(query)
    if layout.decode:
        rows = layout.decode_rows
        out.index_copy_(0, rows, _decode(query.index_select(0, rows), k_cache, v_cache, layout, scale,
                                         sliding_window))  # fmt: skip
    for b in layout.extends:
        rows = slice(layout.starts[b], layout.starts[b] + layout.q_lens[b])
        out[rows] = _extend(query[rows], k_cache, v_cache, layout, b, scale, sliding_window)
    return out


_workspace: dict[tuple[torch.device, torch.dtype, int], Tensor] = {}


def _gather(cache: Tensor, rows: Tensor, num_seqs: int, length: int, which: int) -> Tensor:
    """The pool rows ``rows`` (from _Layout.gather_rows) as a contiguous [B, H, length, D].

    The result is a view of a buffer reused across calls (fresh memory is slow on small hosts,
    PITFALLS): it is valid until the next gather with the same `which`. Not thread-safe.
    """
    head_dim = cache.shape[-1]
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
    return out.view(num_seqs, cache.shape[2], length, head_dim)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """SDPA with the query heads of one KV head grouped, q [..., Hkv, G or 1, M, D], against k, v
    [..., Hkv, L, D] or expanded views of them. CPU SDPA runs these shapes 2-5x faster than
    enable_gqa or size-1 broadcasting (measured on torch 2.13); a None mask means fresh causal."""
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
                                          is_causal=mask is None)


def _decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, layout: _Layout, scale: float,
            window: int | None) -> Tensor:
    """One masked SDPA for all single-token sequences, KV padded to the longest: q [B, Hq, D]."""
    num_seqs, num_q_heads, head_dim = q.shape
    k = _gather(k_cache, layout.decode_gather, num_seqs, layout.decode_len, 0)
    v = _gather(v_cache, layout.decode_gather, num_seqs, layout.decode_len, 1)
    mask, empty = layout.decode_mask(window)
    group = num_q_heads // layout.num_kv_heads
    # the G query heads of a KV head are G query rows against its keys: plain batched attention
    o = _sdpa(q.view(num_seqs, layout.num_kv_heads, group, head_dim), k, v, mask, scale)
    # reshape, not view: CUDA SDPA may return a non-contiguous output (fp32 on an H200 did)
    return o.reshape(num_seqs, num_q_heads, head_dim).masked_fill(empty[:, None, None], 0)


def _extend(q: Tensor, k_cache: Tensor, v_cache: Tensor, layout: _Layout, b: int, scale: float,
            window: int | None) -> Tensor:
    """A prefill chunk of sequence b: its q_len queries end at seq_len, over the blocks they can see."""
    q_len, num_q_heads, head_dim = q.shape
    num_kv_heads = layout.num_kv_heads
    lo, hi, rows, mask = layout.extend(b, window)
    length = (hi - lo) * layout.block_size
    k = _gather(k_cache, rows, 1, length, 0)[0]
    v = _gather(v_cache, rows, 1, length, 1)[0]
    group = num_q_heads // num_kv_heads
    qg = q.reshape(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    kg = k[:, None].expand(-1, group, -1, -1)
    vg = v[:, None].expand(-1, group, -1, -1)
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
