"""The AVX2 fp32 linear kernel (cpu_gemm.cpp) against the same product in float64 (the oracle), on
the shapes that cross its blockings: rows 1..6 (partial tiles), tiles of equal rows (16 as 6 + 5 +
5) and not (8 as 6 + 2), the last row count of the decode path (96) and past it, K in passes (600:
3 of 200 up to 96 rows, 512 + 88 past), N not a multiple of 16 (a partial panel); and the layers
that take it."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedserve.kernels import cpu
from pagedserve.worker import layers

ext = cpu.extension()
pytestmark = pytest.mark.skipif(ext is None or not ext.gemm_available(),
                                reason="the C++ CPU kernel could not be built with AVX2")  # fmt: skip


def _oracle(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().t()
    return (y + b.double() if b is not None else y).float()


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 8, 16, 96, 97, 200])
@pytest.mark.parametrize(("n", "k"), [(64, 48), (100, 70), (33, 600), (960, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_packed_equals_the_product(rows, n, k, bias) -> None:
    torch.manual_seed(rows * 1000 + n + k)
    x, w = torch.randn(rows, k), torch.randn(n, k)
    b = torch.randn(n) if bias else None
    packed = ext.pack_linear(w)
    assert tuple(packed.shape) == (-(-n // 16), k, 16)
    got = ext.linear_packed(x, packed, b, n)
    # fp32 sums of k products: the error grows like sqrt(k) ulps of the largest partial sum
    torch.testing.assert_close(got, _oracle(x, w, b), atol=2e-5 * k**0.5, rtol=1e-5)


def test_linear_packed_keeps_leading_dims_and_reads_strided_rows() -> None:
    torch.manual_seed(0)
    w = torch.randn(40, 32)
    wide = torch.randn(3, 5, 50)
    x = wide[..., 10:42]  # not contiguous: a slice of a larger projection's output
    got = ext.linear_packed(x, ext.pack_linear(w), None, 40)
    assert got.shape == (3, 5, 40)
    torch.testing.assert_close(got, _oracle(x.reshape(-1, 32), w, None).view(3, 5, 40), atol=1e-4, rtol=1e-5)


def test_linear_packed_rejects_what_it_cannot_run() -> None:
    packed = ext.pack_linear(torch.randn(32, 16))
    with pytest.raises(RuntimeError, match="features"):
        ext.linear_packed(torch.randn(2, 17), packed, None, 32)
    with pytest.raises(RuntimeError, match="N does not match"):
        ext.linear_packed(torch.randn(2, 16), packed, None, 48)
    with pytest.raises(RuntimeError, match="fp32"):
        ext.linear_packed(torch.randn(2, 16).bfloat16(), packed, None, 32)
    with pytest.raises(RuntimeError, match="fp32"):
        ext.pack_linear(torch.randn(32, 16).half())


bf16_kernel = pytest.mark.skipif(not ext.gemm_bf16_available(), reason="the CPU has no AVX512-BF16")


def _bf16_oracle(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The exact product of the bf16 values (float64), the bias added, rounded once to bf16."""
    return _oracle(x, w, b).bfloat16()


