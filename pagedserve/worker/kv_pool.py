"""The physical KV cache of one tensor-parallel rank: its KV heads of every block of the pool.

Every rank holds the same block ids (the scheduler's BlockManager decides them); rank r's pool
stores only the KV heads its attention layers own. Per layer there is one K and one V tensor
[num_blocks, block_size, num_kv_heads_local, head_dim], preallocated once (fresh memory is slow,
and a stable address is what the kernels index). A host pool of the same block shape (pinned on
CUDA, for asynchronous DMA) receives swapped-out blocks.

With hybrid KV (kv_groups.py) a block holds the KV of one group's layers, not of every layer: the
pool has one K and one V tensor per layer slot of a group, and layer i uses slot
``layer_slots[i]`` at the block ids of its own group's table.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor
from transformers import PretrainedConfig

from pagedserve import kernels
from pagedserve.worker.models.llama import head_dim_of

BlockMapping = Tensor | Sequence[Sequence[int]]


def num_kv_heads_per_rank(total_num_kv_heads: int, tp_size: int) -> int:
    """KV heads one rank stores: split over ranks, or one replicated head when tp > num_kv_heads."""
    return max(1, total_num_kv_heads // tp_size)


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    """Bytes one block takes on this rank: K and V of every layer."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


def num_blocks_for_memory(memory_bytes: int, *, num_layers: int, block_size: int, num_kv_heads: int,
                          head_dim: int, dtype: torch.dtype) -> int:
    """How many whole blocks fit in memory_bytes (0 when none or the budget is negative)."""
    return max(0, memory_bytes // bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype))


def gpu_free_memory(device_index: int = 0) -> tuple[int, int]:
    """(free, total) bytes of the accelerator `device_index` as the process sees it, via NVML.

    The index is mapped through CUDA_VISIBLE_DEVICES to NVML's physical numbering. With no GPU or
    NVML library (pynvml.NVMLError), returns the host's (MemAvailable, MemTotal) instead, which is
    what a CPU pool draws from.
    """
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return host_memory()
    try:
        visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        physical = visible[device_index] if visible else str(device_index)
        if physical.isdigit():
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(physical))
        else:
            handle = pynvml.nvmlDeviceGetHandleByUUID(physical)
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return int(info.free), int(info.total)
    except pynvml.NVMLError:
        return host_memory()
    finally:
        pynvml.nvmlShutdown()


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory, from /proc/meminfo (sysconf elsewhere)."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        kib = {k: int(v.split()[0]) * 1024 for k, v in fields.items() if k in ("MemAvailable", "MemTotal")}
        return kib["MemAvailable"], kib["MemTotal"]
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


class KVPool:
    """This rank's K/V pools for every layer (slot), plus a host pool for swapped-out blocks.

    kv_caches[i] is layer i's (K, V) pair, the shape the model's forward takes. Block mappings are
    int64 [N, 2] tensors (or lists of pairs) of (source block, destination block). Without
    ``layer_slots`` each layer has its own slot; with them (hybrid KV) layer i stores into slot
    ``layer_slots[i]``, and a block holds the slots' KV (one KV group's layers).
    """

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 num_host_blocks: int = 0, layer_slots: Sequence[int] | None = None) -> None:
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.device = torch.device(device)
        self.num_host_blocks = num_host_blocks
        self.layer_slots = list(layer_slots) if layer_slots is not None else list(range(num_layers))
        assert len(self.layer_slots) == num_layers, "one slot per layer"
        num_slots = max(self.layer_slots) + 1
        self.num_slots = num_slots
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_slots)]
        self.v_caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_slots)]
        host_shape = (num_host_blocks, block_size, num_kv_heads, head_dim)
        # pinned host memory lets device<->host copies run as DMA; there is nothing to pin for on CPU
        pin = self.device.type == "cuda"
        self.host_k_caches = [torch.zeros(host_shape, dtype=dtype, pin_memory=pin) for _ in range(num_slots)]
        self.host_v_caches = [torch.zeros(host_shape, dtype=dtype, pin_memory=pin) for _ in range(num_slots)]

    @classmethod
    def for_model(cls, config: PretrainedConfig, *, num_blocks: int, block_size: int, dtype: torch.dtype,
                  device: torch.device | str = "cpu", tp_size: int = 1, num_host_blocks: int = 0,
                  layer_slots: Sequence[int] | None = None) -> KVPool:  # fmt: skip
        """A pool shaped for one rank of a model described by a Hugging Face config."""
        return cls(num_layers=config.num_hidden_layers, num_blocks=num_blocks, block_size=block_size,
                   num_kv_heads=num_kv_heads_per_rank(config.num_key_value_heads, tp_size),
                   head_dim=head_dim_of(config), dtype=dtype, device=device, num_host_blocks=num_host_blocks,
                   layer_slots=layer_slots)  # fmt: skip

    @property
    def kv_caches(self) -> list[tuple[Tensor, Tensor]]:
        """Per layer (K pool, V pool), each [num_blocks, block_size, num_kv_heads, head_dim]."""
        return [(self.k_caches[s], self.v_caches[s]) for s in self.layer_slots]

    def bytes_per_block(self) -> int:
        """Device bytes one block takes on this rank (all slots, K and V)."""
        return bytes_per_block(self.num_slots, self.block_size, self.num_kv_heads, self.head_dim, self.dtype)

    def copy_blocks(self, mapping: BlockMapping) -> None:
        """Copy-on-write: device block src -> device block dst in every layer, for each row."""
        mapping = _as_mapping(mapping, self.num_blocks, self.num_blocks)
        if len(mapping):
            kernels.copy_blocks(self.k_caches, self.v_caches, mapping.to(self.device))

    def swap_out(self, mapping: BlockMapping) -> None:
        """Copy device block -> host block in every layer, for each (device, host) row."""
        mapping = _as_mapping(mapping, self.num_blocks, self.num_host_blocks)
        if len(mapping):
            for src, dst in zip((*self.k_caches, *self.v_caches), (*self.host_k_caches, *self.host_v_caches),
                                strict=True):
                kernels.swap_blocks(src, dst, mapping)

    def swap_in(self, mapping: BlockMapping) -> None:
        """Copy host block -> device block in every layer, for each (host, device) row."""
        mapping = _as_mapping(mapping, self.num_host_blocks, self.num_blocks)
        if len(mapping):
            for src, dst in zip((*self.host_k_caches, *self.host_v_caches), (*self.k_caches, *self.v_caches),
                                strict=True):
                kernels.swap_blocks(src, dst, mapping)


def _as_mapping(mapping: BlockMapping, num_src: int, num_dst: int) -> Tensor:
    """An int64 [N, 2] CPU-or-device tensor of in-range (src, dst) block ids."""
    t = torch.as_tensor(mapping, dtype=torch.int64).reshape(-1, 2)
    if len(t) and t.device.type == "cpu":
        # an out-of-range id would be a scheduler bug; index_copy_ on CUDA would fault asynchronously
        if not (0 <= int(t[:, 0].min()) and int(t[:, 0].max()) < num_src
                and 0 <= int(t[:, 1].min()) and int(t[:, 1].max()) < num_dst):
            raise IndexError(f"block mapping {t.tolist()} out of range (src < {num_src}, dst < {num_dst})")
    return t
