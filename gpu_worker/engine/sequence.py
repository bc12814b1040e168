"""One sequence: its tokens, its block table and how far its KV cache has caught up."""

from __future__ import annotations

import enum
import time

from llguidance import LLMatcher

from gpu_worker.engine.sampling_params import SamplingParams
from gpu_worker.engine.speculative import SpecState


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Sequence:
    """A prompt and the tokens sampled after it; one per sample of a request (n > 1 gives n of them)."""

    __slots__ = (
        "arrival",
        "arrival_time",
        "block_table",
        "draft_token_ids",
        "finish_reason",
        "first_scheduled_time",
        "first_token_time",
        "index",
        "last_block_hash",
        "last_token_time",
        "logprobs",
        "matcher",
        "num_cached_blocks",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_pending_forks",
        "num_prompt_tokens",
        "num_step_tokens",
        "params",
        "priority",
        "prompt_logprobs",
        "prompt_top_logprobs",
        "request_id",
        "seed",
        "seq_id",
        "spec",
        "status",
        "token_ids",
        "top_logprobs",
    )

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        index: int = 0,
        priority: int = 0,
        arrival: int = 0,
    ) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index
        self.params = params
        self.priority = priority
        self.arrival = arrival
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        # Tokens whose K/V are in the cache; catches up to num_tokens (prefill, chunks, hits, recompute).
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        # Leading full blocks registered in the prefix cache, and the hash of the last of them.
        self.num_cached_blocks = 0
        self.last_block_hash: int | None = None
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        # The seed of this sample's draws (None: greedy, or the global generator); see Sampler.
        self.seed: int | None = None
        # Samples still to be forked from this one once its prompt is computed (n > 1).
        self.num_pending_forks = params.n - 1
        # Structured output: the grammar matcher, in step with the output tokens (None: free text).
        self.matcher: LLMatcher | None = None
        # Speculative decoding: the tokens this step verifies after the last one, and the proposer's state.
        self.draft_token_ids: list[int] = []
        self.spec: SpecState | None = None
        # Tokens the last step appended (more than one when drafts were accepted).
        self.num_step_tokens = 0
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] = []
        # Entry j: prompt token j + 1 given the tokens before it (params.prompt_logprobs only).
        self.prompt_logprobs: list[float] = []
        self.prompt_top_logprobs: list[dict[int, float]] = []
        # Prompt tokens found in the prefix cache when first scheduled (None: not scheduled yet).
        self.num_cached_tokens: int | None = None
        # time.monotonic() of its arrival in the engine, first scheduled step, first and last sampled token.
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt logprobs were asked for and some prompt position still has to be computed."""
        return (
            self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sort_key(self) -> tuple[int, int, int]:
        """Scheduling order: priority (lower first), then arrival, then sample index."""
        return (self.priority, self.arrival, self.index)

    def reset_computed(self) -> None:
        """Forget the KV cache (preemption by recompute); the tokens stay."""
        self.num_computed_tokens = 0
        self.block_table = []
        self.num_cached_blocks = 0
        self.last_block_hash = None

    def fork(self, seq_id: int, index: int, block_table: list[int]) -> Sequence:
        """A sibling sample sharing this sequence's tokens and (already shared) blocks."""
        child = Sequence(
            seq_id,
            self.request_id,
            self.token_ids[: self.num_prompt_tokens],
            self.params,
            index=index,
            priority=self.priority,
            arrival=self.arrival,
        )
        child.token_ids = list(self.token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.block_table = block_table
        child.num_cached_blocks = self.num_cached_blocks
        child.last_block_hash = self.last_block_hash
        child.status = self.status
        child.num_pending_forks = 0
        # Its own grammar state: siblings diverge from the first token on.
        child.matcher = self.matcher.deep_copy() if self.matcher is not None else None
        # Complete by now (forks are born when the prompt is computed), so shared rather than copied.
        child.prompt_logprobs = self.prompt_logprobs
        child.prompt_top_logprobs = self.prompt_top_logprobs
        child.num_cached_tokens = self.num_cached_tokens
        child.arrival_time = self.arrival_time
        child.first_scheduled_time = self.first_scheduled_time
        return child
