"""Random paged batches and the independent oracle the kernel tests compare against.

A batch keeps each sequence's K/V twice: laid out contiguously on the host (what the oracle
reads) and scattered through a shuffled block table into a pool on DEVICE (what the paged ops
read). DEVICE is the host unless PAGEDSERVE_TEST_DEVICE names another (benchmarks/gpu.sh: cuda).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedserve.kernels import reference

DEVICE = torch.device(os.environ.get("PAGEDSERVE_TEST_DEVICE", "cpu"))

# max |paged - oracle| per dtype (outputs are O(1)); each is a few ulps of the dtype at 1.0
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@dataclass
class Batch:
    query: Tensor  # [num_tokens, num_q_heads, head_dim]
    k_cache: Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: Tensor
    block_tables: Tensor  # int32 [B, max_blocks]
    seq_lens: Tensor  # int32 [B]
    query_start_loc: Tensor  # int32 [B + 1]
    keys: list[Tensor]  # per sequence, contiguous [seq_len, num_kv_heads, head_dim]
    values: list[Tensor]

    def args(self) -> tuple[Tensor, ...]:
        return (self.query, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                self.query_start_loc)

    @property
    def max_query_len(self) -> int:
        return int((self.query_start_loc[1:] - self.query_start_loc[:-1]).max())

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max())


def make_batch(
    seqs: list[tuple[int, int]],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    share: dict[int, int] | None = None,
    seed: int = 0,
    spare_blocks: int = 3,
    device: torch.device = DEVICE,
) -> Batch:
    """seqs: (seq_len, q_len) per sequence; its queries are its last q_len positions.

    share {b: a}: sequence b starts with all full blocks of sequence a that fit in it (a fork),
    the same physical blocks in both tables. Tables are shuffled, padded with random block ids.
    """
    gen = torch.Generator().manual_seed(seed)
    share = share or {}
    max_blocks = max(-(-n // block_size) for n, _ in seqs) + 1
    total = sum(-(-n // block_size) for n, _ in seqs) + spare_blocks
    order = torch.randperm(total, generator=gen)
    k_cache = torch.randn(total, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(total, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.randint(0, total, (len(seqs), max_blocks), generator=gen, dtype=torch.int32)
    keys: list[Tensor] = []
    values: list[Tensor] = []
    used = 0
    for b, (seq_len, _) in enumerate(seqs):
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        shared = 0
        if b in share:
            a = share[b]
            shared = min(seqs[a][0], seq_len) // block_size
            tables[b, :shared] = tables[a, :shared]
            k[: shared * block_size] = keys[a][: shared * block_size]
            v[: shared * block_size] = values[a][: shared * block_size]
        own = -(-seq_len // block_size) - shared
        tables[b, shared : shared + own] = order[used : used + own].int()
        used += own
        pos = torch.arange(shared * block_size, seq_len)
        slots = tables[b].long()[pos // block_size] * block_size + pos % block_size
        reference.write_kv(k[pos], v[pos], k_cache, v_cache, slots)
        keys.append(k)
        values.append(v)
    q_lens = torch.tensor([q for _, q in seqs])
    query = torch.randn(int(q_lens.sum()), num_q_heads, head_dim, generator=gen).to(dtype)
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q_lens, 0)
    seq_lens = torch.tensor([n for n, _ in seqs], dtype=torch.int32)
    return Batch(query.to(device), k_cache.to(device), v_cache.to(device), tables.to(device),
                 seq_lens.to(device), qsl.to(device), keys, values)


def contiguous_attention(batch: Batch, *, scale: float, sliding_window: int | None = None) -> Tensor:
    """The oracle: per sequence, fp32 SDPA over its contiguous K/V with an explicit causal (and
    window) mask, GQA by repeating KV heads. Never reads the pool or the block tables."""
    out = torch.zeros(batch.query.shape, dtype=torch.float32)
    query = batch.query.cpu()
    qsl = batch.query_start_loc.tolist()
    num_q_heads = batch.query.shape[1]
    for b, (k, v) in enumerate(zip(batch.keys, batch.values)):
        start, end = qsl[b], qsl[b + 1]
        seq_len, q_len = k.shape[0], end - start
        if q_len == 0 or seq_len == 0:
            continue
        group = num_q_heads // k.shape[1]
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        kv_pos = torch.arange(seq_len)[None]
        mask = kv_pos <= q_pos
        if sliding_window is not None:
            mask &= kv_pos > q_pos - sliding_window
        o = F.scaled_dot_product_attention(
            query[start:end].float().transpose(0, 1),
            k.float().repeat_interleave(group, 1).transpose(0, 1),
            v.float().repeat_interleave(group, 1).transpose(0, 1),
            attn_mask=mask,
            scale=scale,
        )
        out[start:end] = o.transpose(0, 1)
    return out


def permute_blocks(batch: Batch, seed: int = 1) -> Batch:
    """The same batch with every physical block moved to a new place and the tables updated."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(batch.k_cache.shape[0], generator=gen).to(batch.k_cache.device)
    k_cache = torch.empty_like(batch.k_cache)
    v_cache = torch.empty_like(batch.v_cache)
    k_cache[perm] = batch.k_cache
    v_cache[perm] = batch.v_cache
    tables = perm[batch.block_tables.long()].int()
    return Batch(batch.query, k_cache, v_cache, tables, batch.seq_lens, batch.query_start_loc,
                 batch.keys, batch.values)


def max_error(out: Tensor, expected: Tensor) -> float:
    """max |out - expected| in fp32 on the host; out may live on DEVICE."""
    return (out.float().cpu() - expected.float().cpu()).abs().max().item() if out.numel() else 0.0
