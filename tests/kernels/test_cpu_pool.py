"""The decode pool (cpu_pool.h): helper threads for decode steps' linears and attention. With
helpers the kernels give the results of one thread bit for bit (oracle: the same call with no
helpers, and the float64 product / contiguous attention), over many calls in a row (the helpers
race the caller for units); a caller whose helpers never run (a forked child has none of its
parent's threads) still finishes every region, alone; and the worker starts helpers only served,
where the replica has a core beyond its torch threads."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from pagedserve.kernels import cpu
from tests.kernels.batches import TOLERANCE, contiguous_attention, make_batch, max_error
from tests.kernels.test_cpu import SHARED, SHARED_FORKS
from tests.kernels.test_cpu_gemm import _gguf_weight, _oracle

ext = cpu.extension()
pytestmark = pytest.mark.skipif(ext is None or not ext.gemm_available(),
                                reason="the C++ CPU kernel could not be built with AVX2")  # fmt: skip


@pytest.fixture
def helpers():
    """Sets the pool's helper count for one test; none afterwards."""

    def configure(n: int, spin_us: int = 50) -> None:
        assert cpu.set_decode_pool(n, spin_us)
        assert ext.decode_pool_helpers() == n

    yield configure
    cpu.set_decode_pool(0)


@pytest.mark.parametrize("count", [1, 3])
def test_linears_with_helpers_equal_one_thread_bit_for_bit(helpers, count) -> None:
    torch.manual_seed(count)
    w, bias = _gguf_weight(960, 576, "q4_1"), torch.randn(960)
    q, scales, q8 = cpu.gguf_blocks(w)
    packed = ext.pack_linear(torch.randn(100, 576))
    xs = {rows: torch.randn(rows, 576) for rows in (1, 2, 3, 5, 16, 96, 97)}
    alone = {rows: (ext.linear_blocks(x, q, scales, bias, 960, q8), ext.linear_packed(x, packed, None, 100))
             for rows, x in xs.items()}  # fmt: skip
    helpers(count)
    for _ in range(30):  # many regions in a row: units change hands between the threads
        for rows, x in xs.items():
            got = ext.linear_blocks(x, q, scales, bias, 960, q8), ext.linear_packed(x, packed, None, 100)
            assert torch.equal(got[0], alone[rows][0]) and torch.equal(got[1], alone[rows][1]), rows
    torch.testing.assert_close(alone[16][0], _oracle(xs[16], w, bias), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("spin_us", [0, 50])
def test_decode_attention_with_helpers_equals_one_thread_bit_for_bit(helpers, spin_us) -> None:
    """Spinning or asleep between regions (spin 0: every region wakes the helper from its futex)."""
    batch = make_batch(SHARED, num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                       dtype=torch.float32, share=SHARED_FORKS)  # fmt: skip
    alone = cpu.paged_attention(*batch.args(), scale=0.125, max_query_len=1)
    helpers(1, spin_us)
    for _ in range(20):
        assert torch.equal(cpu.paged_attention(*batch.args(), scale=0.125, max_query_len=1), alone)
    assert max_error(alone, contiguous_attention(batch, scale=0.125)) < TOLERANCE[torch.float32]


def _in_child(q, scales, x, conn) -> None:
    conn.send(ext.linear_blocks(x, q, scales, None, 960, False).tolist())  # not a tensor: no shared memory


def test_a_caller_whose_helpers_never_run_finishes_alone(helpers) -> None:
    """A forked child holds the pool's state but none of its threads: every unit falls to the
    caller, which waits only for units a helper took (none), so the region ends, with the result."""
    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork here")
    w = _gguf_weight(960, 576, "q4_1")
    q, scales, _ = cpu.gguf_blocks(w)
    x = torch.randn(16, 576)
    expected = ext.linear_blocks(x, q, scales, None, 960, False)
    helpers(1)
    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_in_child, args=(q, scales, x, theirs))
    child.start()
    try:
        assert ours.poll(60), "the child's region never ended"
        assert torch.equal(torch.tensor(ours.recv()), expected)
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0


CASES = [(1, 2, None, 1), (1, 1, None, 0), (2, 4, None, 3), (1, 2, "0", 0), (1, 1, "2", 2)]


@pytest.mark.parametrize(("threads", "prefill", "env", "expected"), CASES)
def test_the_worker_starts_helpers_only_on_reserved_cores(monkeypatch, threads, prefill, env, expected):
    from pagedserve.worker import worker as worker_mod

    calls = []
    monkeypatch.setattr(worker_mod, "DECODE_HELPERS", env)
    monkeypatch.setattr(worker_mod.cpu_kernels, "set_decode_pool", lambda n, spin: calls.append(n) or True)
    w = worker_mod.Worker.__new__(worker_mod.Worker)
    w.max_threads, w.prefill_threads = threads, prefill
    assert w.configure_decode_pool() == expected
    assert calls == ([expected] if expected else [])

