"""pagedserve.kernels picks the backend by device, can be forced, and imports without Triton."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import pagedserve.kernels as kernels
from pagedserve.kernels import attention, cache, cpu, reference
from tests.kernels.batches import DEVICE, contiguous_attention, make_batch, max_error


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records which implementation each op reached, still running it."""
    monkeypatch.setattr(kernels, "ENV_BACKEND", "auto")
    seen: list[str] = []
    for module, name in [(reference, "torch"), (cpu, "cpu"), (attention, "triton"), (cache, "triton")]:
        for op in ("paged_attention", "write_kv", "copy_blocks"):
            if hasattr(module, op):
                real = getattr(module, op)
                spy = lambda *a, _real=real, _name=name, **k: seen.append(_name) or _real(*a, **k)
                monkeypatch.setattr(module, op, spy)
    return seen


def _run_all_ops(calls: list[str]) -> None:
    batch = make_batch([(20, 1), (33, 5)], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    calls.clear()  # building the batch wrote KV through the reference
    out = kernels.paged_attention(*batch.args(), scale=0.125)
    assert max_error(out, contiguous_attention(batch, scale=0.125)) < 2e-5
    ones = torch.ones(1, 2, 64, device=DEVICE)
    kernels.write_kv(ones, ones, batch.k_cache, batch.v_cache, torch.tensor([5], device=DEVICE))
    assert torch.equal(batch.k_cache[0, 5], ones[0])
    kernels.copy_blocks([batch.k_cache], [batch.v_cache], torch.tensor([[0, 1]], device=DEVICE))
    assert torch.equal(batch.k_cache[1], batch.k_cache[0])


def test_auto_picks_by_device(calls: list[str]) -> None:
    _run_all_ops(calls)
    if DEVICE.type == "cuda":
        assert calls == ["triton"] * 3
    else:  # the CPU path: C++ decode (the reference where it could not be built), reference ops
        assert calls[0] == "cpu" and calls[1:] in (["cpu", "cpu"], ["torch", "cpu", "cpu"])


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_env_forces_backend(calls: list[str], monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    monkeypatch.setattr(kernels, "ENV_BACKEND", backend)  # PAGEDSERVE_KERNELS, read at import
    _run_all_ops(calls)
    assert calls == [backend] * 3


def test_env_backend_is_read_at_import() -> None:
    code = "import pagedserve.kernels as k; print(k.ENV_BACKEND, k.FUSED)"
    env = {**os.environ, "PAGEDSERVE_KERNELS": "torch", "PAGEDSERVE_CPU_FUSED": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["torch", "False"]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_use_backend_overrides_env(calls: list[str], monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    monkeypatch.setattr(kernels, "ENV_BACKEND", "torch" if backend == "triton" else "triton")
    with kernels.use_backend(backend):
        _run_all_ops(calls)
    assert calls == [backend] * 3
    with pytest.raises(ValueError):
        with kernels.use_backend("cuda"):
            pass


def test_unknown_env_backend_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "ENV_BACKEND", "tritonn")
    with pytest.raises(ValueError, match="PAGEDSERVE_KERNELS"):
        _run_all_ops([])


def test_imports_and_serves_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"  # any `import triton` now raises ImportError
        "import torch, pagedserve.kernels as k\n"
        "kc = torch.randn(2, 16, 1, 8); q = torch.randn(1, 1, 8)\n"
        "o = k.paged_attention(q, kc, kc, torch.tensor([[1]], dtype=torch.int32),\n"
        "    torch.tensor([3], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), scale=1.0)\n"
        "assert o.shape == (1, 1, 8) and 'pagedserve.kernels.attention' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={"PATH": "/usr/bin:/bin"})
