"""The logical KV allocator: one pool of fixed-size blocks, block tables, prefix cache, CoW, swap.

This is the single source of truth for allocation (workers only execute what it decides).
Every physical block is in exactly one of three states:

- free: ref_count == 0, no content worth keeping, in the free queue (taken first);
- cached-free: ref_count == 0, holds a full block registered under its hash, in the free queue
  (revived by a prefix hit, or evicted least-recently-freed first when the pool needs it);
- referenced: ref_count == number of block tables holding it, not in the free queue.

Per-step work is proportional to the blocks that change, never to all blocks.

Hybrid KV (models that mix full-attention and sliding-window layers, see
``pagedserve/worker/kv_groups.py``): the layers form groups, each with its own block table per
request, all drawing from this one pool. Every group's table has the same length (one entry per
block of tokens); a sliding-window group's entries wholly before its window are the null block
(id 0, reserved, never read), their blocks given back as the request grows. The prefix cache is
per group (a block's hash names its tokens, the group which layers' KV it holds); KV events and
the router's hashes come from group 0 (full attention when the model has any). With one group
and no window (every model without sliding windows) all of this reduces to one plain table.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedserve.cluster.hashing import ROOT_HASH, hash_blocks
from pagedserve.plan import NULL_BLOCK, window_start_block

RequestId = Hashable


class RequestTooLong(ValueError):
    """The request needs more KV blocks than the whole pool holds: it can never run."""


class Block:
    """One physical KV block: its id, sharers, content hash and links in the free queue."""

    __slots__ = ("block_id", "ref_count", "block_hash", "group", "num_tokens", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None  # set only while registered in the prefix cache
        self.group = 0  # the KV group whose prefix cache holds it (while block_hash is set)
        self.num_tokens = 0  # slots holding live tokens
        self.prev: Block | None = None
        self.next: Block | None = None


class FreeBlockQueue:
    """Blocks with ref_count == 0 in eviction order: the front is taken first.

    Blocks without cached content go to the front, so they are used before any cached block is
    evicted; cached blocks go to the back when freed, so among them the front is the least
    recently freed (LRU). A finished request frees its chain tail first, so its tail is evicted
    before its head, which other requests are likelier to share. All operations are O(1).
    """

    def __init__(self) -> None:
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.size = 0
        self.num_cached = 0  # blocks in the queue that still hold a registered hash

    def __len__(self) -> int:
        return self.size

    def _link(self, block: Block, prev: Block, nxt: Block) -> None:
        block.prev, block.next = prev, nxt
        prev.next = block
        nxt.prev = block
        self.size += 1
        if block.block_hash is not None:
            self.num_cached += 1

    def append(self, block: Block) -> None:
        self._link(block, self._tail.prev, self._tail)

    def appendleft(self, block: Block) -> None:
        self._link(block, self._head, self._head.next)

    def remove(self, block: Block) -> None:
        assert block.prev is not None and block.next is not None, "block is not in the free queue"
        block.prev.next = block.next
        block.next.prev = block.prev
        block.prev = block.next = None
        self.size -= 1
        if block.block_hash is not None:
            self.num_cached -= 1

    def popleft(self) -> Block:
        block = self._head.next
        assert block is not self._tail, "free queue is empty"
        self.remove(block)
        return block

    def __iter__(self):
        node = self._head.next
        while node is not self._tail:
            yield node
            node = node.next


@dataclass(slots=True)
class PrefixHit:
    """The result of a prefix-cache lookup: the leading cached blocks and the prompt's block hashes.

    ``blocks`` is group 0's run; with several KV groups, ``group_blocks`` holds every group's
    (the same length; None where a sliding-window group needs no block: the null block).
    """

    blocks: list[Block]
    hashes: list[int]
    block_size: int
    group_blocks: list[list[Block | None]] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size

    def per_group(self, num_groups: int) -> list[list[Block | None]]:
        if self.group_blocks is not None:
            return self.group_blocks
        if num_groups == 1:
            return [list(self.blocks)]
        assert not self.blocks, "a hit over several KV groups needs group_blocks"
        return [[] for _ in range(num_groups)]

    @property
    def num_held(self) -> int:
        """Blocks the hit supplies over all groups (null entries not counted)."""
        if self.group_blocks is None:
            return len(self.blocks)
        return sum(b is not None for blocks in self.group_blocks for b in blocks)


@dataclass(slots=True)
class KVStats:
    """Pool figures at one instant; prefix counters are cumulative, in tokens."""

    num_blocks: int
    block_size: int
    free_blocks: int  # free + cached-free: what an allocation may take
    cached_blocks: int  # cached-free: evictable blocks that still hold content
    used_blocks: int  # referenced by at least one block table
    live_fraction: float  # of the slots in used blocks, the fraction holding live tokens
    prefix_queries: int
    prefix_hits: int
    host_free_blocks: int

    @property
    def usage(self) -> float:
        return self.used_blocks / self.num_blocks


NULL_HOST = -1  # NULL_BLOCK's entry in a swapped-out table


@dataclass(slots=True)
class _Seq:
    """The allocator's view of one request."""

    tables: list[list[int]]  # per KV group: block ids, logical order (all of one length)
    num_tokens: int = 0  # tokens with a slot
    hashes: list[int] = field(default_factory=list)  # hashes of its full blocks known so far
    num_registered: int = 0  # leading blocks already offered to the prefix cache
    extra_keys: tuple = ()
    host_tables: list[list[int]] | None = None  # per group, host block ids while swapped out
    slid: list[int] = field(default_factory=list)  # per group, leading entries already null


