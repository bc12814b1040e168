"""Speculative decoding by n-gram prompt lookup: a sequence's next tokens are proposed from what followed the
latest earlier occurrence of its last n tokens (in its prompt or its output), verified in the next step as a
short chunk over the paged cache, and kept as far as the model agrees.

Verification samples each drafted position from the model's own distribution (the sampler, with penalties,
grammar and the seeded draw of that position) and accepts a draft while it equals what was sampled; the
first token that differs is kept in its place and ends the run. A proposal here is one token for certain (a
point mass q), so this is the speculative-sampling rule itself: a draft d is accepted with probability
p(d) = min(1, p(d) / q(d)), and a rejected one is replaced by a draw from p without d, renormalised, which is
norm(max(0, p - q)). Every token therefore has exactly the distribution it has without speculation, and a
seeded request, whose draws depend on its seed and the token's position only, gets the same tokens.

When it does not pay it is off: per sequence, after drafts that were mostly rejected it pauses (longer each
time it fails again), and no sequence drafts in a step whose batch holds disable_by_batch_size sequences or
more (there the extra tokens cost compute the batch no longer has to spare).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Acceptance below which a sequence pauses its drafts, the weight of the newest verify in its running
# acceptance, and the longest pause (in steps) that repeated failures reach.
MIN_ACCEPTANCE = 0.3
ACCEPTANCE_WEIGHT = 0.5
MAX_PAUSE_STEPS = 64


class SpeculativeConfig(BaseModel):
    """vLLM's speculative_config for its n-gram method: `{"method": "ngram", "num_speculative_tokens": 4,
    "prompt_lookup_max": 4, "prompt_lookup_min": 2}`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram"] = Field(description="how drafts are proposed: ngram (prompt lookup)")
    num_speculative_tokens: int = Field(ge=1, le=16, description="draft tokens verified per step at most")
    prompt_lookup_max: int = Field(default=4, ge=1, le=16, description="longest n-gram looked up")
    prompt_lookup_min: int = Field(default=2, ge=1, le=16, description="shortest n-gram looked up")
    disable_by_batch_size: int = Field(
        default=8, ge=1, description="no drafts in a step that runs this many sequences or more"
    )

    @model_validator(mode="after")
    def _window(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must not be above "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        return self


class NgramIndex:
    """Where each n-gram (n in [n_min, n_max]) of a token list last ended, kept up to date as it grows."""

    __slots__ = ("_indexed", "_last_end", "n_max", "n_min")

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self._last_end: dict[tuple[int, ...], int] = {}  # keyed by the n-gram itself: lengths do not collide
        self._indexed = 0  # n-grams ending before this position are in _last_end

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix n-gram."""
        end = len(token_ids) - 1  # the suffix ends here; earlier n-grams end before it
        last_end = self._last_end
        for stop in range(self._indexed, end):
            for n in range(self.n_min, min(self.n_max, stop + 1) + 1):
                last_end[tuple(token_ids[stop + 1 - n : stop + 1])] = stop
        self._indexed = max(self._indexed, end)
        for n in range(min(self.n_max, end + 1), self.n_min - 1, -1):
            found = last_end.get(tuple(token_ids[end + 1 - n :]))
            if found is not None:
                return token_ids[found + 1 : found + 1 + k]
        return []


@dataclass(slots=True)
class SpecState:
    """One sequence's speculation: its n-gram index, its running acceptance and its pause."""

    index: NgramIndex
    acceptance: float = 1.0
    paused_for: int = 0  # steps left without drafts
    next_pause: int = 2  # the pause after the next failure (doubles up to MAX_PAUSE_STEPS)

    def observe(self, num_draft: int, num_accepted: int) -> None:
        """After a verify: pause when acceptance has fallen low; a good verify makes the next pause short."""
        rate = num_accepted / num_draft
        self.acceptance = (1 - ACCEPTANCE_WEIGHT) * self.acceptance + ACCEPTANCE_WEIGHT * rate
        if self.acceptance >= MIN_ACCEPTANCE:
            if rate >= MIN_ACCEPTANCE:
                self.next_pause = 2
            return
        self.paused_for = self.next_pause
        self.next_pause = min(2 * self.next_pause, MAX_PAUSE_STEPS)
        self.acceptance = MIN_ACCEPTANCE  # on resuming, one bad verify pauses it again


@dataclass(slots=True)
class SpecDecodeStats:
    """Counters since start, as vLLM names them: verifies, drafts, accepted drafts, accepted by position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft:
            self.accepted_per_position += [0] * (num_draft - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1


class NgramSpeculator:
    """Proposes each decoding sequence's drafts, and learns from how they fared."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.stats = SpecDecodeStats()
        self.stats.accepted_per_position = [0] * config.num_speculative_tokens

    def propose(
        self, state: SpecState | None, token_ids: list[int], limit: int
    ) -> tuple[SpecState, list[int]]:
        """The sequence's state (new on its first call) and at most `limit` draft tokens (none while it is
        paused)."""
        config = self.config
        if state is None:
            state = SpecState(NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max))
        if state.paused_for > 0:
            state.paused_for -= 1
            return state, []
        return state, state.index.propose(token_ids, min(limit, config.num_speculative_tokens))

    def observe(self, state: SpecState, num_draft: int, num_accepted: int) -> None:
        state.observe(num_draft, num_accepted)
        self.stats.observe(num_draft, num_accepted)
