"""The decode pool (cpu_pool.h): helper threads for decode steps' linears and attention. With
helpers the kernels give the results of one thread bit for bit (oracle: the same call with no
helpers, and the float64 product / contiguous attention), over many calls in a row (the helpers
race the caller for units); a caller whose helpers never run (a forked child has none of its
parent's threads) still finishes every region, alone; and the worker starts helpers only served,
where the replica has a core beyond its torch threads, and (where switched on) splits oneDNN's
linears over the pool's threads (cpu_onednn_split.cpp), which give the parts' results on one thread
bit for bit and the whole weight's within one rounding (oracles: the parts on the caller alone,
oneDNN on the whole weight, and the float64 product)."""

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


@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.parametrize(("threads", "prefill", "env", "expected"), CASES)
def test_the_worker_starts_helpers_only_on_reserved_cores(monkeypatch, threads, prefill, env, expected,
                                                          pooled) -> None:  # fmt: skip
    """And, with PREFILL_POOL (the default; PAGEDSERVE_CPU_PREFILL_POOL=0 turns it off), splits
    oneDNN's weights over them and runs prefill chunks on the torch threads and the pool."""
    from pagedserve.worker import worker as worker_mod

    calls = []
    monkeypatch.setattr(worker_mod, "DECODE_HELPERS", env)
    monkeypatch.setattr(worker_mod, "PREFILL_POOL", pooled)
    monkeypatch.setattr(worker_mod.cpu_kernels, "set_decode_pool", lambda n, spin: calls.append(n) or True)
    splits = []
    monkeypatch.setattr(worker_mod, "split_onednn_weights",
                        lambda model, parts, room: splits.append(parts) or 0)  # fmt: skip
    w = worker_mod.Worker.__new__(worker_mod.Worker)
    w.max_threads, w.prefill_threads, w.model = threads, prefill, None
    assert w.configure_decode_pool() == expected
    assert calls == ([expected] if expected else [])
    assert splits == ([expected + 1] if expected and pooled else [])  # a part for the caller, one a helper
    assert w.prefill_threads == (threads if expected and pooled else prefill)


@pytest.fixture
def one_thread(torch_threads) -> None:
    """A step on one torch thread (decode, served), where split weights take the pool."""
    torch_threads(1)


def _onednn_layer(n: int, k: int, dtype: torch.dtype, bias: bool = True):
    from pagedserve.worker import layers

    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no oneDNN bf16 on this CPU")
    lin = layers.ColumnParallelLinear(k, n, bias=bias).to(dtype)
    lin.weight.data.normal_(0, 0.05)
    if bias:
        lin.bias.data.normal_()
    lin.packed_weight = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach())
    return lin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("count", [1, 3])
@torch.inference_mode()
def test_onednn_linears_split_over_the_pool_equal_the_parts_on_one_thread(helpers, one_thread, monkeypatch,
                                                                          dtype, count) -> None:  # fmt: skip
    """count helpers, count + 1 parts. Whichever thread runs a part, the result is the one the
    caller alone gives bit for bit; against the whole weight, oneDNN may pick another kernel for a
    narrower part (its sums in another order): within one rounding of the output there. Steps on
    more torch threads keep the whole weight."""
    from pagedserve.worker import layers

    torch.manual_seed(count)
    lin = _onednn_layer(1000, 576, dtype)
    xs = [torch.randn(rows, 576, dtype=dtype) for rows in (1, 5, 16, 127, 256)]  # 256: a prefill chunk
    xs.append(torch.randn(3, 7, 576, dtype=dtype))
    whole = [lin(x) for x in xs]
    assert layers.split_onednn_weights(lin, count + 1) == 1
    parts = lin.packed_weight
    assert isinstance(parts, layers.OnednnParts) and len(parts.parts) == count + 1
    assert parts.starts[0] == 0 and parts.starts[-1] == 1000
    bounds = list(zip(parts.starts, parts.starts[1:]))
    assert all(b - a > 0 and a % layers.ONEDNN_PART_ALIGN == 0 for a, b in bounds)
    calls = []
    split = ext.linear_onednn_split
    monkeypatch.setattr(ext, "linear_onednn_split", lambda *args: calls.append(args[0].shape) or split(*args))
    alone = [lin(x) for x in xs]  # no helpers yet: the parts one after the other on the caller
    assert calls == [x.shape for x in xs]
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 1e-5
    for got, expected in zip(alone, whole):
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=ulp)
    helpers(count)
    for _ in range(10):  # many regions in a row: parts change hands between the threads
        for x, expected in zip(xs, alone):
            assert torch.equal(lin(x), expected), x.shape
    exact = xs[2].double() @ lin.weight.double().T + lin.bias.double()
    atol = 0.05 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(alone[2].double(), exact, atol=atol, rtol=0.02)
    calls.clear()
    torch.set_num_threads(2)
    for x, expected in zip(xs, whole):
        assert torch.equal(lin(x), expected), x.shape
    assert calls == []  # those took the whole weight


