"""The wire protocol: every message between services is one of these versioned models, sent as JSON."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from shared.errors import CodedError, ErrorCode
from shared.sampling import SamplingSpec

# Version 2: errors travel as {code, message} (WireError), and the finished record holds SampleEnd models.
PROTOCOL_VERSION: Literal[2] = 2
FinishReason = Literal["stop", "length", "abort", "error"]


class WireModel(BaseModel):
    """Base of every message: unknown fields are refused, and every message names its version."""

    model_config = ConfigDict(extra="forbid")

    v: Literal[2] = PROTOCOL_VERSION


M = TypeVar("M", bound=WireModel)


def encode(message: WireModel) -> str:
    return message.model_dump_json()


def decode(cls: type[M], data: str | bytes) -> M:
    return cls.model_validate_json(data)


class GenerateRequest(WireModel):
    """A tokenized request on the requests stream (gateway → scheduler) and inside an Assignment."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    priority: int = 0
    arrival_time: float
    # The served model name it is for: only a worker of that model takes it ("": any worker).
    model: str = ""
    # Failover: the samples still to run (None: all n) and, per sample, the tokens it already streamed.
    samples: list[int] | None = None
    resume: dict[int, list[int]] = Field(default_factory=dict)

    def sample_indices(self) -> list[int]:
        return list(range(self.sampling.n)) if self.samples is None else list(self.samples)

    def num_blocks_for_prompt(self, block_size: int) -> int:
        """Blocks the prompt (plus any resumed tokens of its longest sample) occupies once computed."""
        longest = max((len(t) for t in self.resume.values()), default=0)
        return -(-(len(self.prompt_token_ids) + longest) // block_size)


class RequestMeta(WireModel):
    """What the gateway keeps of a request while its record lives (`<p>:request:{<rid>}:meta`): that it exists
    (a Redis that came back empty has lost it), and what a resumed stream needs to continue its output."""

    request: GenerateRequest
    chat: bool
    created: int  # the response's `created`, in seconds
    owner: str = ""  # a digest of the API key that created it ("" when the gateway checks no keys)
    stop: list[str] = Field(default_factory=list)
    prompt_text: str = ""
    echo: bool = False
    want_logprobs: bool = False
    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    tool_calls: bool = False  # the answer's calls are read out of its text (gateway.serving.tools)


class Assignment(WireModel):
    """The scheduler hands one request to one worker (on that worker's inbox stream)."""

    worker_id: str
    request: GenerateRequest
    reserved_blocks: int


class WireError(BaseModel):
    """An error as it travels: its code (what the gateway maps to a status) and a message for people."""

    model_config = ConfigDict(extra="forbid")

    code: ErrorCode
    message: str

    @classmethod
    def of(cls, error: CodedError) -> WireError:
        return cls(code=error.code, message=error.message)


class TokenLogprob(BaseModel):
    """The chosen token's log-probability and the top alternatives."""

    model_config = ConfigDict(extra="forbid")

    token_id: int
    logprob: float
    top: dict[int, float] = Field(default_factory=dict)


class RequestTimings(BaseModel):
    """Where a sample's time went inside its worker (seconds): queued (arrival to first scheduled step),
    prefill (first scheduled step to first token) and decode (first token to last)."""

    model_config = ConfigDict(extra="forbid")

    queued_s: float
    prefill_s: float
    decode_s: float


class TokenEvent(WireModel):
    """New tokens of one sample (worker → gateway, on the request's channel).

    `start` is the position of token_ids[0] in the sample's output, so a receiver drops duplicates and
    notices gaps. The last event of a sample carries its finish_reason (and its timings). The first event
    of a sample (start 0) carries how many prompt tokens were found in the prefix cache and, when asked
    for, the prompt logprobs (one entry per prompt token; None for the first, which has no context).
    """

    request_id: str
    index: int
    start: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int
    worker_id: str
    error: WireError | None = None
    num_cached_tokens: int | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    timings: RequestTimings | None = None

    @property
    def sample_end(self) -> SampleEnd | None:
        """What the finished record keeps of the event's end (None while the sample goes on)."""
        if self.finish_reason is None:
            return None
        return SampleEnd(finish_reason=self.finish_reason, error=self.error)


class SampleEnd(WireModel):
    """How one sample ended: the value of its field (the sample index) in the request's finished record."""

    finish_reason: FinishReason
    error: WireError | None = None


class AbortMessage(WireModel):
    """Stop a request (client gone, stop string seen); the worker applies it at its next step."""

    request_id: str
    reason: str = "abort"


# Upper bounds of the buckets of a worker's histogram of tokens per engine step (vllm:iteration_tokens_total).
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# Upper bounds (seconds) of the buckets of the scheduler's queue-time histogram.
QUEUE_TIME_BUCKETS_S = (
    0.001,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.02,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class SchedulerStats(WireModel):
    """The scheduler's queue, for the gateway's back-pressure and metrics.

    Queue time is a request's wait from its entry in the requests stream to its worker's inbox, both by the
    Redis server's clock: a histogram since the scheduler started (cumulative counts per QUEUE_TIME_BUCKETS_S
    bound, then the count above the last).
    """

    num_waiting: int
    num_assigned: int
    updated_at: float
    queue_time_buckets: list[int] = Field(default_factory=lambda: [0] * (len(QUEUE_TIME_BUCKETS_S) + 1))
    queue_time_sum_s: float = 0.0
    # Requests waiting per model (GenerateRequest.model): each model has a queue of its own.
    waiting_by_model: dict[str, int] = Field(default_factory=dict)
    # Routing (scheduler_svc.admission), since the scheduler started: the prompt blocks of the requests it
    # admitted and, of them, those the chosen worker's prefix cache held; the KV events it applied, the worker
    # sets it reloaded, and the distinct block hashes its prefix index holds now.
    routing_policy: str = "load"
    routed_prompt_blocks: int = 0
    routed_matched_blocks: int = 0
    kv_events_applied: int = 0
    kv_resyncs: int = 0
    prefix_index_blocks: int = 0

    @property
    def num_admitted(self) -> int:
        """Requests admitted since the scheduler started (the histogram's last, cumulative bucket)."""
        return self.queue_time_buckets[-1]

    def to_hash(self) -> dict[str, str]:
        return _to_hash(self)

    @classmethod
    def from_hash(cls, fields: Mapping[str, str]) -> SchedulerStats:
        return cls.model_validate(_from_hash(fields))


def _to_hash(message: WireModel) -> dict[str, str]:
    """One hash field per attribute, each value JSON (so types survive the round trip)."""
    return {k: json.dumps(v) for k, v in message.model_dump().items()}


def _from_hash(fields: Mapping[str, str]) -> dict[str, object]:
    return {k: json.loads(v) for k, v in fields.items()}


class Heartbeat(WireModel):
    """A worker's state, stored as a Redis hash with a TTL: refreshed every heartbeat interval."""

    worker_id: str
    model: str
    free_blocks: int
    total_blocks: int
    block_size: int
    num_running: int
    num_waiting: int
    last_step_time: float
    started_at: float
    max_model_len: int
    # Blocks the prompts queued inside the worker will take when admitted (not yet allocated).
    waiting_blocks: int = 0
    num_preemptions: int = 0
    prefix_cache_hit_rate: float = 0.0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    # Prefix cache, in tokens since the worker started: looked up (prompt tokens of new sequences) and found.
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    # Tokens per engine step: cumulative counts per ITERATION_TOKENS_BUCKETS bound, then the count above it.
    iteration_tokens_buckets: list[int] = Field(
        default_factory=lambda: [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
    )
    iteration_tokens_sum: int = 0
    # Speculative decoding since the worker started: verifies, draft tokens, accepted ones (and by position).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = Field(default_factory=list)
    dtype: str = ""
    device: str = ""
    # Stopping: it takes no new requests (the admit script refuses it) and finishes those it holds.
    draining: bool = False
    beat_at: float = 0.0  # when it was written (time.time()): the dashboard shows its age

    def to_hash(self) -> dict[str, str]:
        return _to_hash(self)

    @classmethod
    def from_hash(cls, fields: Mapping[str, str]) -> Heartbeat:
        return cls.model_validate(_from_hash(fields))
