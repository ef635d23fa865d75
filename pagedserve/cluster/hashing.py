"""The block hash chain shared by the engine's prefix cache and the request router.

A full block's hash is xxh3-64 over (parent block's hash, the block's token ids, extra keys).
The bytes hashed are fixed-width little-endian integers, so the same tokens give the same hash
in every process and on every machine: never Python's salted ``hash()``. The chain makes a
block's hash name its whole prefix, so equal hashes at the same position mean equal prefixes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import xxhash

# The first block's parent. A fixed value keeps hashes comparable across processes and restarts.
ROOT_HASH = 0x9E3779B97F4A7C15


def _extra_bytes(extra_keys: Sequence[Any]) -> bytes:
    return msgpack.packb(list(extra_keys)) if extra_keys else b""


def hash_block(parent: int, token_ids: Sequence[int], extra_keys: Sequence[Any] = ()) -> int:
    """The 64-bit hash of one full block given its parent's hash (ROOT_HASH for the first block)."""
    h = xxhash.xxh3_64(parent.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.uint32).tobytes())
    if extra_keys:
        h.update(_extra_bytes(extra_keys))
    return h.intdigest()


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[Any] = (),
    parent: int = ROOT_HASH,
    start_block: int = 0,
) -> list[int]:
    """Hashes of the full blocks of ``token_ids`` from ``start_block`` on, chained from ``parent``.

    Only full blocks are hashed: a partial last block has no hash. ``extra_keys`` (a cache salt,
    LoRA or multimodal ids) enter every block so that different keys never share a block.
    """
    tokens = np.asarray(token_ids, dtype=np.uint32)
    extra = _extra_bytes(extra_keys)
    out: list[int] = []
    for b in range(start_block, len(tokens) // block_size):
        h = xxhash.xxh3_64(parent.to_bytes(8, "little"))
        h.update(tokens[b * block_size : (b + 1) * block_size].tobytes())
        if extra:
            h.update(extra)
        parent = h.intdigest()
        out.append(parent)
    return out
