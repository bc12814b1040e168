"""What an engine reports: pool occupancy, cache and step counters (a worker's heartbeat carries them)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from shared.protocol import ITERATION_TOKENS_BUCKETS


@dataclass(slots=True)
class IterationTokens:
    """Histogram of tokens per engine step (prompt tokens computed plus tokens sampled in the step)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_TOKENS_BUCKETS) + 1))
    total: int = 0

    def observe(self, num_tokens: int) -> None:
        self.counts[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, num_tokens)] += 1
        self.total += num_tokens

    def cumulative(self) -> list[int]:
        """Observations at or below each bound, then all of them (Prometheus's `le` buckets and +Inf)."""
        out: list[int] = []
        running = 0
        for count in self.counts:
            running += count
            out.append(running)
        return out


@dataclass(slots=True)
class EngineStats:
    """What a worker reports: pool occupancy, batch sizes and the counters of the paged cache."""

    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    num_running: int
    num_waiting: int
    num_live_token_slots: int  # KV slots holding a computed token of a live sequence (shared slots once)
    num_allocated_slots: int  # slots of blocks referenced by some sequence
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_cow_copies: int
    prefix_cache_queries: int  # prompt tokens of new sequences looked up in the prefix cache, since start
    prefix_cache_hits: int  # ... and found there
    iteration_tokens_buckets: list[int]  # cumulative, per ITERATION_TOKENS_BUCKETS bound, then all steps
    iteration_tokens_sum: int
    # Speculative decoding, since start (all 0 with it off): verifies, draft tokens, accepted ones, and
    # accepted ones by draft position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)

    @property
    def slot_utilization(self) -> float:
        return self.num_live_token_slots / self.num_allocated_slots if self.num_allocated_slots else 1.0
