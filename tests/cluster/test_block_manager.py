"""The block manager against a shadow model of what every physical block holds."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from pagedserve.cluster.block_manager import NULL_HOST, BlockManager, RequestTooLong
from pagedserve.cluster.hashing import ROOT_HASH, hash_block, hash_blocks
from pagedserve.plan import NULL_BLOCK


def held(bm: BlockManager, table: list[int]) -> list[int]:
    """A table's entries that name blocks (not the null block of a sliding-window group)."""
    return [b for b in table if b != NULL_BLOCK] if bm.num_reserved else list(table)


def check_invariants(bm: BlockManager) -> None:
    """Each block is exactly one of free / cached-free / referenced, and the counts agree."""
    holders: dict[int, int] = {}
    for seq in bm.seqs.values():
        assert len({len(t) for t in seq.tables}) == 1, "every KV group's table has one length"
        for table in seq.tables:
            blocks = held(bm, table)
            assert len(set(blocks)) == len(blocks)
            for block_id in blocks:
                holders[block_id] = holders.get(block_id, 0) + 1
    in_queue = {b.block_id for b in bm.free_queue}
    assert len(in_queue) == len(bm.free_queue)
    cached_free = 0
    live = 0
    for block in bm.blocks[bm.num_reserved :]:
        assert block.ref_count == holders.get(block.block_id, 0)
        assert (block.ref_count == 0) == (block.block_id in in_queue)
        if block.ref_count == 0 and block.block_hash is not None:
            cached_free += 1
        if block.ref_count > 0:
            live += block.num_tokens
        if block.block_hash is not None:
            assert bm.caches[block.group][block.block_hash] is block
    assert NULL_BLOCK not in in_queue or not bm.num_reserved
    assert sum(map(len, bm.caches)) == sum(1 for b in bm.blocks if b.block_hash is not None)
    stats = bm.stats()
    assert stats.free_blocks + stats.used_blocks == bm.num_usable_blocks
    assert stats.used_blocks == len(holders)
    assert stats.cached_blocks == cached_free
    assert bm._live_slots == live
    host_holders: dict[int, int] = {}
    for seq in bm.seqs.values():
        for host_table in seq.host_tables or ():
            blocks = [h for h in host_table if h != NULL_HOST]
            assert len(set(blocks)) == len(blocks)
            for h in blocks:
                host_holders[h] = host_holders.get(h, 0) + 1
    assert len(set(bm.host_free)) == len(bm.host_free)
    assert not set(bm.host_free) & set(host_holders)
    assert len(host_holders) + len(bm.host_free) == bm.num_host_blocks
    for h in range(bm.num_host_blocks):
        assert bm.host_ref_count[h] == host_holders.get(h, 0)


