"""Per-request sampling parameters, named as in vLLM and the OpenAI API."""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import model_validator

from shared.sampling import SamplingSpec

_EPS = 1e-5


class SamplingParams(SamplingSpec):
    """How one request is sampled and when it stops: the wire's SamplingSpec (shared.sampling: every option,
    its range and the combinations refused) plus what only the offline API has. temperature 0 means greedy.
    A value out of range raises ValueError (pydantic's ValidationError)."""

    skip_special_tokens: bool = True

    @model_validator(mode="after")
    def _normalize(self) -> SamplingParams:
        if self.temperature < _EPS:
            # Greedy: the truncation knobs mean nothing, and dropping them keeps the fast path simple.
            self.temperature, self.top_p, self.top_k, self.min_p = 0.0, 1.0, 0, 0.0
        if self.top_k == -1:
            self.top_k = 0
        return self

    @classmethod
    def of(cls, spec: SamplingSpec, **overrides: object) -> SamplingParams:
        """The engine's parameters for a wire spec (overrides win); raises ValueError for refused values."""
        return cls.model_validate({**dict(spec), **overrides})

    def stop_ids(self, eos_token_ids: Iterable[int]) -> set[int]:
        """The tokens that end a sample: its stop_token_ids, and the model's EOS unless ignore_eos."""
        return set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def shapes_logits(self) -> bool:
        """Whether logit_bias or allowed_token_ids change this request's logits before sampling."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None