@bf16_kernel
@pytest.mark.parametrize("rows", [1, 2, 11, 12, 13, 16, 25, 64])
@pytest.mark.parametrize(("n", "k"), [(64, 48), (100, 71), (33, 600), (960, 576), (17, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linear_packed_equals_the_rounded_product(rows, n, k, bias) -> None:
    torch.manual_seed(rows * 1000 + n + k)
    x, w = torch.randn(rows, k).bfloat16(), torch.randn(n, k).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    packed = ext.pack_linear(w)
    assert tuple(packed.shape) == (-(-n // 32), -(-k // 2), 32, 2) and packed.dtype == torch.bfloat16
    got = ext.linear_packed(x, packed, b, n)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    expected = _bf16_oracle(x, w, b)
    # fp32 sums, rounded once: within one bf16 rounding of the exact value (a tie may round either way)
    exact = _oracle(x, w, b)
    assert ((got.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-4 * k**0.5).all()
    assert (got == expected).float().mean() > 0.97  # almost all bit-equal to the rounded exact product


@bf16_kernel
def test_bf16_linear_packed_keeps_leading_dims_reads_strided_rows_and_rejects_fp32_x() -> None:
    torch.manual_seed(0)
    w = torch.randn(40, 32).bfloat16()
    x = torch.randn(3, 5, 50).bfloat16()[..., 10:42]
    packed = ext.pack_linear(w)
    got = ext.linear_packed(x, packed, None, 40)
    assert got.shape == (3, 5, 40)
    exact = _oracle(x.reshape(-1, 32), w, None).view(3, 5, 40)
    assert ((got.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-4).all()
    with pytest.raises(RuntimeError, match="bf16 x"):
        ext.linear_packed(x.float(), packed, None, 40)
    with pytest.raises(RuntimeError, match="features"):
        ext.linear_packed(torch.randn(2, 36).bfloat16(), packed, None, 40)


@pytest.fixture
def gemm_on(monkeypatch):
    """The kernel on for layers (the default only on CPUs without AVX-512); the cached choice reset after."""
    monkeypatch.setenv("PAGEDSERVE_CPU_GEMM", "1")  # for the dtypes whose kernel was built
    cpu.gemm_enabled.cache_clear()
    yield
    cpu.gemm_enabled.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=bf16_kernel)])
def test_layers_take_the_kernel_up_to_its_row_limit_and_match_product(monkeypatch, gemm_on, dtype) -> None:
    torch.manual_seed(1)
    lin = layers.ColumnParallelLinear(64, 80, bias=True).to(dtype)
    lin.weight.data.copy_(torch.randn(80, 64))
    lin.bias.data.copy_(torch.randn(80))
    assert layers.prepack_linear_weights(lin) == 1
    assert lin.gemm_weight is not None and lin.gemm_weight.dtype == dtype
    # no oneDNN copy of the weight where the kernel takes every row count (it would never run)
    assert (lin.packed_weight is None) == (layers.GEMM_MAX_ROWS[dtype] == math.inf)
    calls = []
    real = ext.linear_packed
    monkeypatch.setattr(ext, "linear_packed", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    most = layers.GEMM_MAX_ROWS[dtype]
    sizes = (1, most, most + 1, 300) if most < 300 else (1, 16, 300)  # fp32 (AVX2): every size
    for m in sizes:
        x = torch.randn(m, 64).to(dtype)
        expected = _oracle(x, lin.weight, lin.bias)
        tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 2**-7}
        torch.testing.assert_close(lin(x).float(), expected, **tol)
    assert calls == [m for m in sizes if m <= most]


def _gguf_weight(n: int, k: int, kind: str, seed: int = 0) -> torch.Tensor:
    """A weight [n, k] quantized and dequantized by gguf-py (the oracle for the values: what a
    dequantized GGUF file holds), from normal values with some rows of one constant (span 0)."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    dense[::7] = 0.25  # constant blocks: Q4_1 d = 0, Q8_0 q = 127 everywhere
    kind_ = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}[kind]
    return torch.from_numpy(quants.dequantize(quants.quantize(dense, kind_), kind_).copy())


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize(("n", "k"), [(40, 64), (100, 96), (960, 576), (7, 1536)])
def test_gguf_blocks_keep_the_exact_weights_and_their_linear_equals_the_product(kind, n, k) -> None:
    w = _gguf_weight(n, k, kind)
    blocks = cpu.gguf_blocks(w)
    assert blocks is not None and blocks[2] == (kind == "q8_0")
    q, scales, q8 = blocks
    assert q.numel() == -(-n // 16) * 16 * k // (1 if q8 else 2)  # 4 or 8 bits a weight
    # x = I reads the dequantized weights back: bit for bit gguf-py's values
    assert torch.equal(ext.linear_blocks(torch.eye(k), q, scales, None, n, q8), w.t())
    torch.manual_seed(n + k)
    bias = torch.randn(n)
    for rows in (0, 1, 4, 5, 16, 96, 97, 200):  # decode passes, tile sizes, prefill row blocks
        x = torch.randn(rows, k)
        for b in (None, bias):
            got = ext.linear_blocks(x, q, scales, b, n, q8)
            torch.testing.assert_close(got, _oracle(x, w, b), atol=1e-4, rtol=1e-5)
    got = ext.linear_blocks(torch.randn(2, 3, k), q, scales, None, n, q8)
    assert got.shape == (2, 3, n)
    # a row's result does not depend on the rows beside it (1-3 rows dequantize in registers,
    # more through a buffer, prefill in row blocks): batch-invariant, bit for bit
    x = torch.randn(200, k)
    whole = ext.linear_blocks(x, q, scales, bias, n, q8)
    for rows in (1, 2, 3, 4, 16, 97):
        assert torch.equal(ext.linear_blocks(x[:rows], q, scales, bias, n, q8), whole[:rows])


def test_gguf_blocks_refuse_weights_that_are_not_exact_block_values() -> None:
    torch.manual_seed(0)
    assert cpu.gguf_blocks(torch.randn(64, 64)) is None  # a dense checkpoint
    assert cpu.gguf_blocks(torch.randn(64, 64).bfloat16().float()) is None  # bf16 values, not blocks
    w = _gguf_weight(64, 64, "q4_1")
    assert cpu.gguf_blocks(w[:, :48].contiguous()) is None  # K not a multiple of 32
    w[50, 40] = torch.nextafter(w[50, 40], torch.tensor(1.0))  # one value off its block's grid
    assert cpu.gguf_blocks(w) is None
    assert cpu.gguf_blocks(w.bfloat16()) is None  # the fp32 kernels only
    q, scales, q8 = cpu.gguf_blocks(_gguf_weight(64, 64, "q8_0"))
    with pytest.raises(RuntimeError, match="features"):
        ext.linear_blocks(torch.randn(2, 96), q, scales, None, 64, q8)
    with pytest.raises(RuntimeError, match="block layout"):
        ext.linear_blocks(torch.randn(2, 64), q, scales, None, 64, not q8)


def test_layers_keep_gguf_weights_in_blocks_for_every_row_count(monkeypatch, gemm_on) -> None:
    lin = layers.RowParallelLinear(576, 40, bias=True)
    lin.weight.data.copy_(_gguf_weight(40, 576, "q4_1"))
    lin.bias.data.copy_(torch.randn(40))
    assert layers.prepack_linear_weights(lin) == 1
    assert isinstance(lin.gemm_weight, tuple) and lin.packed_weight is None  # no dense copy
    calls = []
    real = ext.linear_blocks
    monkeypatch.setattr(ext, "linear_blocks", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for m in (1, 16, 300):
        x = torch.randn(m, 576)
        torch.testing.assert_close(lin(x), _oracle(x, lin.weight, lin.bias), atol=1e-4, rtol=1e-5)
    assert calls == [1, 16, 300]
    # switched off: the dense panels
    assert layers.prepack_linear_weights(lin, gguf_blocks=False) == 1
    assert isinstance(lin.gemm_weight, torch.Tensor)


blocks_bf16_kernel = pytest.mark.skipif(not ext.blocks_bf16_available(), reason="the CPU has no AVX512-BF16")
# the AVX512-BF16 loop everywhere it was built; AMX tiles where the CPU has them
BLOCK_PATHS = [False] + [pytest.param(True, marks=pytest.mark.skipif(
    not ext.blocks_amx_available(), reason="the CPU has no AMX-BF16 (or the OS did not grant its tiles)"))]


@blocks_bf16_kernel
@pytest.mark.parametrize("amx", BLOCK_PATHS, ids=["avx512", "amx"])
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize(("n", "k"), [(40, 64), (100, 96), (960, 576), (7, 1536)])
def test_bf16_gguf_blocks_linear_is_the_exact_weights_product_rounded_once(kind, n, k, amx) -> None:
    """cpu_blocks_bf16.cpp: bf16 x times the exact block values (gguf-py's, as fp32 holds them, not
    their bf16 roundings), summed in fp32, the bias added, rounded once to bf16; by the AVX512-BF16
    loop and by AMX tiles."""
    w = _gguf_weight(n, k, kind, seed=n + k)
    found = cpu.gguf_blocks_bf16(w)
    assert found is not None and found[1] == (kind == "q8_0")
    records, q8 = found
    assert tuple(records.shape) == (-(-n // 16), k // 32, 544 if q8 else 320)  # 8.5 or 5 bits a weight
    # x = I reads each weight back alone: gguf-py's fp32 value rounded to bf16, bit for bit
    eye = torch.eye(k).bfloat16()
    assert torch.equal(ext.linear_blocks_bf16(eye, records, None, n, q8, amx), w.t().bfloat16())
    torch.manual_seed(n + k)
    bias = torch.randn(n)
    for rows in (0, 1, 2, 3, 4, 5, 9, 16, 17, 40):  # the loop's row groups of 4, AMX's passes of 16
        x = torch.randn(rows, k).bfloat16()
        for b in (None, bias):
            got = ext.linear_blocks_bf16(x, records, b, n, q8, amx)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
            exact = _oracle(x, w, b).double()
            # one bf16 rounding of the exact value, plus fp32 sums' error (~k ulps of |x||w|)
            slack = 1e-6 * k * (x.double().abs() @ w.double().abs().t())
            assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + slack).all()
            if rows:
                assert (got == exact.bfloat16()).float().mean() > 0.97
    # leading dims kept; a row's result does not depend on the rows beside it, bit for bit
    x = torch.randn(36, k).bfloat16()
    whole = ext.linear_blocks_bf16(x, records, bias, n, q8, amx)
    for rows in (1, 2, 3, 4, 5, 15, 16, 17, 33):
        assert torch.equal(ext.linear_blocks_bf16(x[:rows], records, bias, n, q8, amx), whole[:rows])
    got = ext.linear_blocks_bf16(x.view(6, 6, k), records, bias, n, q8, amx)
    assert torch.equal(got, whole.view(6, 6, n))


@blocks_bf16_kernel
def test_bf16_gguf_blocks_reject_what_they_cannot_run() -> None:
    records, q8 = cpu.gguf_blocks_bf16(_gguf_weight(64, 64, "q4_1"))
    assert cpu.gguf_blocks_bf16(torch.randn(64, 64)) is None  # not block values
    with pytest.raises(RuntimeError, match="bf16 x"):
        ext.linear_blocks_bf16(torch.randn(2, 64), records, None, 64, q8, True)
    with pytest.raises(RuntimeError, match="features"):
        ext.linear_blocks_bf16(torch.randn(2, 96).bfloat16(), records, None, 64, q8, True)
    with pytest.raises(RuntimeError, match="block layout"):
        ext.linear_blocks_bf16(torch.randn(2, 64).bfloat16(), records, None, 64, not q8, True)
    with pytest.raises(RuntimeError, match="N does not match"):
        ext.linear_blocks_bf16(torch.randn(2, 64).bfloat16(), records, None, 80, q8, True)


@blocks_bf16_kernel
@pytest.mark.parametrize("amx", BLOCK_PATHS, ids=["avx512", "amx"])
def test_bf16_layers_take_gguf_blocks_from_the_fp32_twin_up_to_their_row_limit(monkeypatch, amx) -> None:
    """A bf16 layer whose fp32 twin holds exact GGUF block values (the worker loads that twin)
    keeps the blocks beside oneDNN's dense copy: steps of up to BF16_BLOCKS_MAX_ROWS rows (AMX
    tiles: BF16_BLOCKS_AMX_MAX_ROWS) take the blocks (the exact weights), larger ones oneDNN (the
    bf16 weights)."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bf16 here")
    monkeypatch.setenv("PAGEDSERVE_CPU_GEMM", "0")  # as on a CPU with AMX: no dense bf16 panels
    monkeypatch.setattr(cpu, "BLOCKS_AMX", amx)  # PAGEDSERVE_CPU_BLOCKS_AMX
    cpu.gemm_enabled.cache_clear()
    try:
        exact = layers.RowParallelLinear(576, 40, bias=True)
        exact.weight.data.copy_(_gguf_weight(40, 576, "q4_1"))
        exact.bias.data.copy_(torch.randn(40))
        lin = layers.RowParallelLinear(576, 40, bias=True).bfloat16()
        lin.load_state_dict(exact.state_dict())
        assert layers.prepack_linear_weights(lin, exact=exact) == 1
        assert isinstance(lin.gemm_weight, layers.Bf16Blocks) and lin.packed_weight is not None
        assert lin.gemm_weight.amx == amx
        calls = []
        real = ext.linear_blocks_bf16
        spy = lambda *a: calls.append((a[0].shape[0], a[5])) or real(*a)  # noqa: E731
        monkeypatch.setattr(ext, "linear_blocks_bf16", spy)
        most = layers.BF16_BLOCKS_AMX_MAX_ROWS if amx else layers.BF16_BLOCKS_MAX_ROWS
        for m in (1, most, most + 1, 200):
            x = torch.randn(m, 576).bfloat16()
            weights = exact.weight if m <= most else lin.weight  # exact block values, or bf16 ones
            expected = _oracle(x, weights, lin.bias).double()
            got = lin(x).double()
            assert ((got - expected).abs() <= expected.abs() * 2**-7 + 1e-2).all()
        assert calls == [(1, amx), (most, amx)]
        # switched off (PAGEDSERVE_CPU_GGUF_BLOCKS=0), or no fp32 twin: oneDNN alone
        lin.gemm_weight = None
        assert layers.prepack_linear_weights(lin, gguf_blocks=False, exact=exact) == 1
        assert lin.gemm_weight is None
        assert layers.prepack_linear_weights(lin) == 1 and lin.gemm_weight is None
    finally:
        cpu.gemm_enabled.cache_clear()


@pytest.mark.skipif("avx512f" not in cpu._cpu_id().split() or "PAGEDSERVE_CPU_MARCH" in os.environ,
                    reason="this CPU runs the AVX2 paths in the tests themselves")  # fmt: skip
def test_the_avx2_build_passes_the_kernel_tests_on_an_avx512_cpu() -> None:
    """CI draws machines with and without AVX-512: here the kernels are also built for AVX2 only
    (-march=haswell: this kernel, the AVX2 fp32 decode attention and exp) and the kernel tests run on it."""
    env = {**os.environ, "PAGEDSERVE_CPU_MARCH": "haswell"}
    here = Path(__file__)
    tests = [str(here.with_name(name)) for name in ("test_cpu_gemm.py", "test_cpu.py", "test_cpu_ops.py")]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                          env=env, capture_output=True, text=True, timeout=1200)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", proc.stdout.splitlines()[-1])
    assert passed and int(passed.group(1)) >= 150, proc.stdout[-2000:]  # not skipped for want of a build
