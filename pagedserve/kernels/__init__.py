"""Paged attention and KV cache ops, dispatched by device.

CUDA tensors run the Triton kernels (attention.py, cache.py); CPU tensors run the CPU path
(cpu.py: decode attention in C++, the rest the plain-torch reference), and the reference
(reference.py) is every path's oracle. All share one signature per op, so any caller or test can
swap them. The backend can be forced: ``PAGEDSERVE_KERNELS=triton`` (or ``cpu``, ``torch``) in
the environment, read when this package is imported (a process's start; ENV_BACKEND), or the
``use_backend("triton")`` context manager, which wins over the environment.
Forcing Triton on CPU tensors needs Triton's interpreter (``TRITON_INTERPRET=1`` before import).
Triton is imported only when a Triton path is taken, so this package imports without it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import torch
from torch import Tensor

from pagedserve.kernels import reference

__all__ = ["write_kv", "paged_attention", "copy_blocks", "swap_blocks", "fused_ops", "use_backend",
           "BACKENDS"]

BACKENDS = ("auto", "triton", "cpu", "torch")
_forced: str | None = None
# Read once: a decode step dispatches ~200 ops, and os.environ's lookups cost ~1 ms of a 21 ms step
# of SmolLM2 at batch 1 (py-spy, 2-vCPU Xeon VM, 2026-12-06). Tests set these attributes.
ENV_BACKEND = os.environ.get("PAGEDSERVE_KERNELS", "auto")


@contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Within the block, run every op on `name` ("auto", "triton", "cpu" or "torch") whatever the device."""
    global _forced
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; expected one of {BACKENDS}")
    previous, _forced = _forced, name
    try:
        yield
    finally:
        _forced = previous


def _backend(t: Tensor) -> str:
    name = _forced or ENV_BACKEND
    if name not in BACKENDS:
        raise ValueError(f"PAGEDSERVE_KERNELS={name!r}; expected one of {BACKENDS}")
    if name == "auto":
        return "triton" if t.is_cuda else "cpu"
    return name


def _module(t: Tensor, family: str) -> ModuleType:
    """The module implementing an op family ("attention" or "cache") for t's backend: Triton's
    attention.py or cache.py, the CPU path (both families) or the reference (both families)."""
    backend = _backend(t)
    if backend == "triton":
        from pagedserve.kernels import attention, cache

        return attention if family == "attention" else cache
    if backend == "cpu":
        from pagedserve.kernels import cpu

        return cpu
    return reference


def _attention_module(t: Tensor) -> ModuleType:
    return _module(t, "attention")


def _cache_module(t: Tensor) -> ModuleType:
    return _module(t, "cache")


def write_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Store K/V [num_tokens, num_kv_heads, head_dim] at their slots (negative slot: skip). In place.
    See reference.write_kv for the full contract."""
    _cache_module(k_cache).write_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> Tensor:
    """Causal attention of ragged queries over paged KV; see reference.paged_attention for the contract."""
    return _attention_module(query).paged_attention(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=scale,
        sliding_window=sliding_window, max_query_len=max_query_len, max_seq_len=max_seq_len,
    )


def copy_blocks(k_caches: list[Tensor], v_caches: list[Tensor], block_mapping: Tensor) -> None:
    """Copy block src to dst in every layer's K and V pool for each (src, dst) row. In place."""
    if not k_caches:
        return
    _cache_module(k_caches[0]).copy_blocks(k_caches, v_caches, block_mapping)


def swap_blocks(src: Tensor, dst: Tensor, block_mapping: Tensor) -> None:
    """dst[d] = src[s] for each (s, d) row; src and dst may sit on different devices. In place."""
    # a swap crosses devices: it is DMA through torch copies on every backend, not a kernel
    reference.swap_blocks(src, dst, block_mapping)


_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FUSED = os.environ.get("PAGEDSERVE_CPU_FUSED", "1") != "0"  # read once, as ENV_BACKEND


def argmax_rows(t: Tensor) -> Tensor:
    """torch.argmax(t, dim=-1) of logits [rows, vocab]; fp32 rows on the CPU backend take
    cpu_ops.cpp's argmax_rows (same indices: the first maximum, the first NaN), ~15x faster than
    torch's CPU argmax (a greedy batch of 16 over 49152 tokens: 1.8 ms of a ~35 ms step)."""
    ops = fused_ops(t) if t.dim() == 2 and t.dtype == torch.float32 and t.stride(-1) == 1 else None
    if ops is not None and t.shape[-1]:
        return ops.argmax_rows(t)
    return t.argmax(dim=-1)


def sample_rows(logits: Tensor, temperature: Tensor | None, uniforms: Tensor) -> Tensor | None:
    """Each row's token drawn from softmax(logits / temperature) at its uniform (the inverse CDF,
    as sampling.sample_inverse_cdf draws it from the same uniforms) by cpu_ops.cpp's sample_rows:
    fp32 logits [rows, vocab] with contiguous rows on the CPU backend, left unmodified. None where
    the extension does not apply (the caller runs the torch code) or a row's max is not finite.
    16 rows of 49152 tokens on one thread: 0.6 ms against 1.9 ms for the torch code."""
    t = logits
    ops = fused_ops(t) if t.dim() == 2 and t.dtype == torch.float32 and t.stride(-1) == 1 else None
    if ops is None or not t.shape[-1]:
        return None
    temps = torch.empty(0) if temperature is None else temperature.float().contiguous()
    tokens = ops.sample_rows(t, temps, uniforms.float().contiguous())
    return None if bool((tokens < 0).any()) else tokens


def fused_ops(t: Tensor) -> ModuleType | None:
    """The CPU extension's fused elementwise ops of a decoder layer (rms_norm, fused_add_rms_norm,
    rotary_neox, silu_and_mul; cpu_ops.cpp) where t runs the CPU backend and the extension is
    built, else None: layers.py then runs its torch code, which is their reference.
    ``PAGEDSERVE_CPU_FUSED=0`` at start (FUSED) turns them off (to measure them)."""
    if not FUSED or t.device.type != "cpu" or t.dtype not in _FUSED_DTYPES or _backend(t) != "cpu":
        return None
    from pagedserve.kernels import cpu

    return cpu.extension()
