"""KV cache groups: which layers share a block table (the hybrid KV cache layout).

A model whose layers all attend the same way keeps one group of every layer: one block table per
request, a block holds K/V of all layers (as before hybrid KV existed). A model that mixes
full-attention and sliding-window layers (Gemma 3: five sliding layers to one full) splits its
layers into groups of equal size, each of one attention type, as vLLM's hybrid KV cache manager
does. Each group has its own block table per request, and all groups draw blocks from one pool:
a block holds K/V of ``group_size`` layers, and layer ``j`` of every group stores into the same
pool tensor (its slot ``j``) at the block ids of its own group's table. A sliding-window group
keeps only the blocks that intersect the window; the others go back to the pool as the request
grows (their table entries become the null block, which nothing reads).

Both sides compute the grouping from the model's config with this one function: the scheduler's
BlockManager (windows per group) and each worker (layer -> group and pool slot).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

from transformers import PretrainedConfig


@dataclass(frozen=True, slots=True)
class KVGroup:
    """Layers that share one block table: their attention window (None: full attention)."""

    window: int | None
    layers: tuple[int, ...]


def layer_windows(config: PretrainedConfig) -> list[int | None]:
    """Each layer's attention window in tokens (None: full attention)."""
    from pagedserve.worker.models.gemma3 import layer_types_of
    from pagedserve.worker.models.llama import sliding_window_of

    if str(getattr(config, "model_type", "")).startswith("gemma3"):
        window = config.sliding_window
        return [window if t == "sliding_attention" else None for t in layer_types_of(config)]
    return [sliding_window_of(config, i) for i in range(config.num_hidden_layers)]


def kv_cache_groups(config: PretrainedConfig, hybrid: bool = True) -> list[KVGroup]:
    """The layers' KV groups: full-attention groups first, then sliding ones by window.

    Layers of one window are split, in layer order, into groups of ``gcd`` of the per-window layer
    counts, so every group has the same number of layers (one pool block fits any group).
    With one attention type, one group holds every layer (with the layers' common window).
    Without ``hybrid``, one group of every layer keeps every block (window None), as a plain paged
    pool does.
    """
    windows = layer_windows(config)
    kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))
    if not hybrid:
        return [KVGroup(None, tuple(range(len(windows))))]
    if len(kinds) == 1:
        return [KVGroup(kinds[0], tuple(range(len(windows))))]
    by_kind = {w: [i for i, x in enumerate(windows) if x == w] for w in kinds}
    size = 0
    for layers in by_kind.values():
        size = gcd(size, len(layers))
    return [KVGroup(w, tuple(layers[i : i + size]))
            for w, layers in by_kind.items() for i in range(0, len(layers), size)]  # fmt: skip


def layer_slots(groups: list[KVGroup], num_layers: int) -> tuple[list[int], list[int]]:
    """(group of each layer, pool slot of each layer): layer j of a group stores into slot j."""
    group_of, slot_of = [0] * num_layers, [0] * num_layers
    for g, group in enumerate(groups):
        for j, layer in enumerate(group.layers):
            group_of[layer], slot_of[layer] = g, j
    return group_of, slot_of
