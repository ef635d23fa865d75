"""KVPool: layout, sizing, copy-on-write and swapping against plain tensor indexing."""

from __future__ import annotations

import pynvml
import pytest
import torch
from transformers import LlamaConfig

from pagedserve.worker import kv_pool
from pagedserve.worker.kv_pool import (
    KVPool,
    bytes_per_block,
    gpu_free_memory,
    host_memory,
    num_blocks_for_memory,
    num_kv_heads_per_rank,
)


def _filled_pool(num_host_blocks: int = 4) -> KVPool:
    pool = KVPool(num_layers=3, num_blocks=10, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                  num_host_blocks=num_host_blocks)
    g = torch.Generator().manual_seed(0)
    for cache in (*pool.k_caches, *pool.v_caches):
        cache.copy_(torch.randn(cache.shape, generator=g))
    return pool


def _snapshot(pool: KVPool) -> list[torch.Tensor]:
    return [c.clone() for c in (*pool.k_caches, *pool.v_caches)]


def test_layout_is_preallocated_zeros() -> None:
    pool = KVPool(num_layers=2, num_blocks=5, block_size=8, num_kv_heads=3, head_dim=16, dtype=torch.bfloat16,
                  num_host_blocks=2)
    assert len(pool.kv_caches) == 2
    for k, v in pool.kv_caches:
        assert k.shape == v.shape == (5, 8, 3, 16) and k.dtype == torch.bfloat16
        assert k.is_contiguous() and not k.any() and not v.any()
    assert pool.host_k_caches[0].shape == (2, 8, 3, 16)
    assert pool.kv_caches[1][0].data_ptr() == pool.kv_caches[1][0].data_ptr()  # stable tensors


def test_for_model_shards_kv_heads() -> None:
    config = LlamaConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=8, num_key_value_heads=2)
    pool = KVPool.for_model(config, num_blocks=2, block_size=4, dtype=torch.float32)
    assert pool.k_caches[0].shape == (2, 4, 2, 8) and len(pool.kv_caches) == 3
    sharded = KVPool.for_model(config, num_blocks=2, block_size=4, dtype=torch.float32, tp_size=2)
    assert sharded.num_kv_heads == 1
    assert [num_kv_heads_per_rank(2, tp) for tp in (1, 2, 4, 8)] == [2, 1, 1, 1]
    assert num_kv_heads_per_rank(8, 4) == 2


def test_sizing() -> None:
    # SmolLM2: 30 layers, 3 KV heads of 64, bf16, blocks of 16 tokens
    assert bytes_per_block(30, 16, 3, 64, torch.bfloat16) == 2 * 30 * 16 * 3 * 64 * 2
    per_block = bytes_per_block(30, 16, 3, 64, torch.bfloat16)
    assert num_blocks_for_memory(10 * per_block + per_block - 1, num_layers=30, block_size=16, num_kv_heads=3,
                                 head_dim=64, dtype=torch.bfloat16) == 10
    assert num_blocks_for_memory(-5, num_layers=30, block_size=16, num_kv_heads=3, head_dim=64,
                                 dtype=torch.bfloat16) == 0
    assert _filled_pool().bytes_per_block() == bytes_per_block(3, 4, 2, 8, torch.float32)


def test_copy_blocks_copies_every_layer() -> None:
    pool = _filled_pool()
    before = _snapshot(pool)
    pool.copy_blocks([(1, 7), (4, 2)])
    for old, new in zip(before, _snapshot(pool), strict=True):
        expected = old.clone()
        expected[7], expected[2] = old[1], old[4]
        torch.testing.assert_close(new, expected, atol=0, rtol=0)
    pool.copy_blocks(torch.empty(0, 2, dtype=torch.int64))


def test_swap_out_then_in_restores_blocks() -> None:
    pool = _filled_pool()
    before = _snapshot(pool)
    pool.swap_out(torch.tensor([[3, 0], [8, 2]]))
    for cache in (*pool.k_caches, *pool.v_caches):
        cache[3] = 0
        cache[8] = 0
    pool.swap_in([(2, 8), (0, 5)])  # host 2 (old block 8) back to 8, host 0 (old block 3) to 5
    for old, new in zip(before, _snapshot(pool), strict=True):
        torch.testing.assert_close(new[8], old[8], atol=0, rtol=0)
        torch.testing.assert_close(new[5], old[3], atol=0, rtol=0)
        assert not new[3].any()


def test_out_of_range_mapping_raises() -> None:
    pool = _filled_pool(num_host_blocks=2)
    with pytest.raises(IndexError):
        pool.copy_blocks([(0, 10)])
    with pytest.raises(IndexError):
        pool.swap_out([(0, 2)])
    with pytest.raises(IndexError):
        pool.swap_in([(-1, 0)])


def test_free_memory_falls_back_to_host_without_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_library() -> None:
        raise pynvml.NVMLError_LibraryNotFound()

    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    free, total = gpu_free_memory()
    host_free, host_total = host_memory()
    assert total == host_total and 0 < free <= total
    assert abs(free - host_free) < total // 10


def test_free_memory_maps_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    class Info:
        free, total = 3, 5

    seen = []
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: seen.append(i) or i)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", lambda handle: Info)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,2")
    assert kv_pool.gpu_free_memory(1) == (3, 5) and seen == [2]
