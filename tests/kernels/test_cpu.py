"""The CPU serving path (C++ decode attention over KV read in place) against the independent oracle
(attention over contiguous KV) and the torch reference."""

from __future__ import annotations

import pytest
import torch

from pagedserve import kernels
from pagedserve.kernels import cpu, reference
from tests.kernels.batches import TOLERANCE, contiguous_attention, make_batch, max_error

pytestmark = pytest.mark.skipif(cpu.extension() is None, reason="the C++ CPU kernel could not be built")

# decodes of many lengths (partial blocks, one token, a long context), mixed with prefill chunks
MIXED = [(1, 1), (37, 1), (300, 1), (64, 64), (190, 45), (129, 2), (0, 0), (77, 1), (17, 1)]
DECODE = [(1, 1), (16, 1), (17, 1), (250, 1), (513, 1), (0, 1), (33, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (16, 2), (8, 1)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("block_size", [8, 16, 64])
def test_matches_contiguous(dtype, heads, head_dim, block_size) -> None:
    batch = make_batch(MIXED, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                       block_size=block_size, dtype=dtype, share={7: 2, 3: 2})  # fmt: skip
    out = cpu.paged_attention(*batch.args(), scale=head_dim**-0.5, max_query_len=64)
    assert out.dtype == dtype and out.shape == batch.query.shape
    assert max_error(out, contiguous_attention(batch, scale=head_dim**-0.5)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 1, 5, 16, 100])
def test_decode_only_steps_and_sliding_windows(dtype, window) -> None:
    batch = make_batch(DECODE, num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype)
    out = cpu.paged_attention(*batch.args(), scale=0.125, sliding_window=window, max_query_len=1)
    expected = contiguous_attention(batch, scale=0.125, sliding_window=window)
    assert max_error(out, expected) < TOLERANCE[dtype]
    assert torch.equal(out[5], torch.zeros_like(out[5])), "a sequence with no key gives zeros"
    ref = reference.paged_attention(*batch.args(), scale=0.125, sliding_window=window)
    assert max_error(out, ref) < TOLERANCE[dtype]


# decodes sharing leading blocks: a prefix held by seven sequences (a chain of forks, one whose whole
# table is shared, equal and shorter lengths), another pair, one with no key, ones alone
SHARED = [(530, 1), (530, 1), (700, 1), (257, 1), (40, 1), (513, 1), (0, 1), (600, 1), (16, 1), (1, 1),
          (800, 1)]  # fmt: skip
SHARED_FORKS = {1: 0, 2: 0, 3: 2, 5: 4, 7: 1, 8: 0, 10: 7}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_sequences_sharing_blocks_read_once_give_the_same_attention(monkeypatch, dtype, threads) -> None:
    """Shared leading blocks are visited once for all their sequences (block-major, split over
    the threads asked for): the result is the per-sequence one bit for bit, and the oracle's."""
    batch = make_batch(SHARED, num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype,
                       share=SHARED_FORKS)  # fmt: skip
    tables = batch.block_tables
    assert torch.equal(tables[10, :33], tables[0, :33]) and torch.equal(tables[5, :2], tables[4, :2])
    outs = {}
    try:
        cpu.set_decode_threads(threads)
        for share in (True, False):
            monkeypatch.setattr(cpu, "SHARE_BLOCKS", share)
            outs[share] = cpu.paged_attention(*batch.args(), scale=0.125, max_query_len=1)
    finally:
        cpu.set_decode_threads(0)
    assert torch.equal(outs[True], outs[False]), "the visiting order changes no result"
    assert max_error(outs[True], contiguous_attention(batch, scale=0.125)) < TOLERANCE[dtype]
    assert torch.equal(outs[True][6], torch.zeros_like(outs[True][6]))


def test_table_padding_past_the_last_block_is_never_read() -> None:
    batch = make_batch([(20, 1), (3, 1)], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    tables = batch.block_tables.clone()
    tables[1, 1:] = 10**6  # garbage past the sequence's one block
    args = list(batch.args())
    args[3] = tables
    out = cpu.paged_attention(*args, scale=0.125, max_query_len=1)
    assert max_error(out, contiguous_attention(batch, scale=0.125)) < 2e-5


def test_cpu_tensors_dispatch_to_the_cpu_path(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(cpu, "paged_decode", lambda *a: calls.append(1) or reference.paged_attention(
        a[0], a[1], a[2], a[3], a[4], torch.arange(a[0].shape[0] + 1, dtype=torch.int32), scale=a[5]))
    batch = make_batch([(5, 1), (9, 1)], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    kernels.paged_attention(*batch.args(), scale=0.125, max_query_len=1)
    assert calls, "auto on CPU runs the C++ decode"
    with kernels.use_backend("torch"):
        kernels.paged_attention(*batch.args(), scale=0.125, max_query_len=1)
    assert len(calls) == 1, "the torch backend is the pure reference"


# prefill chunks: whole prompts, chunks after a context, lengths off the block and tile sizes
PREFILL = [(64, 64), (190, 45), (300, 300), (33, 17), (17, 2), (500, 129), (16, 16), (5, 1)]
prefill_kernel = pytest.mark.skipif(cpu.extension() is None or not cpu.extension().prefill_bf16_available(),
                                    reason="the CPU has no AVX512-BF16")  # fmt: skip


# the kernel's two ways: AMX tiles (where the CPU has them and Linux grants them), the AVX512-BF16 loop
PREFILL_PATHS = [
    pytest.param(False, id="avx512"),
    pytest.param(True, id="amx", marks=pytest.mark.skipif(
        cpu.extension() is None or not cpu.extension().prefill_amx_available(), reason="no AMX tiles here")),
]  # fmt: skip


@prefill_kernel
@pytest.mark.parametrize("amx", PREFILL_PATHS)
@pytest.mark.parametrize("window", [None, 1, 7, 100])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("head_dim", [64, 80, 128])  # 80: not whole AMX steps, the loop runs instead
@pytest.mark.parametrize("block_size", [8, 16])
def test_bf16_prefill_kernel_matches_contiguous(monkeypatch, amx, window, heads, head_dim,
                                                block_size) -> None:  # fmt: skip
    monkeypatch.setenv("PAGEDSERVE_CPU_PREFILL", "1")
    monkeypatch.setattr(cpu, "PREFILL_AMX", amx)
    ext = cpu.extension()
    calls = []
    real = ext.paged_prefill
    monkeypatch.setattr(ext, "paged_prefill", lambda *a: calls.append((a[0].shape[0], a[7])) or real(*a))
    batch = make_batch(PREFILL, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                       block_size=block_size, dtype=torch.bfloat16, share={2: 1})  # fmt: skip
    scale = head_dim**-0.5
    out = cpu.paged_attention(*batch.args(), scale=scale, sliding_window=window, max_query_len=300)
    assert sorted(calls) == sorted((q, amx) for _, q in PREFILL if q > 1), "every chunk of 2+ queries runs it"
    expected = contiguous_attention(batch, scale=scale, sliding_window=window)
    assert max_error(out, expected) < TOLERANCE[torch.bfloat16]


@prefill_kernel
def test_bf16_prefill_paths_agree_on_long_chunks(monkeypatch) -> None:
    """Chunks of 2048 queries, and of 64 after 1984 cached tokens (many key groups: the AMX path's
    buffers grow, its scores are taken over all keys before any probability), against SDPA over
    the same KV, on both paths; the AMX path only where it runs."""
    ext = cpu.extension()
    batch = make_batch([(2048, 2048), (2048, 64)], num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                       dtype=torch.bfloat16)  # fmt: skip
    expected = contiguous_attention(batch, scale=0.125)
    monkeypatch.setenv("PAGEDSERVE_CPU_PREFILL", "1")
    for amx in (False, True) if ext.prefill_amx_available() else (False,):
        monkeypatch.setattr(cpu, "PREFILL_AMX", amx)
        out = cpu.paged_attention(*batch.args(), scale=0.125, max_query_len=2048)
        assert max_error(out, expected) < TOLERANCE[torch.bfloat16], amx


@prefill_kernel
@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("tiles", [False, True], ids=["no-tiles", "tiles"])
def test_bf16_prefill_takes_the_kernel_by_default_unless_amx_without_its_tiles(monkeypatch, amx,
                                                                             tiles) -> None:  # fmt: skip
    """Without AMX the loop runs; with AMX the kernel runs on its tiles, and where the tiles do not
    (PAGEDSERVE_CPU_PREFILL_AMX=0 or not granted) chunks gather KV for SDPA (oneDNN's AMX GEMMs
    beat the loop). PAGEDSERVE_CPU_PREFILL decides instead when set. The result is attention's."""
    flags = {"avx512f", "avx512_bf16"} | ({"amx_bf16", "amx_tile"} if amx else set())
    monkeypatch.setattr(cpu, "_cpu_flags", lambda: frozenset(flags))
    ext = cpu.extension()
    monkeypatch.setattr(cpu, "PREFILL_AMX", tiles)
    tiles = tiles and ext.prefill_amx_available()
    calls = []
    real = ext.paged_prefill
    monkeypatch.setattr(ext, "paged_prefill", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    batch = make_batch([(64, 64), (190, 45), (5, 1)], num_q_heads=9, num_kv_heads=3, head_dim=64,
                       block_size=16, dtype=torch.bfloat16)  # fmt: skip
    expected = contiguous_attention(batch, scale=0.125)
    default = not amx or tiles
    for forced, runs in ((None, default), ("0" if default else "1", not default)):
        if forced is None:
            monkeypatch.delenv("PAGEDSERVE_CPU_PREFILL", raising=False)
        else:
            monkeypatch.setenv("PAGEDSERVE_CPU_PREFILL", forced)
        calls.clear()
        out = cpu.paged_attention(*batch.args(), scale=0.125, max_query_len=64)
        assert sorted(calls) == ([45, 64] if runs else []), (forced, calls)
        assert max_error(out, expected) < TOLERANCE[torch.bfloat16]


@prefill_kernel
def test_bf16_prefill_kernel_rejects_what_it_cannot_run() -> None:
    ext = cpu.extension()
    batch = make_batch([(40, 40)], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                       dtype=torch.bfloat16)  # fmt: skip
    q, k, v, tables = batch.args()[:4]
    with pytest.raises(RuntimeError, match="bf16 only"):
        ext.paged_prefill(q.float(), k, v, tables[0].int(), 40, 0.125, 0, False)
    with pytest.raises(RuntimeError, match="too short"):
        ext.paged_prefill(q, k, v, tables[0, :1].int(), 40, 0.125, 0, False)
    bad = tables[0].int().clone()
    bad[1] = 10**6
    with pytest.raises(RuntimeError, match="outside the pool"):
        ext.paged_prefill(q, k, v, bad, 40, 0.125, 0, False)


@pytest.mark.skipif(not cpu.decode_amx_enabled(), reason="no AMX tiles for bf16 decode here")
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_decode_on_amx_tiles_against_the_oracle_and_the_loop(monkeypatch, block_size, head_dim,
                                                                  threads) -> None:
    """bf16 decode on AMX tiles (the rows of every sequence reading a shared block in one tile
    product): the oracle's attention within bf16's tolerance, the AVX512-BF16 loop's within two
    bf16 roundings, and the same bits whether or not shared blocks are visited together."""
    ext = cpu.extension()
    batch = make_batch(SHARED, num_q_heads=9, num_kv_heads=3, head_dim=head_dim, block_size=block_size,
                       dtype=torch.bfloat16, share=SHARED_FORKS)  # fmt: skip
    expected = contiguous_attention(batch, scale=0.125)
    outs = {}
    try:
        cpu.set_decode_threads(threads)
        for amx, share in ((True, True), (True, False), (False, True)):
            ext.set_decode_amx(amx)
            monkeypatch.setattr(cpu, "SHARE_BLOCKS", share)
            outs[amx, share] = cpu.paged_attention(*batch.args(), scale=0.125, max_query_len=1)
    finally:
        ext.set_decode_amx(cpu.DECODE_AMX)
        cpu.set_decode_threads(0)
    assert torch.equal(outs[True, True], outs[True, False]), "the visiting order changes no result"
    assert max_error(outs[True, True], expected) < TOLERANCE[torch.bfloat16]
    assert max_error(outs[True, True], outs[False, True]) < 1e-2
    # the tiles did run: P rounded to bf16 moves low bits
    assert not torch.equal(outs[True, True], outs[False, True])
    assert torch.equal(outs[True, True][6], torch.zeros_like(outs[True, True][6]))
