"""The Triton KV cache kernels (through the interpreter on CPU) against the reference."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cache, reference
from tests.kernels.batches import DEVICE


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads, head_dim, block_size", [(3, 64, 16), (2, 128, 128), (1, 80, 32)])
def test_write_kv_matches_reference(dtype: torch.dtype, num_kv_heads: int, head_dim: int,
                                    block_size: int) -> None:
    gen = torch.Generator().manual_seed(0)
    num_blocks, num_tokens = 6, 40
    # key/value arrive as fp32 views into a fused QKV projection: strided, cast on write
    qkv = torch.randn(num_tokens, 4 * num_kv_heads * head_dim, generator=gen).to(DEVICE)
    key = qkv[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, 2 * num_kv_heads * head_dim : 3 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads,
                                                                                  head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::7] = -1  # padding tokens
    slots = slots.to(DEVICE)
    k_ref = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    v_ref = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    k_tri, v_tri = k_ref.clone(), v_ref.clone()
    before = k_ref.clone()
    reference.write_kv(key, value, k_ref, v_ref, slots)
    cache.write_kv(key, value, k_tri, v_tri, slots)
    assert torch.equal(k_tri, k_ref) and torch.equal(v_tri, v_ref)
    written = slots[slots >= 0]
    flat = k_ref.view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat[written], key[slots >= 0].to(dtype))
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    assert torch.equal(flat[untouched], before.view(-1, num_kv_heads, head_dim)[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    shape = (8, 16, 2, 64)  # a block is 2048 elements: less than one copy chunk
    k_ref = [torch.randn(shape, generator=gen).to(DEVICE, dtype) for _ in range(3)]
    v_ref = [torch.randn(shape, generator=gen).to(DEVICE, dtype) for _ in range(3)]
    k_tri, v_tri = [c.clone() for c in k_ref], [c.clone() for c in v_ref]
    mapping = torch.tensor([[0, 5], [3, 7], [0, 6]], device=DEVICE)
    reference.copy_blocks(k_ref, v_ref, mapping)
    cache.copy_blocks(k_tri, v_tri, mapping)
    for tri, ref in zip(k_tri + v_tri, k_ref + v_ref):
        assert torch.equal(tri, ref)
    assert torch.equal(k_tri[2][6], k_tri[2][0]) and torch.equal(v_tri[1][7], v_tri[1][3])


def test_copy_blocks_spans_chunks() -> None:
    shape = (4, 32, 2, 128)  # 8192 elements a block: two copy programs each
    k_caches = [torch.randn(shape, device=DEVICE) for _ in range(2)]
    v_caches = [torch.randn(shape, device=DEVICE) for _ in range(2)]
    expected = [c.clone() for c in k_caches + v_caches]
    for c in expected:
        c[3] = c[1]
    cache.copy_blocks(k_caches, v_caches, torch.tensor([[1, 3]], device=DEVICE))
    for got, want in zip(k_caches + v_caches, expected):
        assert torch.equal(got, want)


def test_copy_blocks_rejects_mixed_pools() -> None:
    with pytest.raises(ValueError):
        cache.copy_blocks([torch.zeros(4, 16, 2, 8, device=DEVICE)],
                          [torch.zeros(4, 16, 2, 8, dtype=torch.float16, device=DEVICE)],
                          torch.tensor([[0, 1]], device=DEVICE))
