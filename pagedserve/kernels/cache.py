"""Triton KV cache ops: slot writes and copy-on-write block copies. Contracts are reference.py's.

Swaps cross devices, so they are DMA through torch copies, not kernels: swap_blocks is the
reference's, re-exported so this module offers the full set of cache ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pagedserve.kernels.reference import swap_blocks

__all__ = ["write_kv", "copy_blocks", "swap_blocks"]

# elements one copy program moves; a 16x8x128 block (16 K rows of 8 heads) is 16384
_COPY_CHUNK = 4096


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr,
                     HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """One program per token: its [num_kv_heads, head_dim] K and V rows go to its slot."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(k_cache_ptr + block * stride_kcb + offset * stride_kcs + heads * stride_kch + dims,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads * stride_vch + dims,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Store each token's K and V at its slot (negative slot: skip), in place; see reference.write_kv."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1 or value.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("write_kv needs head_dim contiguous in key, value and both caches")
    if triton.knobs.runtime.interpret and key.dtype != k_cache.dtype:
        # the interpreter rounds fp32 -> bf16 toward zero (GPUs round to nearest even): let torch cast
        key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEADS_PAD=triton.next_power_of_2(num_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1],
    )


@triton.jit
def _copy_blocks_kernel(cache_ptrs, block_mapping_ptr, block_numel,
                        DTYPE: tl.constexpr, CHUNK: tl.constexpr):
    """Program (cache, pair, chunk) copies CHUNK elements of block src to block dst of one cache."""
    cache = tl.program_id(0)
    pair = tl.program_id(1)
    chunk = tl.program_id(2)
    base = tl.load(cache_ptrs + cache).to(tl.pointer_type(DTYPE))
    src = tl.load(block_mapping_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(block_mapping_ptr + 2 * pair + 1).to(tl.int64)
    idx = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = idx < block_numel
    data = tl.load(base + src * block_numel + idx, mask=mask)
    tl.store(base + dst * block_numel + idx, data, mask=mask)


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def copy_blocks(k_caches: list[Tensor], v_caches: list[Tensor], block_mapping: Tensor) -> None:
    """Copy block src to dst in every layer's K and V pool, one launch for all layers; in place.

    Every pool must be contiguous, with one dtype and block shape. Destinations must not also be
    sources in the same call (programs run in any order).
    """
    caches = [*k_caches, *v_caches]
    if not caches or block_mapping.numel() == 0:
        return
    first = caches[0]
    for cache in caches:
        if not cache.is_contiguous() or cache.dtype != first.dtype or cache.shape[1:] != first.shape[1:]:
            raise ValueError("copy_blocks needs contiguous pools of one dtype and block shape")
    block_numel = first[0].numel()
    # the kernel reaches every pool through its address: one launch however many layers
    ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64).to(first.device, non_blocking=True)
    mapping = block_mapping.to(device=first.device, dtype=torch.int64).contiguous()
    grid = (len(caches), mapping.shape[0], triton.cdiv(block_numel, _COPY_CHUNK))
    _copy_blocks_kernel[grid](ptrs, mapping, block_numel, DTYPE=_TL_DTYPES[first.dtype], CHUNK=_COPY_CHUNK)
