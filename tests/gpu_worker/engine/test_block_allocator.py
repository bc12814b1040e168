"""Tests for gpu_worker.engine.block_allocator.BlockAllocator."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gpu_worker.engine import block_allocator as ba
from gpu_worker.engine.block_allocator import BlockAllocator

BS = 4


def _seq(alloc: BlockAllocator, tokens: list[int]) -> tuple[list[int], int | None]:
    """Allocate a table for tokens and register its full blocks; return (table, last hash)."""
    table: list[int] = []
    alloc.append_slots(table, 0, len(tokens))
    last = alloc.cache_full_blocks(table, tokens, 0, len(tokens) // alloc.block_size, None)
    return table, last


def test_allocate_free_round_trip() -> None:
    alloc = BlockAllocator(8, BS)
    blocks = alloc.allocate(5)
    assert len(set(blocks)) == 5 and alloc.num_used_blocks == 5 and alloc.num_free_blocks == 3
    assert all(alloc.ref_count(b) == 1 for b in blocks)
    assert not alloc.can_allocate(4)
    with pytest.raises(AssertionError):
        alloc.allocate(4)
    alloc.free(blocks)
    alloc.check_invariants()
    assert alloc.num_free_blocks == 8 and alloc.num_used_blocks == 0
    with pytest.raises(AssertionError):
        alloc.free(blocks[:1])


def test_prefix_hit_after_free_revives_block() -> None:
    alloc = BlockAllocator(8, BS)
    tokens = list(range(10))
    table, last = _seq(alloc, tokens)
    alloc.free(table)
    assert alloc.num_free_blocks == 8 and alloc.num_used_blocks == 0
    ids, hashes = alloc.find_cached_prefix(tokens + [99], max_blocks=10)
    assert ids == table[:2] and hashes[-1] == last
    assert alloc.num_prefix_queries == 2 and alloc.prefix_cache_hit_rate == 1.0
    assert alloc.find_cached_prefix(tokens, max_blocks=1)[0] == table[:1]
    assert alloc.find_cached_prefix([0, 1, 2, 3, 7, 7, 7, 7], max_blocks=2)[0] == table[:1]
    alloc.take(ids)
    alloc.check_invariants()
    assert [alloc.ref_count(b) for b in ids] == [1, 1] and alloc.num_free_blocks == 6
    with pytest.raises(AssertionError):
        alloc.take([table[2]])  # plain free, uncached: nothing to revive


def test_hash_collision_is_not_a_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ba, "block_hash", lambda parent, tokens: 0)
    alloc = BlockAllocator(8, BS)
    table, _ = _seq(alloc, [1, 1, 1, 1])
    assert alloc.find_cached_prefix([2, 2, 2, 2], 1) == ([], [])
    assert alloc.find_cached_prefix([1, 1, 1, 1], 1) == (table, [0])
    alloc.check_invariants()


def test_parent_hash_is_compared_on_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ba, "block_hash", lambda parent, tokens: hash(tokens))
    alloc = BlockAllocator(8, BS)
    x = [5, 5, 5, 5]
    a = [1, 2, 3, 4]
    tx, _ = _seq(alloc, x)  # X cached as a first block (parent None)
    ta, _ = _seq(alloc, a)
    # Hash of X under parent A collides with X-as-first-block; the parent mismatch must stop the chain.
    assert alloc.find_cached_prefix(a + x, 2)[0] == ta
    assert alloc.find_cached_prefix(x, 1)[0] == tx


def test_lru_eviction_order() -> None:
    alloc = BlockAllocator(4, 2)
    ta, _ = _seq(alloc, [1, 1])
    tb, _ = _seq(alloc, [2, 2])
    alloc.free(ta)
    alloc.free(tb)
    plain = alloc.allocate(2)
    assert set(plain).isdisjoint(ta + tb) and alloc.num_evictions == 0
    assert alloc.find_cached_prefix([1, 1], 1)[0] == ta and alloc.find_cached_prefix([2, 2], 1)[0] == tb
    assert alloc.allocate(1) == ta and alloc.num_evictions == 1
    assert alloc.find_cached_prefix([1, 1], 1)[0] == [] and alloc.find_cached_prefix([2, 2], 1)[0] == tb
    alloc.check_invariants()


def test_free_table_in_reverse_evicts_tail_first() -> None:
    alloc = BlockAllocator(2, 2)
    table, _ = _seq(alloc, [1, 2, 3, 4])
    alloc.free(table)
    assert alloc.allocate(1) == [table[1]]
    assert alloc.find_cached_prefix([1, 2, 3, 4], 2)[0] == table[:1]


def test_fork_cow_one_copy_per_shared_writer() -> None:
    alloc = BlockAllocator(16, BS)
    parent: list[int] = []
    alloc.append_slots(parent, 0, 6)
    children = [alloc.fork(parent) for _ in range(2)]
    last = parent[1]
    assert alloc.ref_count(last) == 3 and alloc.ref_count(parent[0]) == 3
    pairs = []
    for table in (children[0], children[1], parent):
        assert alloc.num_blocks_to_append(table, 6, 7) == int(alloc.ref_count(table[1]) > 1)
        pairs.append(alloc.append_slots(table, 6, 7))
    assert [len(p) for p in pairs] == [1, 1, 0] and alloc.num_cow_copies == 2
    assert all(p[0][0] == last for p in pairs[:2])
    assert parent[1] == last and alloc.ref_count(last) == 1
    assert len({children[0][1], children[1][1], last}) == 3
    assert alloc.ref_count(parent[0]) == 3
    alloc.check_invariants()


def test_no_cow_at_block_boundary() -> None:
    alloc = BlockAllocator(16, BS)
    parent: list[int] = []
    alloc.append_slots(parent, 0, 8)
    child = alloc.fork(parent)
    assert alloc.num_blocks_to_append(child, 8, 9) == 1
    assert alloc.append_slots(child, 8, 9) == [] and len(child) == 3 and child[:2] == parent
    assert alloc.num_cow_copies == 0
    assert alloc.num_blocks_to_append(parent, 8, 8) == 0 and alloc.append_slots(parent, 8, 8) == []


def test_disabled_prefix_caching_never_hits() -> None:
    alloc = BlockAllocator(8, BS, enable_prefix_caching=False)
    tokens = list(range(8))
    table, last = _seq(alloc, tokens)
    assert last is None
    alloc.free(table)
    assert alloc.find_cached_prefix(tokens, 2) == ([], [])
    assert alloc.prefix_cache_hit_rate == 0.0 and alloc.num_free_blocks == 8
    alloc.check_invariants()


@dataclass(slots=True)
class _Seq:
    """Model-side state of one live sequence."""

    table: list[int]
    tokens: list[int]
    num_cached: int
    last_hash: int | None

    def copy(self, table: list[int]) -> _Seq:
        """Model state of a fork sharing this sequence's blocks through table."""
        return _Seq(table, list(self.tokens), self.num_cached, self.last_hash)


tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=12)


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/append/fork/free/cache/lookup traffic against a small pool."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = BlockAllocator(16, BS)
        self.seqs: dict[int, _Seq] = {}
        self.next_id = 0
        # Full token prefix whose KV a block held when it was last registered for caching.
        self.kv_of: dict[int, tuple[int, ...]] = {}
        # Token lists seen so far, replayed as shared prefixes so that prefix hits and revivals are common.
        self.history: list[list[int]] = []

    def _pick(self, idx: int) -> int:
        return sorted(self.seqs)[idx % len(self.seqs)]

    def _add(self, seq: _Seq) -> None:
        self.seqs[self.next_id] = seq
        self.next_id += 1

    @rule(tokens=tokens_st)
    def new_seq(self, tokens: list[int]) -> None:
        self._start(tokens)

    @precondition(lambda self: self.history)
    @rule(idx=st.integers(0, 63), cut=st.integers(0, 16), extra=st.lists(st.integers(0, 2), max_size=6))
    def reuse_prefix(self, idx: int, cut: int, extra: list[int]) -> None:
        tokens = self.history[idx % len(self.history)][:cut] + extra
        if tokens:
            self._start(tokens)

    def _start(self, tokens: list[int]) -> None:
        self.history.append(list(tokens))
        hits, hashes = self.alloc.find_cached_prefix(tokens, len(tokens) // BS)
        self._check_hits(tokens, hits, hashes)
        self.alloc.take(hits)
        table = list(hits)
        need = self.alloc.num_blocks_to_append(table, len(hits) * BS, len(tokens))
        if not self.alloc.can_allocate(need):
            self.alloc.free(table)
            return
        assert self.alloc.append_slots(table, len(hits) * BS, len(tokens)) == []
        self._add(_Seq(table, list(tokens), len(hits), hashes[-1] if hashes else None))

    @precondition(lambda self: self.seqs)
    @rule(idx=st.integers(0, 63), extra=tokens_st)
    def append(self, idx: int, extra: list[int]) -> None:
        seq = self.seqs[self._pick(idx)]
        before, after = len(seq.tokens), len(seq.tokens) + len(extra)
        need = self.alloc.num_blocks_to_append(seq.table, before, after)
        if not self.alloc.can_allocate(need):
            return
        old_table = list(seq.table)
        old_refs = {b: self.alloc.ref_count(b) for b in old_table}
        pairs = self.alloc.append_slots(seq.table, before, after)
        assert len(seq.table) == -(-after // BS)
        assert len(pairs) == (before % BS != 0 and old_refs[old_table[before // BS]] > 1)
        for src, dst in pairs:
            idx_w = before // BS
            assert old_table[idx_w] == src and seq.table[idx_w] == dst and dst not in old_table
            assert self.alloc.ref_count(src) == old_refs[src] - 1 and self.alloc.ref_count(dst) == 1
        seq.tokens.extend(extra)
        self.history.append(list(seq.tokens))

    @precondition(lambda self: self.seqs)
    @rule(idx=st.integers(0, 63))
    def fork(self, idx: int) -> None:
        seq = self.seqs[self._pick(idx)]
        self._add(seq.copy(self.alloc.fork(seq.table)))

    @precondition(lambda self: self.seqs)
    @rule(idx=st.integers(0, 63))
    def free(self, idx: int) -> None:
        self.alloc.free(self.seqs.pop(self._pick(idx)).table)

    @precondition(lambda self: self.seqs)
    @rule(idx=st.integers(0, 63))
    def cache(self, idx: int) -> None:
        seq = self.seqs[self._pick(idx)]
        num_full = len(seq.tokens) // BS
        for i in range(seq.num_cached, num_full):
            self.kv_of[seq.table[i]] = tuple(seq.tokens[: (i + 1) * BS])
        seq.last_hash = self.alloc.cache_full_blocks(
            seq.table, seq.tokens, seq.num_cached, num_full, seq.last_hash
        )
        seq.num_cached = max(seq.num_cached, num_full)

    @precondition(lambda self: self.history)
    @rule(idx=st.integers(0, 63), max_blocks=st.integers(0, 4))
    def lookup(self, idx: int, max_blocks: int) -> None:
        tokens = self.history[idx % len(self.history)]
        queries = self.alloc.num_prefix_queries
        hits, hashes = self.alloc.find_cached_prefix(tokens, max_blocks)
        assert self.alloc.num_prefix_queries - queries == min(max_blocks, len(tokens) // BS)
        self._check_hits(tokens, hits, hashes)

    def _check_hits(self, tokens: list[int], hits: list[int], hashes: list[int]) -> None:
        assert len(hits) == len(hashes) and len(set(hits)) == len(hits)
        parent = None
        for i, (block_id, h) in enumerate(zip(hits, hashes)):
            assert self.kv_of[block_id] == tuple(tokens[: (i + 1) * BS])
            parent = ba.block_hash(parent, tuple(tokens[i * BS : (i + 1) * BS]))
            assert h == parent

    @invariant()
    def consistent(self) -> None:
        self.alloc.check_invariants()
        holders = [0] * self.alloc.num_blocks
        for seq in self.seqs.values():
            assert len(seq.table) == -(-len(seq.tokens) // BS)
            for b in seq.table:
                holders[b] += 1
        assert [self.alloc.ref_count(b) for b in range(self.alloc.num_blocks)] == holders
        assert self.alloc.num_used_blocks == sum(h > 0 for h in holders)
        assert self.alloc.num_free_blocks + self.alloc.num_used_blocks == self.alloc.num_blocks
        assert 0.0 <= self.alloc.prefix_cache_hit_rate <= 1.0

    def teardown(self) -> None:
        for seq in self.seqs.values():
            self.alloc.free(seq.table)
        self.seqs.clear()
        self.alloc.check_invariants()
        assert self.alloc.num_free_blocks == self.alloc.num_blocks and self.alloc.num_used_blocks == 0


AllocatorMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestAllocatorMachine = AllocatorMachine.TestCase
