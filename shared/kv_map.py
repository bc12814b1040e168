"""A worker's KV pool block by block, as the dashboard draws it: one state per block, sent compactly beside
the heartbeat (no torch).

The states are one byte per block (FREE, USED, SHARED, CACHED), deflated (zlib) and base64-encoded: a pool's
blocks come in long runs of one state, so 100,000 blocks take 616 bytes all free and 1.7 KB busy, and 44 KB
with every state drawn at random, the worst case; building and encoding the map takes 0.6 to 1.5 ms, once
a heartbeat (`benchmarks/kv_map.py`). The page inflates it with the browser's DecompressionStream("deflate").
"""

from __future__ import annotations

import base64
import zlib

FREE, USED, SHARED, CACHED = 0, 1, 2, 3
STATE_NAMES = {FREE: "free", USED: "used", SHARED: "shared", CACHED: "cached"}
# zlib's fastest level: the map is rewritten every heartbeat, and runs compress well at any level.
COMPRESSION_LEVEL = 1


def encode_states(states: bytes) -> str:
    """The blocks' states (one byte each) as the text stored beside the heartbeat."""
    return base64.b64encode(zlib.compress(states, COMPRESSION_LEVEL)).decode("ascii")


def decode_states(text: str) -> bytes:
    """The inverse of encode_states; ValueError when text is not such a map."""
    try:
        states = zlib.decompress(base64.b64decode(text, validate=True))
    except (ValueError, zlib.error) as exc:
        raise ValueError(f"not a KV map: {exc}") from exc
    if states.translate(None, bytes(STATE_NAMES)):
        raise ValueError("not a KV map: a block state out of range")
    return states


def count_states(states: bytes) -> dict[str, int]:
    """Blocks per state name (every name present)."""
    return {name: states.count(state) for state, name in STATE_NAMES.items()}
