"""Per-request sampling parameters, named as in vLLM and the OpenAI API."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from shared.protocol import StructuredSpec

_EPS = 1e-5


@dataclass(slots=True)
class SamplingParams:
    """How one request is sampled and when it stops. temperature 0 means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k: the chosen token's and the top k
    # None: none; k: each prompt token's logprob given the tokens before it, and the top k alternatives.
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # None: any token may be sampled
    skip_special_tokens: bool = True
    structured: StructuredSpec | None = None  # None: free text; else the grammar the output follows
    use_beam_search: bool = False  # beam search over best_of beams, returning the n best
    best_of: int | None = None  # beam search: the beam width (None: n)
    length_penalty: float = 1.0  # beam search: a finished beam scores sum(logprobs) / length**length_penalty

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if not self.temperature >= 0:  # written so that NaN fails too
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0 or not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError("min_tokens must be in [0, max_tokens]")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}")
        if not all(-100.0 <= bias <= 100.0 for bias in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must name at least one token")
        if self.best_of is not None and not self.best_of >= max(self.n, 1):
            raise ValueError(f"best_of must be at least n ({self.n}), got {self.best_of}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be finite, got {self.length_penalty}")
        if self.temperature < _EPS:
            # Greedy: the truncation knobs mean nothing, and dropping them keeps the fast path simple.
            self.temperature, self.top_p, self.top_k, self.min_p = 0.0, 1.0, 0, 0.0
        if self.top_k == -1:
            self.top_k = 0

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
