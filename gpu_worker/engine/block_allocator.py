"""Reference-counted KV-cache block allocator with a hash-chained prefix cache and copy-on-write."""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from shared.kv_map import CACHED, FREE, SHARED, USED
from shared.prefix import block_hash, block_hashes

# A reference count (below 256) to its block state: 0 free, 1 used, more shared (evictable ones set after).
_REF_TO_STATE = bytes([FREE, USED] + [SHARED] * 254)


@dataclass(slots=True, frozen=True)
class CachedBlock:
    """Prefix-cache record of one full block, kept so a hash hit can be verified against real content."""

    block_hash: int
    parent_hash: int | None
    tokens: tuple[int, ...]


class BlockAllocator:
    """Allocates fixed-size KV blocks with refcounts, an LRU-evictable prefix cache and copy-on-write."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        """Create a pool of num_blocks free blocks of block_size token slots each."""
        assert num_blocks > 0 and block_size > 0
        self.num_blocks: int = num_blocks
        self.block_size: int = block_size
        self.enable_prefix_caching: bool = enable_prefix_caching
        self._ref: list[int] = [0] * num_blocks
        self._num_used: int = 0
        self._free: deque[int] = deque(range(num_blocks))
        # Insertion order is free order, so the head is the least recently freed cached block.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[int, CachedBlock] = {}
        self._hash_to_block: dict[int, int] = {}
        self.num_prefix_queries: int = 0
        self.num_prefix_hits: int = 0
        self.num_cow_copies: int = 0
        self.num_evictions: int = 0
        # With record_kv_events(): each hash whose presence in the prefix cache changed since the last
        # take_kv_events(), and whether it is held now (the last change wins).
        self._kv_changes: dict[int, bool] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now: plain free plus evictable cached blocks."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with a reference count above zero."""
        return self._num_used

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Fraction of looked-up full blocks that were prefix-cache hits."""
        return self.num_prefix_hits / self.num_prefix_queries if self.num_prefix_queries else 0.0

    def ref_count(self, block_id: int) -> int:
        """Current reference count of a block."""
        return self._ref[block_id]

    def record_kv_events(self) -> None:
        """From now on, note what the prefix cache stores and evicts, for take_kv_events()."""
        self._kv_changes = {}

    def take_kv_events(self) -> tuple[list[int], list[int]]:
        """The block hashes stored and removed since the last call (each hash in at most one of the two)."""
        changes, self._kv_changes = self._kv_changes, {}
        if not changes:
            return [], []
        return [h for h, held in changes.items() if held], [h for h, held in changes.items() if not held]

    def block_states(self) -> bytes:
        """Each block's state, one byte a block (shared.kv_map): free, used by one sequence, shared by more
        than one, or cached and evictable (in the prefix cache, used by none)."""
        try:
            states = bytearray(bytes(self._ref).translate(_REF_TO_STATE))  # 0 free, 1 used, 2+ shared
        except ValueError:  # a block referenced 256 times or more
            states = bytearray(map(min, self._ref, itertools.repeat(SHARED)))
        for block_id in self._evictable:
            states[block_id] = CACHED
        return bytes(states)

    def cached_hashes(self) -> list[int]:
        """Every block hash the prefix cache holds now (in use or evictable)."""
        return list(self._hash_to_block)

    def block_hashes(
        self, token_ids: Sequence[int], first_block: int, end_block: int, parent_hash: int | None
    ) -> list[int]:
        """Chained hashes of full blocks first_block..end_block-1 of token_ids (parent_hash: block before)."""
        return block_hashes(token_ids, self.block_size, first_block, end_block, parent_hash)

    def find_cached_prefix(self, token_ids: Sequence[int], max_blocks: int) -> tuple[list[int], list[int]]:
        """Longest chain of cached full blocks matching the start of token_ids; takes no references."""
        if not self.enable_prefix_caching:
            return [], []
        bs = self.block_size
        n = max(0, min(max_blocks, len(token_ids) // bs))
        block_ids: list[int] = []
        hashes: list[int] = []
        parent: int | None = None
        for i in range(n):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = block_hash(parent, tokens)
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            record = self._cached[block_id]
            # A hash match alone could be a collision; only identical content and ancestry is a real hit.
            if record.tokens != tokens or record.parent_hash != parent:
                break
            block_ids.append(block_id)
            hashes.append(h)
            parent = h
        self.num_prefix_queries += n
        self.num_prefix_hits += len(block_ids)
        return block_ids, hashes

    def take(self, block_ids: Sequence[int]) -> None:
        """Add one reference to each block, reviving evictable cached blocks."""
        for block_id in block_ids:
            if self._ref[block_id] == 0:
                assert block_id in self._evictable, f"block {block_id} is free and uncached"
                del self._evictable[block_id]
                self._num_used += 1
            self._ref[block_id] += 1

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether num_blocks fresh blocks can be allocated now."""
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        """Return num_blocks fresh blocks with refcount 1, evicting LRU cached blocks only when needed."""
        assert num_blocks >= 0
        assert self.can_allocate(num_blocks), f"need {num_blocks} blocks, {self.num_free_blocks} free"
        out: list[int] = []
        for _ in range(num_blocks):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                self._uncache(block_id)
                self.num_evictions += 1
            self._ref[block_id] = 1
            out.append(block_id)
        self._num_used += num_blocks
        return out

    def free(self, block_table: Sequence[int]) -> None:
        """Drop one reference from each block, tail first so tail blocks are evicted before prefixes."""
        for block_id in reversed(block_table):
            assert self._ref[block_id] > 0, f"double free of block {block_id}"
            self._ref[block_id] -= 1
            if self._ref[block_id] == 0:
                self._num_used -= 1
                if block_id in self._cached:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)

    def fork(self, block_table: Sequence[int]) -> list[int]:
        """Share every block of block_table with a new table."""
        self.take(block_table)
        return list(block_table)

    def _cow_index(self, block_table: Sequence[int], num_tokens_before: int, num_tokens_after: int) -> int:
        """Index of the shared partly-filled block the append would write into, or -1 if none."""
        assert len(block_table) * self.block_size >= num_tokens_before, "block table too short"
        if num_tokens_after <= num_tokens_before or num_tokens_before % self.block_size == 0:
            return -1
        idx = num_tokens_before // self.block_size
        return idx if self._ref[block_table[idx]] > 1 else -1

    def num_blocks_to_append(
        self, block_table: Sequence[int], num_tokens_before: int, num_tokens_after: int
    ) -> int:
        """Blocks needed to grow block_table to num_tokens_after tokens, including one for copy-on-write."""
        needed = max(0, -(-num_tokens_after // self.block_size) - len(block_table))
        cow = self._cow_index(block_table, num_tokens_before, num_tokens_after) >= 0
        return needed + int(cow)

    def append_slots(
        self, block_table: list[int], num_tokens_before: int, num_tokens_after: int
    ) -> list[tuple[int, int]]:
        """Grow block_table in place to hold num_tokens_after tokens; return the CoW (src, dst) pairs."""
        # Checked up front so a failed call leaves the table and the pool untouched.
        assert self.can_allocate(self.num_blocks_to_append(block_table, num_tokens_before, num_tokens_after))
        copies: list[tuple[int, int]] = []
        idx = self._cow_index(block_table, num_tokens_before, num_tokens_after)
        if idx >= 0:
            src = block_table[idx]
            (dst,) = self.allocate(1)
            self._ref[src] -= 1  # stays > 0: it was shared
            block_table[idx] = dst
            copies.append((src, dst))
            self.num_cow_copies += 1
        needed = -(-num_tokens_after // self.block_size) - len(block_table)
        if needed > 0:
            block_table.extend(self.allocate(needed))
        return copies

    def cache_full_blocks(
        self,
        block_table: Sequence[int],
        token_ids: Sequence[int],
        num_cached_blocks: int,
        num_full_blocks: int,
        parent_hash: int | None,
    ) -> int | None:
        """Put block_table[num_cached_blocks:num_full_blocks] in the prefix cache; return the last hash."""
        if not self.enable_prefix_caching or num_full_blocks <= num_cached_blocks:
            return parent_hash
        bs = self.block_size
        assert len(token_ids) >= num_full_blocks * bs and len(block_table) >= num_full_blocks
        for i in range(num_cached_blocks, num_full_blocks):
            block_id = block_table[i]
            assert self._ref[block_id] > 0, f"caching unreferenced block {block_id}"
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = block_hash(parent_hash, tokens)
            existing = self._cached.get(block_id)
            if existing is not None:
                assert existing.block_hash == h, f"block {block_id} re-cached with different content"
            elif h not in self._hash_to_block:
                # Another block holding this hash stays the canonical copy; this one stays uncached.
                self._cached[block_id] = CachedBlock(h, parent_hash, tokens)
                self._hash_to_block[h] = block_id
                if self._kv_changes is not None:
                    self._kv_changes[h] = True
            parent_hash = h
        return parent_hash

    def _uncache(self, block_id: int) -> None:
        """Remove a block from the prefix cache."""
        record = self._cached.pop(block_id)
        del self._hash_to_block[record.block_hash]
        if self._kv_changes is not None:
            self._kv_changes[record.block_hash] = False

    def check_invariants(self) -> None:
        """Assert the internal bookkeeping is consistent (O(num_blocks); for tests and debugging)."""
        assert all(r >= 0 for r in self._ref), "negative refcount"
        used = {b for b, r in enumerate(self._ref) if r > 0}
        free = set(self._free)
        evictable = set(self._evictable)
        assert len(free) == len(self._free), "duplicate in free list"
        assert len(used) == self._num_used, "used counter out of sync"
        assert not (free & used) and not (evictable & used) and not (free & evictable), "block in two states"
        assert len(free) + len(evictable) + len(used) == self.num_blocks, "blocks leaked"
        assert all(b in self._cached for b in evictable), "evictable block not cached"
        assert not (free & self._cached.keys()), "cached block on plain free list"
        assert len(self._hash_to_block) == len(self._cached), "hash map and records disagree"
        for h, block_id in self._hash_to_block.items():
            record = self._cached[block_id]
            assert record.block_hash == h and len(record.tokens) == self.block_size
            assert record.block_hash == block_hash(record.parent_hash, record.tokens)
        if not self.enable_prefix_caching:
            assert not self._cached
