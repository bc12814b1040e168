"""From an inbox entry to engine requests: the one place the wire protocol meets the engine's types."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pydantic

from gpu_worker.engine.sampling_params import SamplingParams
from shared.errors import CodedError, ErrorCode, RequestRejected
from shared.protocol import Assignment, GenerateRequest, decode
from shared.sampling import SamplingSpec
from shared.streams import Fields, read_inbox_entry

# An unreadable assignment is answered with one error event per sample; a garbled count cannot ask for more.
MAX_SALVAGED_SAMPLES = 128


def sampling_params(spec: SamplingSpec, **overrides: Any) -> SamplingParams:
    """The engine's SamplingParams for a wire SamplingSpec (overrides win).

    Raises RequestRejected for values the engine refuses.
    """
    try:
        return SamplingParams.of(spec, **overrides)
    except (TypeError, ValueError) as e:
        raise RequestRejected(ErrorCode.INVALID_REQUEST, f"sampling parameters: {e}") from e


@dataclass(slots=True)
class EngineRequest:
    """One request to add to the engine: all samples of a fresh request, or one sample resuming."""

    engine_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | None  # None: the sample already has all its tokens
    index: int | None  # the sample it carries; None when the engine numbers the samples itself
    start: int  # output position of its first new token


def engine_requests(request: GenerateRequest) -> list[EngineRequest]:
    """What the engine runs for a request: itself, or each sample resuming after the tokens it streamed."""
    spec = request.sampling
    rid = request.request_id
    # A beam search streams nothing before it ends, so after a failover it starts again from its prompt.
    if (request.samples is None and not request.resume) or spec.use_beam_search:
        return [EngineRequest(rid, request.prompt_token_ids, sampling_params(spec), None, 0)]
    out = []
    for index in request.sample_indices():
        done = list(request.resume.get(index, []))
        left = None if spec.max_tokens is None else spec.max_tokens - len(done)
        params = None
        if left is None or left > 0:
            # The seed of sample i is seed + i, as the engine gives its forked samples.
            params = sampling_params(
                spec,
                n=1,
                best_of=None,  # (beam searches restart whole, above; otherwise best_of is n)
                seed=None if spec.seed is None else spec.seed + index,
                max_tokens=left,
                min_tokens=max(0, spec.min_tokens - len(done)),
                # Its first event, which carries them, went out before it stopped.
                prompt_logprobs=spec.prompt_logprobs if not done else None,
            )
        out.append(EngineRequest(f"{rid}#{index}", request.prompt_token_ids + done, params, index, len(done)))
    return out


def unread_request_ids(entries: list[tuple[str, Fields]]) -> set[str]:
    """The ids of the requests that inbox entries (as XRANGE returns them) assign; unreadable ones skipped."""
    ids = set()
    for _entry_id, fields in entries:
        request = salvage_request(read_inbox_entry(fields)[0])
        if request is not None:
            ids.add(request.request_id)
    return ids


def read_assignment(data: str | None) -> Assignment:
    """An inbox entry's assignment; raises CodedError(PROTOCOL_ERROR) for one that cannot be read."""
    if data is None:
        raise CodedError(ErrorCode.PROTOCOL_ERROR, "an inbox entry without data")
    try:
        return decode(Assignment, data)
    except pydantic.ValidationError as e:
        first = e.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"])
        raise CodedError(
            ErrorCode.PROTOCOL_ERROR, f"the worker could not read its assignment ({where}: {first['msg']})"
        ) from e


def salvage_request(data: str | None) -> GenerateRequest | None:
    """From an assignment that cannot be read, enough of its request to answer it with an error: the request
    whole if it reads, else its id and sample count; None when not even its id can be read."""
    try:
        raw = json.loads(data or "")["request"]
        request_id = str(raw["request_id"])
    except (ValueError, TypeError, KeyError):
        return None
    try:
        return GenerateRequest.model_validate(raw)
    except pydantic.ValidationError:
        pass
    try:
        n = int(raw["sampling"]["n"])
    except (ValueError, TypeError, KeyError):
        n = 1
    return GenerateRequest(
        request_id=request_id,
        prompt_token_ids=[],
        sampling=SamplingSpec(n=max(1, min(n, MAX_SALVAGED_SAMPLES))),
        arrival_time=0.0,
    )
