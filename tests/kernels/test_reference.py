"""The torch reference (the CPU serving path) against attention over contiguous KV."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.kernels import reference
from tests.kernels.batches import (
    DEVICE,
    TOLERANCE,
    contiguous_attention,
    make_batch,
    max_error,
    permute_blocks,
)

# decode at several lengths (partial last blocks), a fresh prefill, chunked prefills that start
# mid-sequence, a one-token context, and an idle (CUDA-graph padding) entry with no tokens at all
MIXED = [(1, 1), (37, 1), (300, 1), (64, 64), (190, 45), (129, 2), (0, 0), (77, 1)]
HEADS = [(4, 4), (9, 3), (16, 4), (16, 2)]  # GQA ratios 1, 3, 4, 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
def test_matches_contiguous(dtype: torch.dtype, heads: tuple[int, int], head_dim: int,
                            block_size: int) -> None:
    batch = make_batch(MIXED, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                       block_size=block_size, dtype=dtype, share={7: 2, 3: 2})
    out = reference.paged_attention(*batch.args(), scale=head_dim**-0.5)
    assert out.dtype == dtype and out.shape == batch.query.shape
    assert max_error(out, contiguous_attention(batch, scale=head_dim**-0.5)) < TOLERANCE[dtype]


@pytest.mark.parametrize("window", [1, 5, 16, 100, 1000])
def test_sliding_window(window: int) -> None:
    batch = make_batch(MIXED, num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
    out = reference.paged_attention(*batch.args(), scale=0.125, sliding_window=window)
    assert max_error(out, contiguous_attention(batch, scale=0.125, sliding_window=window)) < 2e-5
    if window < 100:
        # the window really cuts: full attention differs
        assert max_error(out, contiguous_attention(batch, scale=0.125)) > 1e-2


def test_sequence_without_keys_gives_zero_rows() -> None:
    batch = make_batch([(0, 1), (20, 1), (0, 0), (30, 3)], num_q_heads=4, num_kv_heads=2, head_dim=64,
                       block_size=16)
    out = reference.paged_attention(*batch.args(), scale=0.125)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert max_error(out, contiguous_attention(batch, scale=0.125)) < 2e-5


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 200), st.integers(0, 40)), min_size=1, max_size=6),
    block_size=st.sampled_from([16, 32]),
    window=st.one_of(st.none(), st.integers(1, 64)),
    seed=st.integers(0, 2**16),
)
def test_block_permutation_leaves_output_unchanged(lens: list[tuple[int, int]], block_size: int,
                                                   window: int | None, seed: int) -> None:
    seqs = [(n, max(1, min(q, n))) for n, q in lens]
    batch = make_batch(seqs, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=block_size, seed=seed)
    out = reference.paged_attention(*batch.args(), scale=0.125, sliding_window=window)
    moved = reference.paged_attention(*permute_blocks(batch, seed + 1).args(), scale=0.125,
                                      sliding_window=window)
    torch.testing.assert_close(moved, out, atol=1e-6, rtol=1e-6)
    assert max_error(out, contiguous_attention(batch, scale=0.125, sliding_window=window)) < 2e-5


def test_write_kv_skips_padding_and_casts() -> None:
    k_cache = torch.zeros(4, 16, 2, 8, dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    key, value = torch.randn(5, 2, 8, device=DEVICE), torch.randn(5, 2, 8, device=DEVICE)
    slots = torch.tensor([3, -1, 17, 63, -1], device=DEVICE)
    reference.write_kv(key, value, k_cache, v_cache, slots)
    for token, slot in [(0, 3), (2, 17), (3, 63)]:
        assert torch.equal(k_cache[slot // 16, slot % 16], key[token].to(torch.bfloat16))
        assert torch.equal(v_cache[slot // 16, slot % 16], value[token].to(torch.bfloat16))
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 3  # nothing else written


def test_copy_blocks_copies_every_layer() -> None:
    k_caches = [torch.randn(6, 16, 2, 8, device=DEVICE) for _ in range(3)]
    v_caches = [torch.randn(6, 16, 2, 8, device=DEVICE) for _ in range(3)]
    before = [c.clone() for c in (*k_caches, *v_caches)]
    reference.copy_blocks(k_caches, v_caches, torch.tensor([[0, 4], [2, 5]], device=DEVICE))
    for cache, old in zip((*k_caches, *v_caches), before):
        expected = old.clone()
        expected[4], expected[5] = old[0], old[2]
        assert torch.equal(cache, expected)


def test_swap_blocks_out_and_back() -> None:
    device_pool = torch.randn(8, 16, 2, 8, device=DEVICE)
    host_pool = torch.zeros(4, 16, 2, 8)
    reference.swap_blocks(device_pool, host_pool, torch.tensor([[5, 0], [1, 3]]))
    assert torch.equal(host_pool[0], device_pool[5].cpu()) and torch.equal(host_pool[3], device_pool[1].cpu())
    assert torch.equal(host_pool[1], torch.zeros_like(host_pool[1]))
    restored = torch.zeros(8, 16, 2, 8, device=DEVICE)
    reference.swap_blocks(host_pool, restored, torch.tensor([[0, 7], [3, 2]]))
    assert torch.equal(restored[7], device_pool[5]) and torch.equal(restored[2], device_pool[1])
    assert torch.equal(restored[0], torch.zeros_like(restored[0]))


def test_workspace_made_under_inference_mode_is_reusable_outside_it():
    # The engine's first forward runs under inference_mode; later plain calls reuse its buffers.
    q, kc, vc = torch.randn(2, 4, 16), torch.randn(8, 4, 2, 16), torch.randn(8, 4, 2, 16)
    args = (torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([5, 6], dtype=torch.int32),
            torch.tensor([0, 1, 2], dtype=torch.int32))  # fmt: skip
    reference._workspace.clear()
    with torch.inference_mode():
        first = reference.paged_attention(q, kc, vc, *args, scale=0.25)
    assert torch.equal(reference.paged_attention(q, kc, vc, *args, scale=0.25), first)
