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

When it does not pay it is off. Per sequence, the number of drafts follows its acceptance: as many as
maximise the tokens a step is expected to yield per unit of its time, DRAFT_COST each, and none where one
costs more than it brings. The acceptance is learnt from every verify, and also while the sequence does not
draft: the proposal it would have made is compared with the token that came (a shadow trial, free), so a
sequence whose text starts repeating its input drafts again within a few steps, and one writing free prose
stops verifying at all. And no sequence drafts in a step whose batch holds disable_by_batch_size sequences or
more (there the extra tokens cost compute the batch no longer has to spare).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# A sequence's acceptance is its running estimate of the chance that a draft is right when those before it
# were: the newest verify weighs ACCEPTANCE_WEIGHT, the newest shadow trial SHADOW_WEIGHT.
INITIAL_ACCEPTANCE = 0.6
ACCEPTANCE_WEIGHT = 0.5
SHADOW_WEIGHT = 0.3
# What one more draft adds to a step's time, as a fraction of a one-token step: on the CPU (SmolLM2-135M,
# fp32, batch 1) a few drafts make a step a few tens of percent longer, and the verify's own work (the sampler
# once per position) adds to that. In a batch of b sequences a draft is weighed against the step's b tokens,
# so it costs b times as much to each: with acceptance below b * DRAFT_COST a sequence does not draft.
DRAFT_COST = 0.1


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
    """One sequence's speculation: its n-gram index, its acceptance, and the draft it would have verified in
    its last step had it drafted (its shadow: the token and the position it was for)."""

    index: NgramIndex
    acceptance: float = INITIAL_ACCEPTANCE
    shadow: int | None = None
    shadow_at: int = 0

    def num_drafts(self, most: int, cost: float = DRAFT_COST) -> int:
        """How many drafts pay best at this acceptance a, each costing `cost` of a step: the k in [0, most]
        maximising (1 + a + ... + a^k) / (1 + k cost)."""
        best, best_yield, expected, term = 0, 1.0, 1.0, 1.0
        for k in range(1, most + 1):
            term *= self.acceptance
            expected += term
            tokens_per_time = expected / (1 + cost * k)
            if tokens_per_time > best_yield:
                best, best_yield = k, tokens_per_time
        return best

    def observe(self, num_draft: int, num_accepted: int) -> None:
        """After a verify: each draft up to the first rejected one was a trial."""
        trials = num_accepted + (num_accepted < num_draft)
        self._learn(num_accepted / trials, ACCEPTANCE_WEIGHT)

    def score_shadow(self, token_ids: list[int]) -> None:
        """Compare the shadow draft with the token that came in its place, once it has."""
        if self.shadow is not None and len(token_ids) > self.shadow_at:
            self._learn(float(token_ids[self.shadow_at] == self.shadow), SHADOW_WEIGHT)
            self.shadow = None

    def _learn(self, rate: float, weight: float) -> None:
        self.acceptance = (1 - weight) * self.acceptance + weight * rate


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
        self.draft_cost = DRAFT_COST  # of the step being scheduled (begin_step)

    def begin_step(self, batch_size: int) -> None:
        """The step about to be given drafts runs batch_size sequences."""
        self.draft_cost = DRAFT_COST * batch_size

    def propose(
        self, state: SpecState | None, token_ids: list[int], limit: int
    ) -> tuple[SpecState, list[int]]:
        """The sequence's state (new on its first call) and at most `limit` draft tokens: none where they
        do not pay, and then the first of them is kept as the shadow trial."""
        config = self.config
        if state is None:
            state = SpecState(NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max))
        state.score_shadow(token_ids)
        num_drafts = state.num_drafts(min(limit, config.num_speculative_tokens), self.draft_cost)
        drafts = state.index.propose(token_ids, max(num_drafts, 1))
        if num_drafts == 0:
            if drafts:
                state.shadow, state.shadow_at = drafts[0], len(token_ids)
            return state, []
        return state, drafts

    def observe(self, state: SpecState, num_draft: int, num_accepted: int) -> None:
        state.observe(num_draft, num_accepted)
        self.stats.observe(num_draft, num_accepted)
