"""The chained hash of a KV block: what a worker's prefix cache is keyed by, and what the scheduler matches a
prompt against. One function, used by both sides (no torch).

Block i of a token sequence holds tokens [i * block_size, (i + 1) * block_size); its hash covers its tokens
and the hash of block i - 1, so equal hashes mean (up to a collision) an equal prefix, not only equal blocks.
Only full blocks are hashed: a partly filled block is never shared.

Python's hash of a tuple of ints is the same in every process and on every 64-bit platform (PYTHONHASHSEED
seeds str and bytes only), so a hash computed by the scheduler finds the block a worker cached. A collision
costs the worker nothing (its cache compares the tokens before it reuses a block), and the scheduler at
worst routes one request to a worker that holds less of its prompt than it thought.
"""

from __future__ import annotations

from collections.abc import Sequence

ROOT_PARENT = -1  # what block 0 chains from (hash(None) varied between processes before Python 3.12)


def block_hash(parent_hash: int | None, tokens: tuple[int, ...]) -> int:
    """Chained hash of one full block, given the hash of the block before it (None for block 0)."""
    return hash((ROOT_PARENT if parent_hash is None else parent_hash, tokens))


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    first_block: int = 0,
    end_block: int | None = None,
    parent_hash: int | None = None,
) -> list[int]:
    """Chained hashes of the full blocks first_block..end_block-1 of token_ids (all full blocks by default);
    parent_hash is the hash of block first_block - 1."""
    end = len(token_ids) // block_size if end_block is None else end_block
    hashes = []
    for i in range(first_block, end):
        parent_hash = block_hash(parent_hash, tuple(token_ids[i * block_size : (i + 1) * block_size]))
        hashes.append(parent_hash)
    return hashes
