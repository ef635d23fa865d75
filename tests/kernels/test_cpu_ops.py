"""The fused CPU ops of a decoder layer (cpu_ops.cpp) against Hugging Face's Llama code (the
independent oracle) and layers.py's torch code (their reference); the KV write against
reference.write_kv."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from pagedserve import kernels
from pagedserve.kernels import cpu, reference
from pagedserve.worker.layers import RMSNorm, RotaryEmbedding, SiluAndMul

pytestmark = pytest.mark.skipif(cpu.extension() is None, reason="the C++ CPU kernel could not be built")

DTYPES = [torch.float32, torch.bfloat16]
ATOL = {torch.float32: 1e-5, torch.bfloat16: 0.0}


def _norms(hidden: int, dtype: torch.dtype) -> tuple[RMSNorm, LlamaRMSNorm]:
    ours, theirs = RMSNorm(hidden, 1e-5).to(dtype), LlamaRMSNorm(hidden, eps=1e-5).to(dtype)
    weight = torch.randn(hidden).to(dtype)
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    return ours, theirs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_rms_norm_matches_transformers(dtype, rows) -> None:
    torch.manual_seed(rows)
    ours, theirs = _norms(96, dtype)
    x = (torch.randn(rows, 96) * 3).to(dtype)
    assert kernels.fused_ops(x) is not None
    out = ours(x)
    torch.testing.assert_close(out, theirs(x), atol=ATOL[dtype], rtol=0)
    with kernels.use_backend("torch"):
        torch.testing.assert_close(out, ours(x), atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_updates_both_in_place(dtype) -> None:
    torch.manual_seed(0)
    ours, theirs = _norms(64, dtype)
    wide = torch.randn(19, 100).to(dtype)
    x = wide[:, :64]  # rows with a stride: the output of a projection's slice
    residual = torch.randn(19, 64).to(dtype)
    expected_residual = x + residual
    expected = theirs(expected_residual)
    out, new_residual = ours(x, residual)
    assert out.data_ptr() == x.data_ptr() and new_residual.data_ptr() == residual.data_ptr()
    assert torch.equal(new_residual, expected_residual)
    torch.testing.assert_close(out, expected, atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 64])
def test_rotary_matches_transformers_in_place_on_qkv_views(dtype, head_dim) -> None:
    torch.manual_seed(head_dim)
    q_heads, kv_heads, tokens = 6, 2, 23
    rope = RotaryEmbedding(head_dim, 512, 10000.0)
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim).to(dtype)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    v_before = v.clone()
    positions = torch.randint(0, 512, (tokens,))
    # Hugging Face: cos/sin of [half | half], rotate_half, in [B, H, T, D]
    cos, sin = rope.cos_sin_cache[positions].chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1)[None].to(dtype), torch.cat([sin, sin], -1)[None].to(dtype)
    hq = q.reshape(tokens, q_heads, head_dim).transpose(0, 1)[None]
    hk = k.reshape(tokens, kv_heads, head_dim).transpose(0, 1)[None]
    eq, ek = apply_rotary_pos_emb(hq, hk, cos, sin)
    eq = eq[0].transpose(0, 1).reshape(tokens, -1)
    ek = ek[0].transpose(0, 1).reshape(tokens, -1)
    with kernels.use_backend("torch"):
        rq, rk = rope(positions, q.clone(), k.clone())
    oq, ok = rope(positions, q, k)
    assert oq.data_ptr() == q.data_ptr() and ok.data_ptr() == k.data_ptr(), "rotated in place"
    assert torch.equal(v, v_before)
    for out, hf, ref in ((oq, eq, rq), (ok, ek, rk)):
        torch.testing.assert_close(out, hf, atol=ATOL[dtype] or 1e-6, rtol=0)
        torch.testing.assert_close(out, ref, atol=ATOL[dtype] or 1e-6, rtol=0)


def test_rotary_rejects_a_position_outside_the_cache() -> None:
    rope = RotaryEmbedding(16, 8, 10000.0)
    q, k = torch.randn(2, 32), torch.randn(2, 16)
    with pytest.raises(RuntimeError, match="outside the RoPE cache"):
        rope(torch.tensor([3, 8]), q, k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype) -> None:
    torch.manual_seed(1)
    x = (torch.randn(33, 2 * 80) * 4).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    out = SiluAndMul()(x)
    assert out.shape == (33, 80) and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-6)
    else:  # at most one bf16 ulp, on few elements (the vectorized exp)
        ulp = (expected.float().abs() * 2.0**-7).clamp_min(2.0**-126)
        assert ((out.float() - expected.float()).abs() <= ulp).all()
        assert (out != expected).float().mean() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_matches_reference_with_padding_and_strided_rows(dtype) -> None:
    torch.manual_seed(2)
    blocks, block_size, heads, dim = 6, 4, 2, 16
    kv = torch.randn(9, 3 * heads * dim).to(dtype)
    key = kv[:, : heads * dim].view(9, heads, dim)
    value = kv[:, heads * dim : 2 * heads * dim].view(9, heads, dim)
    slots = torch.tensor([0, 5, -1, 23, 7, 12, -1, 3, 18])
    caches = [torch.zeros(blocks, block_size, heads, dim, dtype=dtype) for _ in range(4)]
    cpu.write_kv(key, value, caches[0], caches[1], slots)
    reference.write_kv(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].abs().sum() > 0
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu.write_kv(key, value, caches[0], caches[1], torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 24]))


def test_fused_ops_follow_the_backend_and_the_switch(monkeypatch) -> None:
    x = torch.randn(2, 8)
    assert kernels.fused_ops(x) is not None
    assert kernels.fused_ops(x.to(torch.int64)) is None
    with kernels.use_backend("torch"):
        assert kernels.fused_ops(x) is None
    monkeypatch.setattr(kernels, "FUSED", False)  # PAGEDSERVE_CPU_FUSED=0 at import
    assert kernels.fused_ops(x) is None


def _inverse_cdf_reference(
    x: torch.Tensor, temperature: torch.Tensor | None, uniforms: torch.Tensor
) -> torch.Tensor:
    """The draw the sampler's torch code makes for temperature-only rows (divide in fp32, exp of
    the shifted row, cumsum, searchsorted) with the exp and the sums in float64: the torch code's
    fp32 CDF rounds by ~1e-7 of the running sum, a few thousandths of one token's mass at 49152
    tokens, and so parts from the exact draw now and then; the kernel's sums are in double."""
    y = x.clone()
    if temperature is not None:
        y.div_(temperature[:, None])
    probs = (y - y.amax(dim=-1, keepdim=True)).double().exp()
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    below = torch.nextafter(total, torch.zeros_like(total))
    target = torch.minimum(uniforms.double()[:, None] * total, below)
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