def test_split_onednn_weights_keeps_narrow_layers_whole_and_rejects_bad_inputs(helpers) -> None:
    from pagedserve.worker import layers

    narrow = _onednn_layer(layers.ONEDNN_PART_ALIGN, 64, torch.float32)
    wide = _onednn_layer(96, 64, torch.float32)
    model = torch.nn.ModuleList([narrow, wide, torch.nn.Linear(4, 4)])
    assert layers.split_onednn_weights(model, 2, max_bytes=96 * 64 * 4 - 1) == 0  # no room for a copy
    assert isinstance(wide.packed_weight, torch.Tensor)
    assert layers.split_onednn_weights(model, 2, max_bytes=96 * 64 * 4) == 1
    assert isinstance(narrow.packed_weight, torch.Tensor)  # one part would be all of it
    assert wide.packed_weight.starts == [0, 64, 96]
    helpers(1)
    parts = wide.packed_weight.parts
    with pytest.raises(RuntimeError, match="part 0 is not"):
        ext.linear_onednn_split(torch.randn(2, 65), parts, [0, 64, 96], None)  # K
    with pytest.raises(RuntimeError, match="part 0 is not"):
        ext.linear_onednn_split(torch.randn(2, 64, dtype=torch.float64), parts, [0, 64, 96], None)  # dtype
    with pytest.raises(RuntimeError, match="one start per part"):
        ext.linear_onednn_split(torch.randn(2, 64), parts, [0, 96], None)
    with pytest.raises(RuntimeError, match="bias"):
        ext.linear_onednn_split(torch.randn(2, 64), parts, [0, 64, 96], torch.randn(95))
    x = torch.randn(4, 64)
    assert torch.equal(ext.linear_onednn_split(x, parts, [0, 64, 96], wide.bias.detach()),
                       torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(
                           wide.weight.detach()), wide.bias.detach(), "none", [], ""))  # fmt: skip



@torch.inference_mode()
def test_prefill_kernels_on_the_pool_equal_one_thread(helpers, one_thread) -> None:
    """A step on one torch thread with helpers (PAGEDSERVE_CPU_PREFILL_POOL=1) runs the elementwise
    kernels and the prefill attention in units over the pool: results equal the caller alone's bit
    for bit, over many regions in a row (units change hands between the threads)."""
    torch.manual_seed(0)
    dtype = torch.bfloat16
    rows, head_dim, heads, kv_heads = 200, 64, 9, 3
    x = torch.randn(rows, 3072, dtype=dtype)
    hidden, residual = (torch.randn(rows, 576, dtype=dtype) for _ in range(2))
    weight = torch.randn(576, dtype=dtype)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.outer(torch.arange(1024).float(), inv_freq)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1).contiguous()
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    positions = torch.arange(100, 100 + rows)
    k_cache, v_cache = (torch.randn(40, 16, kv_heads, head_dim, dtype=dtype) for _ in range(2))
    table = torch.randperm(40)[:19].int()

    def run() -> list[torch.Tensor]:
        h, r, q = hidden.clone(), residual.clone(), qkv.clone()
        ext.fused_add_rms_norm(h, r, weight, 1e-5)
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        ext.rotary_neox(positions, q[:, :q_size], q[:, q_size : q_size + kv_size], cos_sin, head_dim)
        out = [ext.silu_and_mul(x), ext.rms_norm(hidden, weight, 1e-5), h, r, q]
        if ext.prefill_bf16_available():
            query = q[:, : heads * head_dim].view(rows, heads, head_dim)
            out.append(ext.paged_prefill(query, k_cache, v_cache, table, 300, 0.125, 0, True))
        return out

    alone = run()
    helpers(1)
    for _ in range(10):
        for got, expected in zip(run(), alone, strict=True):
            assert torch.equal(got, expected)
