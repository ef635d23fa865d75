"""The Triton paged attention kernel (through the interpreter on CPU) against the reference and
against attention over contiguous KV. Shapes stay small: the interpreter runs ~8 ms per program
per KV tile."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import attention, reference
from tests.kernels.batches import (
    DEVICE,
    TOLERANCE,
    contiguous_attention,
    make_batch,
    max_error,
    permute_blocks,
)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# decode at several lengths, a fresh prefill, a chunk starting mid-sequence, a two-token
# speculative-style chunk, an idle entry with no tokens; sequence 6 forks sequence 2's blocks
MIXED = [(1, 1), (37, 1), (150, 1), (64, 64), (130, 40), (0, 0), (77, 1), (20, 2)]
DECODE = [(1, 1), (100, 1), (300, 1), (17, 1)]


def check(batch, dtype: torch.dtype, scale: float, window: int | None = None) -> torch.Tensor:
    out = attention.paged_attention(*batch.args(), scale=scale, sliding_window=window,
                                    max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len)
    assert out.dtype == dtype and out.shape == batch.query.shape
    expected = contiguous_attention(batch, scale=scale, sliding_window=window)
    assert max_error(out, expected) < TOLERANCE[dtype]
    ref = reference.paged_attention(*batch.args(), scale=scale, sliding_window=window)
    assert max_error(out, ref) < 2 * TOLERANCE[dtype]
    return out


@pytest.mark.parametrize(
    "dtype, num_q_heads, num_kv_heads, head_dim, block_size",
    [
        (F32, 9, 3, 64, 16),
        (F32, 16, 2, 128, 32),
        (F32, 4, 4, 64, 128),
        (F16, 16, 4, 128, 64),
        (F16, 9, 3, 64, 32),
        (F16, 4, 4, 128, 16),
        (BF16, 16, 4, 64, 16),
        (BF16, 16, 2, 128, 128),
        (F32, 6, 2, 80, 16),  # head_dim padded to the next power of two
    ],
)
def test_mixed_batch(dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int,
                     block_size: int) -> None:
    batch = make_batch(MIXED, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       block_size=block_size, dtype=dtype, share={6: 2})
    check(batch, dtype, head_dim**-0.5)


@pytest.mark.parametrize(
    "dtype, num_q_heads, num_kv_heads, head_dim, block_size",
    [(F32, 9, 3, 64, 16), (BF16, 16, 2, 128, 64), (F16, 4, 2, 64, 32)],
)
def test_decode_batch_splits_kv(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, num_q_heads: int,
                                num_kv_heads: int, head_dim: int, block_size: int) -> None:
    chosen: list[int] = []
    heuristic = attention._num_splits
    monkeypatch.setattr(attention, "_num_splits", lambda *args: chosen.append(heuristic(*args)) or chosen[-1])
    batch = make_batch(DECODE, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       block_size=block_size, dtype=dtype, share={2: 1})
    check(batch, dtype, head_dim**-0.5)
    # the interpreter's small "GPU" makes this batch split: the merge kernel was on the path
    assert chosen and chosen[-1] > 1


@pytest.mark.parametrize("splits", [2, 7])
def test_forced_splits_with_chunks(monkeypatch: pytest.MonkeyPatch, splits: int) -> None:
    monkeypatch.setattr(attention, "_num_splits", lambda *args: splits)
    # many programs would normally mean no split; force one so chunks merge splits too
    monkeypatch.setattr(attention, "_PROGRAMS_PER_SM", 10**6)
    batch = make_batch(MIXED, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16)
    check(batch, F32, 0.125)


@pytest.mark.parametrize("window", [1, 20, 100])
@pytest.mark.parametrize("seqs", [MIXED, DECODE], ids=["mixed", "decode"])
def test_sliding_window(seqs: list[tuple[int, int]], window: int) -> None:
    batch = make_batch(seqs, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16)
    check(batch, F32, 0.125, window)


def test_block_permutation_leaves_output_unchanged() -> None:
    batch = make_batch(MIXED, num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=F16,
                       share={6: 2})
    out = check(batch, F16, 0.125)
    moved = attention.paged_attention(*permute_blocks(batch).args(), scale=0.125)
    # the same tiles in the same order: only the addresses changed
    assert torch.equal(moved, out)


def test_strided_query_and_host_lengths_optional() -> None:
    """The model passes q as a view into a fused QKV projection; lengths may come from the device."""
    batch = make_batch(MIXED, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=32)
    qkv = torch.randn(batch.query.shape[0], 8 * 64, device=DEVICE)
    qkv[:, : 4 * 64] = batch.query.reshape(-1, 4 * 64)
    batch.query = qkv[:, : 4 * 64].view(-1, 4, 64)
    assert not batch.query.is_contiguous()
    expected = contiguous_attention(batch, scale=0.125)
    assert max_error(attention.paged_attention(*batch.args(), scale=0.125), expected) < TOLERANCE[F32]
    assert max_error(reference.paged_attention(*batch.args(), scale=0.125), expected) < TOLERANCE[F32]


def test_sequence_without_keys_gives_zero_rows() -> None:
    batch = make_batch([(0, 1), (20, 1), (30, 3)], num_q_heads=4, num_kv_heads=2, head_dim=64,
                       block_size=16)
    out = attention.paged_attention(*batch.args(), scale=0.125)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert max_error(out, contiguous_attention(batch, scale=0.125)) < TOLERANCE[F32]