def block_contents(tokens: list[int], num_tokens: int, bs: int) -> list[tuple]:
    """What each block of a request must hold: (hash of everything before it, its tokens)."""
    out = []
    parent = ROOT_HASH
    for i in range(-(-num_tokens // bs)):
        chunk = tuple(tokens[i * bs : min(num_tokens, (i + 1) * bs)])
        out.append((parent, chunk))
        if len(chunk) == bs:
            parent = hash_block(parent, chunk)
    return out


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free / swap sequences; eviction happens under pressure."""

    requests = Bundle("requests")
    WINDOWS: tuple[int | None, ...] = (None,)  # one KV group, full attention: a plain paged pool
    NUM_BLOCKS = 24

    def __init__(self) -> None:
        super().__init__()
        self.bs = 4
        self.bm = BlockManager(self.NUM_BLOCKS, self.bs, num_host_blocks=2 * self.NUM_BLOCKS // 3,
                               enable_prefix_caching=True, group_windows=self.WINDOWS)  # fmt: skip
        self.step_start: dict[int, int] = {}  # position of each request's last step's first token
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0
        # What each physical block holds, as last written by the shadow model; and each host block.
        self.content: dict[int, tuple] = {}
        self.host_content: dict[int, tuple] = {}
        self.templates = [
            [1, 2, 3, 4, 5, 6, 7, 8, 9],
            [1, 2, 3, 4, 9, 9, 9, 9],
            [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5],
        ]

    def _live(self, rid: int) -> bool:
        return rid in self.bm.seqs and not self.bm.is_swapped(rid)

    @rule(
        target=requests,
        template=st.integers(0, 2),
        tail=st.lists(st.integers(0, 3), max_size=6),
        chunk=st.integers(1, 20),
    )
    def add(self, template, tail, chunk):
        prompt = self.templates[template] + tail
        rid = self.next_id
        self.next_id += 1
        hit = self.bm.match_prefix(prompt)
        assert hit.num_tokens < len(prompt)
        hashes = hash_blocks(prompt, self.bs)
        for g, blocks in enumerate(hit.per_group(self.bm.num_groups)):
            assert len(blocks) == len(hit.blocks)
            # a hit supplies every block the first computed token's window reads, and no other
            lo = self.bm._window_start(self.WINDOWS[g], hit.num_tokens)
            assert all(b is None for b in blocks[:lo])
            for i, block in enumerate(blocks[lo:], start=lo):
                assert block.block_hash == hashes[i] and block.group == g
        n = min(chunk, len(prompt) - hit.num_tokens)
        if self.bm.allocate(rid, prompt, n, prefix=hit) is not None:
            self.tokens[rid] = prompt
            self.step_start[rid] = hit.num_tokens
            self._record(rid)
        return rid

    @rule(rid=requests, new=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def append(self, rid, new):
        if not self._live(rid):
            return
        computed = self.bm.num_tokens(rid)
        toks = self.tokens[rid]
        pending = len(toks) - computed  # prompt tokens not yet computed (chunked prefill)
        if pending == 0:
            toks = toks + new
            n = len(new)
        else:
            n = min(pending, len(new))
        before = [list(t) for t in self.bm.block_tables(rid)]
        # the step starts at `computed` whether or not it gets its blocks: a sliding-window group
        # gives back what it no longer reads either way
        self.step_start[rid] = computed
        first = self.bm.allocate(rid, toks, n)
        for table, old in zip(self.bm.block_tables(rid), before):
            # what the workers hold stays valid: unchanged, or out of the window (never read)
            end = len(old) if first is None else first
            assert all(b == o or b == NULL_BLOCK for b, o in zip(table[:end], old[:end]))
        if first is None:
            assert [len(t) for t in self.bm.block_tables(rid)] == [len(t) for t in before]
            return
        copies = self.bm.take_copies()
        for src, dst in copies:
            self.content[dst] = self.content.get(src)
        self.tokens[rid] = toks
        self._record(rid)

    @rule(rid=requests, target=requests)
    def fork(self, rid):
        if not self._live(rid):
            return -1
        child = self.next_id
        self.next_id += 1
        self.bm.fork(rid, child)
        self.tokens[child] = list(self.tokens[rid])
        self.step_start[child] = self.step_start[rid]
        return child

    @rule(rid=requests)
    def free(self, rid):
        if rid in self.bm.seqs:
            self.bm.free(rid)

    @rule(rids=st.lists(requests, min_size=1, max_size=3, unique=True))
    def swap_out(self, rids):
        # A group (beams) swaps out together: a block they share moves once.
        rids = [r for r in rids if self._live(r)]
        if rids:
            mapping = self.bm.swap_out_group(rids)
            if mapping is not None:
                assert len({h for _, h in mapping}) == len(mapping)
                for device, host in mapping:
                    self.host_content[host] = self.content.get(device)

    @rule(rids=st.lists(requests, min_size=1, max_size=3, unique=True))
    def swap_in(self, rids):
        # Content comes back only through the copies the mapping names (no shadow rewrite).
        rids = [r for r in rids if r in self.bm.seqs and self.bm.is_swapped(r)]
        if rids:
            mapping = self.bm.swap_in_group(rids)
            if mapping is not None:
                for host, device in mapping:
                    self.content[device] = self.host_content[host]

    def _record(self, rid: int) -> None:
        # Shadow writes: every block of the request now holds the request's content at that place.
        want = block_contents(self.tokens[rid], self.bm.num_tokens(rid), self.bs)
        for table in self.bm.block_tables(rid):
            for block_id, content in zip(table, want):
                if block_id != NULL_BLOCK or not self.bm.num_reserved:
                    self.content[block_id] = content

    @invariant()
    def consistent(self):
        check_invariants(self.bm)

    @invariant()
    def shared_blocks_hold_one_content(self):
        # A block shared by several tables must mean the same content to each (copy-on-write).
        for rid, seq in self.bm.seqs.items():
            if seq.host_tables is not None:
                continue
            want = block_contents(self.tokens[rid], seq.num_tokens, self.bs)
            for table in seq.tables:
                for block_id, content in zip(table, want):
                    if block_id != NULL_BLOCK or not self.bm.num_reserved:
                        assert self.content[block_id] == content, (rid, block_id)

    @invariant()
    def sliding_groups_hold_exactly_their_window(self):
        # A sliding-window group holds no block wholly before the window of its request's last
        # step (it went back to the pool) and every block from there on (the step reads them).
        for rid, seq in self.bm.seqs.items():
            if seq.host_tables is not None:
                continue
            for window, table in zip(self.WINDOWS, seq.tables):
                lo = self.bm._window_start(window, self.step_start[rid])
                assert all(b == NULL_BLOCK for b in table[:lo]), (rid, window, table)
                assert NULL_BLOCK not in table[lo:] or not self.bm.num_reserved, (rid, window, table)

    @invariant()
    def hashes_name_their_content(self):
        # A cached hash never points to a block that was reused for other content.
        for h, block in (item for cache in self.bm.caches for item in cache.items()):
            parent, chunk = self.content[block.block_id]
            assert len(chunk) == self.bs
            assert hash_block(parent, chunk) == h

    def teardown(self):
        for rid in list(self.bm.seqs):
            self.bm.free(rid)
        check_invariants(self.bm)
        assert self.bm.num_free_blocks == self.bm.num_usable_blocks
        assert len(self.bm.host_free) == self.bm.num_host_blocks


class HybridBlockManagerMachine(BlockManagerMachine):
    """The same random programs over mixed KV groups (hybrid KV): one full-attention group and
    sliding-window groups of 6 and 9 tokens (blocks of 4), in one pool."""

    WINDOWS = (None, 6, 9, 6)
    NUM_BLOCKS = 60


TestBlockManagerStateful = BlockManagerMachine.TestCase
TestBlockManagerStateful.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestHybridBlockManagerStateful = HybridBlockManagerMachine.TestCase
TestHybridBlockManagerStateful.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_group_swap_moves_shared_blocks_once_and_shares_them_again() -> None:
    bm = BlockManager(16, 4, num_host_blocks=16)
    prompt = list(range(10))  # 2 full blocks and a partial one
    bm.allocate("a", prompt, 10)
    bm.fork("a", "b")
    bm.fork("a", "c")
    assert bm.allocate("b", prompt + [7], 1) is not None  # b copies the shared partial block
    [(src, dst)] = bm.take_copies()
    assert bm.allocate("c", prompt + [8], 1) is not None
    [(src_c, dst_c)] = bm.take_copies()
    assert src_c == src and dst_c not in (src, dst)
    # a still holds the partial block alone now; the full blocks are shared by all three
    mapping = bm.swap_out_group(["a", "b", "c"])
    assert len(mapping) == 2 + 3  # the shared full blocks once, each partial block once
    check_invariants(bm)
    assert bm.num_free_blocks == 16
    back = bm.swap_in_group(["a", "b", "c"])
    assert len(back) == 5
    tables = [bm.block_table(r) for r in "abc"]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert len({t[2] for t in tables}) == 3
    assert [bm.blocks[b].ref_count for b in tables[0][:2]] == [3, 3]
    check_invariants(bm)


def test_copy_decided_then_swapped_out_in_the_same_step_swaps_the_source() -> None:
    """The workers swap out before they copy: a block whose copy-on-write is still pending when its
    holder swaps out must leave with its source's content, and the copy is dropped."""
    bm = BlockManager(16, 4, num_host_blocks=16)
    bm.allocate("a", [1, 2, 3, 4, 5, 6], 6)
    bm.fork("a", "b")
    bm.allocate("b", [1, 2, 3, 4, 5, 6, 7], 1)  # copy (src -> dst) pending for this step
    table = list(bm.block_table("b"))
    mapping = dict(bm.swap_out_group(["b"]))
    src = bm.block_table("a")[1]
    assert table[1] not in mapping and mapping[src] is not None  # the source goes to the host
    assert bm.take_copies() == []
    check_invariants(bm)


def prompt_with_prefix(prefix: list[int], tail: int, seed: int) -> list[int]:
    return prefix + [1000 + seed * 100 + i for i in range(tail)]


def test_common_prefix_of_1000_tokens_shares_31_blocks():
    bm = BlockManager(200, 32)
    prefix = list(range(1000))
    a, b = prompt_with_prefix(prefix, 50, 1), prompt_with_prefix(prefix, 70, 2)
    assert bm.allocate("a", a, len(a), prefix=bm.match_prefix(a)) == 0
    hit = bm.match_prefix(b)
    assert hit.num_tokens == 992 and len(hit.blocks) == 31
    bm.allocate("b", b, len(b) - hit.num_tokens, prefix=hit)
    assert bm.block_table("a")[:31] == bm.block_table("b")[:31]
    assert bm.block_table("a")[31] != bm.block_table("b")[31]
    assert bm.stats().prefix_hits == 992
    assert bm.stats().prefix_queries == len(a) + len(b)
    check_invariants(bm)


def test_divergence_inside_a_block_loses_that_block():
    bm = BlockManager(50, 16)
    a = list(range(64))
    b = list(range(40)) + [999] + list(range(41, 64))  # differs at token 40, inside block 2
    bm.allocate("a", a, 64, prefix=bm.match_prefix(a))
    assert bm.match_prefix(b).num_tokens == 32


def test_last_prompt_token_is_always_computed():
    bm = BlockManager(50, 16)
    a = list(range(64))
    bm.allocate("a", a, 64, prefix=bm.match_prefix(a))
    bm.free("a")
    hit = bm.match_prefix(a)
    assert hit.num_tokens == 48  # the 4th block holds the last token, which must be recomputed
    assert bm.match_prefix(a + [7]).num_tokens == 64


def test_eviction_is_lru_and_tail_first():
    bm = BlockManager(6, 2)
    old, new = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10]
    old_hashes, new_hashes = hash_blocks(old, 2), hash_blocks(new, 2)
    bm.allocate("old", old, 6)
    bm.free("old")  # frees its chain tail first
    bm.allocate("new", new, 4)  # takes never-used blocks before evicting anything
    bm.free("new")
    assert bm.take_events() == [("stored", old_hashes + new_hashes)]
    assert bm.stats().cached_blocks == 5
    bm.allocate("x", [20, 21, 22, 23, 24, 25], 6)
    # One never-used block, then evictions: the least recently freed chain first, its tail first.
    assert bm.take_events() == [
        ("removed", [old_hashes[2], old_hashes[1]]),
        ("stored", hash_blocks([20, 21, 22, 23, 24, 25], 2)),
    ]
    assert bm.match_prefix(old + [0]).num_tokens == 2  # the head of "old" survived
    assert bm.match_prefix(new + [0]).num_tokens == 4  # the more recently freed chain is intact
    check_invariants(bm)


def test_fork_first_divergent_append_copies_exactly_one_block():
    bm = BlockManager(20, 4)
    prompt = list(range(10))  # 2 full blocks + a partial one
    bm.allocate("p", prompt, 10)
    bm.fork("p", "c")
    assert bm.block_table("p") == bm.block_table("c")
    first = bm.allocate("c", prompt + [42], 1)
    copies = bm.take_copies()
    assert len(copies) == 1 and first == 2
    src, dst = copies[0]
    assert src == bm.block_table("p")[2] and dst == bm.block_table("c")[2]
    assert bm.block_table("p")[:2] == bm.block_table("c")[:2]
    # The parent is now the only holder of the original partial block: it writes in place.
    assert bm.allocate("p", prompt + [43], 1) == 3
    assert bm.take_copies() == []
    check_invariants(bm)


def test_allocation_failure_changes_nothing_and_free_returns_everything():
    bm = BlockManager(4, 4)
    bm.allocate("a", list(range(12)), 12)
    before = bm.stats()
    assert bm.allocate("b", list(range(100, 108)), 8) is None
    assert "b" not in bm
    assert bm.stats() == before
    assert bm.allocate("a", list(range(17)), 5) is None  # needs 2 more blocks, 1 is free
    bm.free("a")
    assert bm.num_free_blocks == 4


def test_lookahead_reserves_blocks_ahead():
    bm = BlockManager(10, 4)
    bm.allocate("a", list(range(4)), 4, num_lookahead=5)
    assert len(bm.block_table("a")) == 3
    assert bm.allocate("a", list(range(5)), 1) == 3  # already has the slot: nothing changes
    assert bm.stats().live_fraction == pytest.approx(5 / 12)


def test_request_too_long_is_named():
    bm = BlockManager(4, 16)
    bm.check_fits(64)
    with pytest.raises(RequestTooLong):
        bm.check_fits(65)


def test_swap_round_trip_reports_copies():
    bm = BlockManager(6, 4, num_host_blocks=4)
    bm.allocate("a", list(range(10)), 10)
    table = list(bm.block_table("a"))
    out = bm.swap_out("a")
    assert [d for d, _ in out] == table and bm.num_free_blocks == 6
    bm.allocate("b", list(range(50, 66)), 16)  # evicts a's cached blocks
    assert bm.swap_in("a") is None  # only 2 free, needs 3
    bm.free("b")
    back = bm.swap_in("a")
    assert [h for h, _ in back] == [h for _, h in out]
    assert bm.num_tokens("a") == 10 and len(bm.block_table("a")) == 3
    check_invariants(bm)
    bm.free("a")
    assert bm.num_free_blocks == 6 and len(bm.host_free) == 4


def test_prefix_caching_off_shares_nothing():
    bm = BlockManager(20, 4, enable_prefix_caching=False)
    bm.allocate("a", list(range(12)), 12)
    assert bm.match_prefix(list(range(12))).num_tokens == 0
    assert bm.take_events() == []


def test_recompute_is_not_counted_as_a_hit():
    bm = BlockManager(20, 4)
    p = list(range(13))
    bm.allocate("a", p, 13, prefix=bm.match_prefix(p))
    bm.free("a")  # preempted by recompute
    bm.allocate("a", p, 1, prefix=bm.match_prefix(p), count_prefix_stats=False)
    assert bm.stats().prefix_hits == 0 and bm.stats().prefix_queries == 13


def test_hybrid_sliding_group_gives_back_blocks_out_of_its_window() -> None:
    """A full-attention group keeps every block; a sliding group of window 8 (blocks of 4) holds
    only what the step's first query reads, and the rest goes back to the pool (cached)."""
    bm = BlockManager(64, 4, group_windows=(None, 8))
    tokens = list(range(100, 140))
    for start in range(0, 40, 4):  # chunks of 4 tokens
        assert bm.allocate("a", tokens, 4) is not None
        full, sliding = bm.block_tables("a")
        lo = max(0, start - 8 + 1) // 4
        assert len(full) == len(sliding) == start // 4 + 1 and NULL_BLOCK not in full
        assert sliding[:lo] == [NULL_BLOCK] * lo and NULL_BLOCK not in sliding[lo:]
    assert bm.stats().used_blocks == 10 + 3  # 40 tokens in the full group, 3 blocks in the window
    bm.free("a")
    assert bm.num_free_blocks == bm.num_usable_blocks == 63


def test_hybrid_prefix_hit_needs_the_window_before_it_in_sliding_groups() -> None:
    """vLLM's rule: a hit of n blocks needs the full group's n blocks and the sliding group's
    blocks of the window before token n * block_size; without those it is shorter."""
    bm = BlockManager(64, 4, group_windows=(None, 8))
    prompt = list(range(200, 233))  # 33 tokens: at most 8 blocks can hit
    assert bm.allocate("a", prompt, 33) is not None
    bm.free("a")
    hashes = hash_blocks(prompt, 4)
    hit = bm.match_prefix(prompt)
    assert hit.num_tokens == 32
    full, sliding = hit.group_blocks
    assert [b.block_hash for b in full] == hashes[:8]
    # the query at 32 reads keys 25.. : blocks 6 and 7 of the sliding group, the others are null
    assert sliding[:6] == [None] * 6 and [b.block_hash for b in sliding[6:]] == hashes[6:8]
    assert bm.allocate("b", prompt, 1, prefix=hit) == 8
    assert bm.block_tables("b")[1][:6] == [NULL_BLOCK] * 6
    bm.free("b")
    # the sliding group's block 7 evicted: 8 blocks cannot hit, 7 can (blocks 5 and 6 are cached)
    bm._uncache(bm.caches[1][hashes[7]])
    hit = bm.match_prefix(prompt)
    assert hit.num_tokens == 28 and [b.block_hash for b in hit.group_blocks[1][5:]] == hashes[5:7]
    # and without the full group's block 3 nothing past 3 blocks can hit at all
    bm._uncache(bm.caches[0][hashes[3]])
    hit = bm.match_prefix(prompt)
    assert hit.num_tokens == 12 and hit.group_blocks[1] == [None] + [bm.caches[1][h] for h in hashes[1:3]]
    assert bm.take_events()[-1] == ("removed", [hashes[3]])  # events come from group 0 only