@pytest.mark.parametrize("helpers", [0, 1])
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 1000, 49152, 49155])
def test_sample_rows_equals_the_torch_inverse_cdf(vocab, helpers) -> None:
    """sample_rows against the sampler's torch code in float64 (divide, exp, cumsum, searchsorted)
    on the same uniforms: the same token, with and without temperatures, rows read with a stride, -inf entries
    (never drawn), uniforms at 0 and just below 1, on the decode pool's threads too."""
    gen = torch.Generator().manual_seed(vocab)
    assert cpu.set_decode_pool(helpers)
    try:
        for trial in range(12):
            x = (torch.randn(16, vocab + 5, generator=gen) * 3)[:, :vocab]
            if trial % 3 == 0 and vocab > 1:
                x[:, 1::3] = -float("inf")  # penalized / banned tokens
            temperature = torch.rand(16, generator=gen) * 2 + 0.05 if trial % 2 else None
            uniforms = torch.rand(16, generator=gen)
            uniforms[0], uniforms[1] = 0.0, 1.0 - 2**-24
            got = kernels.sample_rows(x, temperature, uniforms)
            assert got is not None and got.dtype == torch.int64
            # u = 0: the first token; u just below 1: any token of positive mass (the last one of
            # positive mass in exact arithmetic, where rounding decides); every other row the same
            assert got[0] == 0
            assert torch.equal(got[2:], _inverse_cdf_reference(x, temperature, uniforms)[2:])
            assert torch.isfinite(x[torch.arange(16), got]).all()
    finally:
        cpu.set_decode_pool(0)


def test_sample_rows_draws_the_softmax() -> None:
    """The draws' frequencies follow softmax(x / t) (the distribution itself, not the torch code):
    4000 rows of one 5-token row, a chi-square-sized tolerance on each token's share."""
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0, -float("inf")]]).repeat(4000, 1)
    t = torch.full((4000,), 0.8)
    got = kernels.sample_rows(x, t, torch.rand(4000, generator=torch.Generator().manual_seed(3)))
    share = torch.bincount(got, minlength=5).double() / 4000
    expected = torch.softmax(x[0].double() / 0.8, dim=-1)
    assert share[4] == 0
    assert torch.allclose(share, expected, atol=0.025), (share, expected)


def test_sample_rows_leaves_non_finite_rows_to_torch() -> None:
    """A row whose max is not finite (NaN, +inf, all -inf) is -1 from the kernel, and None from
    kernels.sample_rows (the sampler then runs its torch code); bf16 logits or the torch backend
    take the torch code too."""
    ext = cpu.extension()
    x = torch.randn(4, 40)
    x[1, 3] = float("nan")
    x[2] = -float("inf")
    x[3, 9] = float("inf")
    got = ext.sample_rows(x, torch.empty(0), torch.full((4,), 0.5))
    assert got[1:].tolist() == [-1, -1, -1] and 0 <= got[0] < 40
    assert kernels.sample_rows(x, None, torch.full((4,), 0.5)) is None
    assert kernels.sample_rows(x[:1].bfloat16(), None, torch.full((1,), 0.5)) is None
    with kernels.use_backend("torch"):
        assert kernels.sample_rows(x[:1], None, torch.full((1,), 0.5)) is None


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 49152, 49155])
def test_argmax_rows_equals_torch_argmax(vocab) -> None:
    """argmax_rows against torch.argmax (the oracle): random rows, ties (the first index wins),
    rows of -inf only, NaN (the first NaN wins, as torch takes NaN for the largest), +inf, rows
    read with a stride (a view of wider logits), every tail length past whole vectors."""
    torch.manual_seed(vocab)
    x = torch.randn(12, vocab + 3)[:, :vocab]  # rows strided
    assert x.stride(0) == vocab + 3
    x[1] = -float("inf")
    x[2, vocab // 2 :] = x[2].max() + 1  # a tie over the second half: its first index
    x[3, vocab - 1] = float("nan")
    x[4, vocab // 3] = float("nan")
    x[4, vocab - 1] = float("nan")
    x[5, vocab - 1] = float("inf")
    x[6] = 0.0  # all equal: index 0
    x[7] = torch.arange(vocab, dtype=torch.float32)  # the last
    x[8, 0] = 1e30  # the first
    got = kernels.argmax_rows(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, x.argmax(dim=-1))
    # bf16 logits, or the torch backend: torch's own argmax
    assert torch.equal(kernels.argmax_rows(x.bfloat16()), x.bfloat16().argmax(dim=-1))
    with kernels.use_backend("torch"):
        assert torch.equal(kernels.argmax_rows(x), x.argmax(dim=-1))
