"""The dashboard's block map: the allocator's states, and their encoding (shared.kv_map)."""

from __future__ import annotations

import base64
import zlib

import pytest

from gpu_worker.engine.block_allocator import BlockAllocator
from shared.kv_map import CACHED, FREE, SHARED, USED, count_states, decode_states, encode_states


def test_the_allocator_reports_each_block_s_state() -> None:
    allocator = BlockAllocator(8, 4)
    used, shared, cached = allocator.allocate(1), allocator.allocate(2), allocator.allocate(2)
    allocator.fork(shared)  # two sequences reference both blocks
    allocator.cache_full_blocks(cached, list(range(8)), 0, 2, None)
    allocator.free(cached)  # cached, referenced by none: evictable
    states = allocator.block_states()
    assert [states[b] for b in used] == [USED]
    assert [states[b] for b in shared] == [SHARED, SHARED]
    assert [states[b] for b in cached] == [CACHED, CACHED]
    assert count_states(states) == {"free": 3, "used": 1, "shared": 2, "cached": 2}
    # What the heartbeat calls free is free and evictable together.
    assert states.count(FREE) + states.count(CACHED) == allocator.num_free_blocks


def test_a_block_referenced_more_than_255_times_is_shared() -> None:
    allocator = BlockAllocator(2, 4)
    table = allocator.allocate(1)
    for _ in range(300):
        allocator.fork(table)
    assert allocator.block_states() == bytes([SHARED, FREE])


def test_the_encoding_round_trips_and_refuses_what_is_not_a_map() -> None:
    states = bytes([FREE] * 50_000 + [USED] * 30_000 + [CACHED] * 20_000)
    encoded = encode_states(states)
    assert decode_states(encoded) == states and len(encoded) < 2_000  # runs compress to little
    for bad in ("not base64!", base64.b64encode(b"not deflated").decode(), encode_states(bytes([7]))):
        with pytest.raises(ValueError, match="not a KV map"):
            decode_states(bad)
    assert decode_states(base64.b64encode(zlib.compress(b"")).decode()) == b""