class BlockManager:
    """Allocates KV blocks to requests; shares them by reference count; caches full blocks by hash."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        num_host_blocks: int = 0,
        enable_prefix_caching: bool = True,
        group_windows: Sequence[int | None] = (None,),
        max_chunk_tokens: int | None = None,
    ) -> None:
        """``group_windows``: the attention window of each KV group (None: full attention), one
        entry per block table a request gets. ``max_chunk_tokens``: the most tokens one request
        computes in a step (the scheduler's token budget), which bounds what a sliding-window
        group holds at once."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        if not group_windows or any(w is not None and w <= 0 for w in group_windows):
            raise ValueError(f"group_windows must be positive windows or None, got {group_windows!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = list(group_windows)
        self.num_groups = len(self.windows)
        self.max_chunk_tokens = max_chunk_tokens
        # the null block: reserved when some group drops blocks out of its window
        self.num_reserved = int(any(w is not None for w in self.windows))
        self._null = NULL_BLOCK if self.num_reserved else -1  # the table entry naming no block
        if num_blocks <= self.num_reserved:
            raise ValueError("the pool needs a block besides the null block")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue()
        for block in self.blocks[self.num_reserved :]:
            self.free_queue.append(block)
        # per group: block hash -> block holding that content; group 0's feeds the KV events
        self.caches: list[dict[int, Block]] = [{} for _ in self.windows]
        self.cached = self.caches[0]
        self.seqs: dict[RequestId, _Seq] = {}
        self.num_host_blocks = num_host_blocks
        self.host_free: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self.host_ref_count = [0] * num_host_blocks  # swapped-out tables holding each host block
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._live_slots = 0
        self._copies: list[tuple[int, int]] = []
        self._events: list[tuple[str, list[int]]] = []

    # ---- queries -------------------------------------------------------------------------

    def blocks_needed(self, num_tokens: int) -> int:
        """The most blocks one request of ``num_tokens`` tokens holds at once over all groups: a
        full group holds a block per ``block_size`` tokens; a sliding-window group at most its
        window plus one step's chunk (``max_chunk_tokens``)."""
        full = -(-num_tokens // self.block_size)
        if self.num_groups == 1 and self.windows[0] is None:
            return full
        return sum(self._group_blocks(w, num_tokens, full) for w in self.windows)

    def _group_blocks(self, window: int | None, num_tokens: int, full: int) -> int:
        if window is None:
            return full
        chunk = self.max_chunk_tokens if self.max_chunk_tokens is not None else num_tokens
        return min(full, -(-(window - 1 + min(chunk, num_tokens)) // self.block_size) + 1)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold: the pool less the null block."""
        return self.num_blocks - self.num_reserved

    def check_fits(self, num_tokens: int) -> None:
        """Raise RequestTooLong if ``num_tokens`` could not fit even in the whole, empty pool."""
        need = self.blocks_needed(num_tokens)
        if need > self.num_usable_blocks:
            raise RequestTooLong(
                f"request needs {num_tokens} tokens of KV ({need} blocks) "
                f"but the whole pool holds {self.num_usable_blocks} blocks of {self.block_size} tokens"
            )

    def growth_blocks(self, req_id: RequestId, num_tokens: int) -> int:
        """New blocks the request (running or swapped out) takes to hold ``num_tokens`` slots:
        an upper bound (a sliding-window group may give some back first)."""
        seq = self.seqs[req_id]
        length = len(seq.host_tables[0] if seq.host_tables is not None else seq.tables[0])
        return self.num_groups * max(0, -(-num_tokens // self.block_size) - length)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def block_table(self, req_id: RequestId) -> list[int]:
        """The request's block ids in logical order, of group 0 (read-only view)."""
        return self.seqs[req_id].tables[0]

    def block_tables(self, req_id: RequestId) -> list[list[int]]:
        """The request's block table of every KV group (read-only views)."""
        return self.seqs[req_id].tables

    def held(self, table: list[int]) -> list[int]:
        """A table's entries that name blocks: all but a sliding-window group's null entries."""
        return [b for b in table if b != self._null]

    def num_tokens(self, req_id: RequestId) -> int:
        return self.seqs[req_id].num_tokens

    def __contains__(self, req_id: RequestId) -> bool:
        return req_id in self.seqs

    def stats(self) -> KVStats:
        used = self.num_usable_blocks - len(self.free_queue)
        return KVStats(
            num_blocks=self.num_usable_blocks,
            block_size=self.block_size,
            free_blocks=len(self.free_queue),
            cached_blocks=self.free_queue.num_cached,
            used_blocks=used,
            live_fraction=self._live_slots / (used * self.block_size) if used else 1.0,
            prefix_queries=self.prefix_queries,
            prefix_hits=self.prefix_hits,
            host_free_blocks=len(self.host_free),
        )

    def block_states(self) -> str:
        """Each physical block's state, one character per block id: "." free, "c" cached-free
        (no holder, content kept for prefix hits), "u" in use (one holder), "s" shared (several
        holders: prefix sharing, forks), "r" reserved (the null block). For the admin dashboard."""
        states = []
        for block in self.blocks:
            if block.block_id < self.num_reserved:
                states.append("r")
            elif block.ref_count > 1:
                states.append("s")
            elif block.ref_count == 1:
                states.append("u")
            else:
                states.append("c" if block.block_hash is not None else ".")
        return "".join(states)

    # ---- prefix cache --------------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int], extra_keys: Sequence[Any] = ()) -> PrefixHit:
        """The longest run of leading full blocks of ``token_ids`` held in the cache.

        Capped so that at least the last token is computed (its logits are needed). Read-only:
        nothing is referenced until ``allocate`` takes the hit. With several KV groups, a hit of
        n blocks needs every full-attention group's first n blocks and each sliding-window
        group's blocks from the window before token n * block_size on (as vLLM's hybrid manager
        decides); the longest n that all groups satisfy wins.
        """
        if not self.enable_prefix_caching:
            return PrefixHit([], [], self.block_size)
        hashes = hash_blocks(token_ids, self.block_size, extra_keys)
        limit = (len(token_ids) - 1) // self.block_size
        if self.num_groups == 1 and self.windows[0] is None:
            hit: list[Block] = []
            for h in hashes[:limit]:
                block = self.cached.get(h)
                if block is None:
                    break
                hit.append(block)
            return PrefixHit(hit, hashes, self.block_size)
        n = limit
        for g, window in enumerate(self.windows):
            if window is None:
                cache, run = self.caches[g], 0
                while run < n and hashes[run] in cache:
                    run += 1
                n = run
        # runs[g][j]: cached blocks of group g ending at j, consecutively
        runs: list[list[int] | None] = []
        for g, window in enumerate(self.windows):
            if window is None:
                runs.append(None)
                continue
            cache, run, counts = self.caches[g], 0, []
            for h in hashes[:n]:
                run = run + 1 if h in cache else 0
                counts.append(run)
            runs.append(counts)
        while n > 0 and not all(
            counts is None or counts[n - 1] >= n - self._window_start(w, n * self.block_size)
            for counts, w in zip(runs, self.windows)
        ):
            n -= 1
        group_blocks: list[list[Block | None]] = []
        for g, window in enumerate(self.windows):
            lo = self._window_start(window, n * self.block_size)
            cache = self.caches[g]
            group_blocks.append([None] * lo + [cache[h] for h in hashes[lo:n]])
        return PrefixHit(group_blocks[0], hashes, self.block_size, group_blocks)  # type: ignore[arg-type]

    def _window_start(self, window: int | None, position: int) -> int:
        """The first block a query at ``position`` (or later) reads in a group of ``window``."""
        return window_start_block(window, position, self.block_size)

    def _register_full_blocks(self, seq: _Seq, token_ids: Sequence[int]) -> None:
        n_full = seq.num_tokens // self.block_size
        if n_full <= seq.num_registered:
            return
        bs = self.block_size
        known = len(seq.hashes)
        if known < n_full:
            parent = seq.hashes[-1] if known else ROOT_HASH
            seq.hashes.extend(hash_blocks(token_ids[known * bs : n_full * bs], bs, seq.extra_keys, parent))
        stored: list[int] = []
        for g, (table, cache) in enumerate(zip(seq.tables, self.caches)):
            for i in range(seq.num_registered, n_full):
                if table[i] == self._null:
                    continue
                block = self.blocks[table[i]]
                h = seq.hashes[i]
                # The first block computed for a hash keeps it; a duplicate stays unregistered.
                if block.block_hash is None and h not in cache:
                    block.block_hash = h
                    block.group = g
                    cache[h] = block
                    if g == 0:
                        stored.append(h)
        seq.num_registered = n_full
        if stored:
            self._event("stored", stored)

    def _event(self, kind: str, hashes: list[int]) -> None:
        if self._events and self._events[-1][0] == kind:
            self._events[-1][1].extend(hashes)
        else:
            self._events.append((kind, hashes))

    def take_events(self) -> list[tuple[str, list[int]]]:
        """KV events since the last call, in order: ("stored" | "removed", [block hashes])."""
        events, self._events = self._events, []
        return events

    def reset_prefix_cache(self) -> int:
        """Forget every cached-free block's content; returns how many were dropped."""
        dropped = [b for b in self.free_queue if b.block_hash is not None]
        for block in dropped:
            self._uncache(block)
        self.free_queue.num_cached = 0
        return len(dropped)

    def _uncache(self, block: Block) -> None:
        h = block.block_hash
        if h is not None:
            del self.caches[block.group][h]
            block.block_hash = None
            if block.group == 0:
                self._event("removed", [h])

    # ---- allocation ----------------------------------------------------------------------

    def _take_free_block(self) -> Block:
        block = self.free_queue.popleft()
        self._uncache(block)  # evicting cached content: the hash must never name reused memory
        block.ref_count = 1
        block.num_tokens = 0
        return block

    def _slide(self, seq: _Seq, position: int) -> None:
        """Give back each sliding-window group's blocks that no query from ``position`` on reads."""
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            lo = self._window_start(window, position)
            table = seq.tables[g]
            for i in range(seq.slid[g], min(lo, len(table))):
                if table[i] != NULL_BLOCK:
                    self._release([table[i]])
                    table[i] = NULL_BLOCK
            seq.slid[g] = max(seq.slid[g], lo)

    def allocate(
        self,
        req_id: RequestId,
        token_ids: Sequence[int],
        num_new_tokens: int,
        *,
        prefix: PrefixHit | None = None,
        num_lookahead: int = 0,
        extra_keys: Sequence[Any] = (),
        count_prefix_stats: bool = True,
    ) -> int | None:
        """Give the request slots for its next ``num_new_tokens`` tokens (plus lookahead blocks).

        ``token_ids`` holds all of the request's tokens known so far; the blocks they fill are
        registered in the prefix cache. For a request's first call, ``prefix`` (from
        ``match_prefix``) supplies its leading cached blocks. Returns the index of the first
        block-table entry that changed (== the old length when none did; the same index in every
        KV group's table), or None when the pool is short, in which case nothing was allocated
        (a sliding-window group may still have given back blocks out of its window) and the
        caller may preempt and retry.
        """
        seq = self.seqs.get(req_id)
        bs = self.block_size
        groups = range(self.num_groups)
        if seq is None:
            hits = prefix.per_group(self.num_groups) if prefix is not None else [[] for _ in groups]
            old_tokens = len(hits[0]) * bs
            table_len = len(hits[0])
            revive = sum(1 for blocks in hits for b in blocks if b is not None and b.ref_count == 0)
        else:
            hits, old_tokens, table_len, revive = (), seq.num_tokens, len(seq.tables[0]), 0
            if self.num_reserved:
                self._slide(seq, old_tokens)
        new_tokens = old_tokens + num_new_tokens
        if new_tokens > len(token_ids):
            raise ValueError(f"{new_tokens} slots asked for but only {len(token_ids)} token ids given")
        need = max(-(-(new_tokens + num_lookahead) // bs) - table_len, 0)
        # Appending into a partly filled block that others share: copy it first (copy-on-write).
        cow = []
        if seq is not None and num_new_tokens > 0 and old_tokens % bs != 0:
            idx = old_tokens // bs
            cow = [g for g in groups if self.blocks[seq.tables[g][idx]].ref_count > 1]
        if need * self.num_groups + len(cow) + revive > len(self.free_queue):
            return None

        if seq is None:
            seq = _Seq([[] for _ in groups], extra_keys=tuple(extra_keys), slid=[0] * self.num_groups)
            self.seqs[req_id] = seq
            for g, blocks in enumerate(hits):
                table = seq.tables[g]
                for block in blocks:
                    if block is None:
                        table.append(NULL_BLOCK)
                        seq.slid[g] = len(table)
                        continue
                    if block.ref_count == 0:
                        self.free_queue.remove(block)
                        self._live_slots += block.num_tokens
                    block.ref_count += 1
                    table.append(block.block_id)
            if prefix is not None:
                seq.hashes = prefix.hashes
                seq.num_registered = table_len
            seq.num_tokens = old_tokens
            if count_prefix_stats:
                self.prefix_queries += len(token_ids)
                self.prefix_hits += old_tokens
        first_changed = table_len
        for g in cow:
            table = seq.tables[g]
            idx = old_tokens // bs
            src = self.blocks[table[idx]]
            dst = self._take_free_block()
            src.ref_count -= 1
            dst.num_tokens = src.num_tokens
            self._live_slots += dst.num_tokens
            table[idx] = dst.block_id
            self._copies.append((src.block_id, dst.block_id))
            first_changed = idx
        for table in seq.tables:
            for _ in range(need):
                table.append(self._take_free_block().block_id)
            self._fill(table, old_tokens, new_tokens)
        seq.num_tokens = new_tokens
        if self.enable_prefix_caching and new_tokens // bs > seq.num_registered:
            self._register_full_blocks(seq, token_ids)
        return first_changed

    def _fill(self, table: list[int], start: int, end: int) -> None:
        """Mark slots [start, end) of a table as holding live tokens."""
        bs = self.block_size
        pos = start
        while pos < end:
            block = self.blocks[table[pos // bs]]
            n = min(end, (pos // bs + 1) * bs) - pos
            block.num_tokens += n
            self._live_slots += n
            pos += n

    def take_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write block copies (source, destination) decided since the last call."""
        copies, self._copies = self._copies, []
        return copies

    def _release(self, table: list[int]) -> None:
        # Tail first: a chain's last blocks are the first evicted among what this frees.
        for block_id in reversed(self.held(table)):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed with no reference"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._live_slots -= block.num_tokens
                if block.block_hash is not None:
                    self.free_queue.append(block)
                else:
                    block.num_tokens = 0
                    self.free_queue.appendleft(block)

    def free(self, req_id: RequestId) -> None:
        """Return the request's blocks; full registered blocks stay cached until evicted."""
        seq = self.seqs.pop(req_id)
        for table in seq.tables:
            self._release(table)
        if seq.host_tables is not None:
            for host_table in seq.host_tables:
                self._release_host(host_table)

    def _release_host(self, host_table: list[int]) -> None:
        for host_id in host_table:
            if host_id == NULL_HOST:
                continue
            self.host_ref_count[host_id] -= 1
            if self.host_ref_count[host_id] == 0:
                self.host_free.append(host_id)

    def fork(self, parent_id: RequestId, child_id: RequestId) -> None:
        """The child shares every block of the parent (parallel samples); writes will copy."""
        parent = self.seqs[parent_id]
        assert child_id not in self.seqs, f"request {child_id!r} already has blocks"
        for table in parent.tables:
            for block_id in self.held(table):
                self.blocks[block_id].ref_count += 1
        self.seqs[child_id] = _Seq(
            tables=[list(t) for t in parent.tables],
            num_tokens=parent.num_tokens,
            hashes=list(parent.hashes),
            num_registered=parent.num_registered,
            extra_keys=parent.extra_keys,
            slid=list(parent.slid),
        )

    def shared_prefix(self, holder_id: RequestId, num_blocks: int, hashes: list[int]) -> PrefixHit | None:
        """The first ``num_blocks`` full blocks of a running request as a hit another request (a
        beam sibling with the same leading tokens) can take; None where a sliding-window group of
        the holder has already given back a block that the window before them needs."""
        seq = self.seqs[holder_id]
        group_blocks: list[list[Block | None]] = []
        for window, table in zip(self.windows, seq.tables):
            lo = self._window_start(window, num_blocks * self.block_size)
            if window is not None and any(b == NULL_BLOCK for b in table[lo:num_blocks]):
                return None
            group_blocks.append([None] * lo + [self.blocks[b] for b in table[lo:num_blocks]])
        return PrefixHit(group_blocks[0], hashes, self.block_size, group_blocks)  # type: ignore[arg-type]

    # ---- swapping ------------------------------------------------------------------------
    #
    # Requests swap out and in together as a group (a beam group's beams, or a single request):
    # a block several of them share moves once and is shared again when it returns.

    def swap_out(self, req_id: RequestId) -> list[tuple[int, int]] | None:
        """Move the request's blocks to the host pool; returns (device, host) copies, or None if short."""
        return self.swap_out_group([req_id])

    def swap_out_group(self, req_ids: Sequence[RequestId]) -> list[tuple[int, int]] | None:
        """Move the requests' blocks to the host pool, each shared block once; returns the
        (device, host) copies, or None (nothing changed) when the host pool is short."""
        seqs = [self.seqs[r] for r in req_ids]
        unique = list(dict.fromkeys(b for seq in seqs for t in seq.tables for b in self.held(t)))
        if len(unique) > len(self.host_free):
            return None
        to_host = {block_id: self.host_free.pop() for block_id in unique}
        for seq in seqs:
            seq.host_tables = [[to_host.get(b, NULL_HOST) for b in t] for t in seq.tables]
            for table in seq.tables:
                for block_id in self.held(table):
                    self.host_ref_count[to_host[block_id]] += 1
                self._release(table)
            seq.tables = [[] for _ in seq.tables]
        # The workers swap out before they copy: a copy-on-write decided this step into a block
        # that now leaves is moot, and the block's content is its source's.
        pending = {dst: src for src, dst in self._copies}
        moved = {dst for dst in pending if dst in to_host}
        if moved:
            self._copies = [(src, dst) for src, dst in self._copies if dst not in moved]
        return [(pending[b] if b in moved else b, h) for b, h in to_host.items()]

    def _unique_host_blocks(self, req_ids: Sequence[RequestId]) -> list[int]:
        tables = [self.seqs[r].host_tables for r in req_ids]
        assert all(t is not None for t in tables), f"not all of {list(req_ids)!r} are swapped out"
        return list(dict.fromkeys(h for ts in tables for t in ts for h in t if h != NULL_HOST))  # type: ignore[union-attr]

    def can_swap_in(self, req_id: RequestId, extra_blocks: int = 0) -> bool:
        return self.can_swap_in_group([req_id], extra_blocks)

    def can_swap_in_group(self, req_ids: Sequence[RequestId], extra_blocks: int = 0) -> bool:
        return len(self._unique_host_blocks(req_ids)) + extra_blocks <= len(self.free_queue)

    def swap_in(self, req_id: RequestId) -> list[tuple[int, int]] | None:
        """Bring a swapped-out request back; returns (host, device) copies, or None if short."""
        return self.swap_in_group([req_id])

    def swap_in_group(self, req_ids: Sequence[RequestId]) -> list[tuple[int, int]] | None:
        """Bring swapped-out requests back, sharing again what they shared; returns the
        (host, device) copies, or None (nothing changed) when the device pool is short."""
        unique = self._unique_host_blocks(req_ids)
        if len(unique) > len(self.free_queue):
            return None
        to_device = {host_id: self._take_free_block() for host_id in unique}
        filled: set[int] = set()
        bs = self.block_size
        for req_id in req_ids:
            seq = self.seqs[req_id]
            host_tables = seq.host_tables
            assert host_tables is not None
            seq.tables = [[to_device[h].block_id if h != NULL_HOST else NULL_BLOCK for h in t]
                          for t in host_tables]  # fmt: skip
            for host_table in host_tables:
                for i, host_id in enumerate(host_table):
                    if host_id == NULL_HOST:
                        continue
                    block = to_device[host_id]
                    if host_id in filled:
                        block.ref_count += 1
                    else:  # the first holder brings the block's content (shared blocks fill alike)
                        filled.add(host_id)
                        n = max(0, min(bs, seq.num_tokens - i * bs))
                        block.num_tokens = n
                        self._live_slots += n
                self._release_host(host_table)
            seq.host_tables = None
            seq.num_registered = 0
            if self.enable_prefix_caching:
                self._register_full_blocks(seq, ())  # hashes are all known: no tokens needed
        return [(h, to_device[h].block_id) for h in unique]

    def is_swapped(self, req_id: RequestId) -> bool:
        return self.seqs[req_id].host_tables is not None
