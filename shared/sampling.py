"""How to sample: the one definition of every sampling option, its default, its range and what it may not be
combined with.

Every other shape is derived from these models, never copied field by field:
- the API's request bodies (gateway.serving.schemas.SamplingBody) inherit SamplingOptions, the options a body
  carries as they are, and add the fields each endpoint reads its own way (max_tokens, logprobs, the
  structured output);
- the wire carries a SamplingSpec (inside shared.protocol.GenerateRequest), which the gateway builds from a
  body and whose validator refuses what cannot be served together (a SamplingProblem naming the parameter);
- the engine's SamplingParams (gpu_worker.engine.sampling_params) is a SamplingSpec with the offline API's
  own additions, so `LLM.generate` checks the same ranges and the same combinations.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

MAX_LOGPROBS = 20  # top logprobs per token, for the output and the prompt
MAX_SAMPLES = 128
MAX_BEAM_WIDTH = 16
_INT64 = 2**63
_DECIMAL = re.compile(r"[0-9]{1,10}")
_MAX_NAMED = 8  # bad logit_bias keys an error names

TokenId = Annotated[int, Field(ge=0)]
MaxTokens = Annotated[int, Field(ge=1)]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


def _token_id_keys(value: Any) -> Any:
    """JSON object keys are strings: logit_bias names its token ids as decimal strings ("50256")."""
    if not isinstance(value, dict):
        return value
    ids: dict[Any, Any] = {}
    bad = []
    for key, bias in value.items():
        if isinstance(key, str) and _DECIMAL.fullmatch(key):
            ids[int(key)] = bias
        elif isinstance(key, int) and not isinstance(key, bool):
            ids[key] = bias
        else:
            bad.append(repr(str(key)[:20]))
    if bad:
        named = ", ".join(bad[:_MAX_NAMED]) + (
            f" and {len(bad) - _MAX_NAMED} more" if len(bad) > _MAX_NAMED else ""
        )
        raise ValueError(f"logit_bias keys must be token ids written in decimal, not {named}")
    return ids


LogitBias = Annotated[
    dict[int, Annotated[float, Field(ge=-100.0, le=100.0)]],
    BeforeValidator(_token_id_keys),
    Field(
        description="token id (a decimal string) -> bias in [-100, 100] added to its logit before sampling",
        json_schema_extra={"propertyNames": {"pattern": "^[0-9]{1,10}$"}},
    ),
]

StructuredKind = Literal["json", "json_object", "regex", "choice", "grammar"]


class StructuredSpec(BaseModel):
    """What a structured output must follow: a JSON schema (as text), any JSON object, a regular expression,
    one of a JSON list of strings, or a grammar (Lark or GBNF). shared.structured turns it into a grammar."""

    model_config = ConfigDict(extra="forbid")

    kind: StructuredKind
    value: str = ""


class SamplingOptions(BaseModel):
    """The sampling options a request body carries as they are, named as in the OpenAI API and vLLM."""

    n: Annotated[int, Field(ge=1, le=MAX_SAMPLES)] = 1
    temperature: Annotated[float, Field(ge=0.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = Field(
        default=0, description="the k most likely tokens; 0 or -1: all"
    )
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    seed: Annotated[int, Field(ge=-_INT64, lt=_INT64)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    ignore_eos: bool = False
    logit_bias: LogitBias = Field(default_factory=dict)
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = Field(
        default=None, description="only these token ids may be sampled (vLLM)"
    )
    use_beam_search: bool = Field(
        default=False, description="beam search over best_of beams (default n), returning the n best (vLLM)"
    )
    best_of: Annotated[int, Field(ge=1, le=MAX_BEAM_WIDTH)] | None = Field(
        default=None, description=f"the beam width, at most {MAX_BEAM_WIDTH}; only with use_beam_search"
    )
    length_penalty: float = Field(
        default=1.0,
        description="beam search: a finished beam scores its summed logprobs / length**length_penalty",
    )
    prompt_logprobs: NumLogprobs | None = Field(
        default=None,
        description="each prompt token's logprob and the top k (vLLM); not with stream when above 0",
    )

    @field_validator("length_penalty")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("length_penalty must be a finite number")
        return value


class SamplingProblem(ValueError):
    """Options that cannot be served together, and the parameter a client is pointed at."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class SamplingSpec(SamplingOptions):
    """How to sample and when to stop: the one definition on the wire, and the base of the engine's params."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: MaxTokens | None = 16  # None: up to the model's context
    logprobs: NumLogprobs | None = None  # None: none; k: the chosen token's and the top k
    structured: StructuredSpec | None = None  # None: free text; else the grammar the output follows

    @model_validator(mode="after")
    def _servable(self) -> SamplingSpec:
        problem = sampling_problem(self)
        if problem is not None:
            raise problem
        return self

    def beam_width(self) -> int:
        return self.best_of if self.best_of is not None else self.n


def sampling_problem(spec: SamplingSpec) -> SamplingProblem | None:
    """The first combination spec asks for that cannot be served, or None."""
    if spec.max_tokens is not None and spec.min_tokens > spec.max_tokens:
        return SamplingProblem(
            f"min_tokens ({spec.min_tokens}) is more than max_tokens ({spec.max_tokens})", "min_tokens"
        )
    if not spec.use_beam_search:
        if spec.best_of is not None and spec.best_of != spec.n:
            return SamplingProblem("best_of other than n is only served with use_beam_search", "best_of")
        return None
    width = spec.beam_width()
    if spec.n > width:
        return SamplingProblem(f"n ({spec.n}) must be at most best_of ({width}), the beam width", "n")
    if width > MAX_BEAM_WIDTH:
        return SamplingProblem(f"the beam width (n or best_of) must be at most {MAX_BEAM_WIDTH}", "n")
    refused = beam_search_refusals(spec)
    if refused:
        return SamplingProblem(f"use_beam_search does not take {refused[0]}", "use_beam_search")
    return None


def beam_search_refusals(spec: SamplingSpec) -> list[str]:
    """What beam search refuses among what spec asks for: it scores the model's own logprobs, so whatever
    reshapes them is refused (temperature and the truncation knobs are ignored, as by transformers' beam
    search without sampling)."""
    asked = {
        "structured outputs": spec.structured is not None,
        "logit_bias": bool(spec.logit_bias),
        "allowed_token_ids": spec.allowed_token_ids is not None,
        "presence_penalty": spec.presence_penalty != 0.0,
        "frequency_penalty": spec.frequency_penalty != 0.0,
        "repetition_penalty": spec.repetition_penalty != 1.0,
        "min_tokens": spec.min_tokens > 0,
    }
    return [name for name, given in asked.items() if given]


def options_of(model: SamplingOptions) -> dict[str, Any]:
    """The sampling options a body (or any SamplingOptions) holds, by name: what a SamplingSpec copies."""
    return {name: getattr(model, name) for name in SamplingOptions.model_fields}
