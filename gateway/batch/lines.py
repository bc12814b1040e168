"""One line of a batch: read, prepared as the gateway prepares a request, queued at the batch's priority,
waited for, and answered in OpenAI's batch line shape.

A line never runs twice. Before its requests are queued their ids are claimed for it (BatchStore.claim); a
run that finds a claim (the batch's earlier task died, or handed over with the line in flight) attaches to
those requests as a resumed stream does, from their token records, instead of queuing them again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from gateway.serving.batch_records import BatchStore
from gateway.serving.errors import APIError
from gateway.serving.event_hub import EventHub
from gateway.serving.generation import Generation, Limits
from gateway.serving.models import ServedModels
from gateway.serving.prepare import Prepared, prepare_chat
from gateway.serving.prompt_batch import PromptBatch, prepare_prompts
from gateway.serving.responses import ResponseFormat
from gateway.serving.resume import load_request
from gateway.serving.schemas import ChatCompletionRequest, CompletionRequest
from gateway.serving.token_receiver import GenerationError
from gateway.serving.validation import validate
from shared.errors import CodedError, ErrorCode

Json = dict[str, Any]
# A batch's requests belong to no API key's stream: nobody resumes them but the batch itself.
BATCH_OWNER = "batch"
# Failures that may pass: the line is queued again later rather than answered with them.
RETRYABLE = frozenset(
    {ErrorCode.NO_WORKER, ErrorCode.OVERLOADED, ErrorCode.QUEUE_UNAVAILABLE, ErrorCode.ABORTED}
)


@dataclass(frozen=True, slots=True)
class Line:
    """A line of the input file: its number (from 1), its custom_id, the key its progress is kept under."""

    number: int
    raw: str
    custom_id: str | None

    @property
    def key(self) -> str:
        return self.custom_id if self.custom_id is not None else f"#line-{self.number}"

    def output(self, batch_id: str, response: Json | None, error: Json | None = None) -> Json:
        digest = hashlib.sha256(f"{batch_id}\0{self.key}".encode()).hexdigest()[:32]
        return {
            "id": f"batch_req_{digest}",
            "custom_id": self.custom_id,
            "response": response,
            "error": error,
        }

    def failure(self, batch_id: str, error: CodedError) -> Json:
        """The error-file line of a request answered with an error (status and body as the API's)."""
        api = APIError.of(error)
        return self.output(batch_id, {"status_code": api.status, "request_id": None, "body": api.body()})

    def refusal(self, batch_id: str, code: ErrorCode, message: str) -> Json:
        """The error-file line for a line that is no request at all (not JSON, the wrong url, ...)."""
        return self.output(batch_id, None, {"code": str(code), "message": message})


def is_success(output: Json) -> bool:
    response = output.get("response")
    return output.get("error") is None and response is not None and response.get("status_code") == 200


def is_chat(endpoint: str) -> bool:
    return endpoint == "/v1/chat/completions"


class LineRefused(CodedError):
    """The line is not a request the batch can send."""


@dataclass(frozen=True, slots=True)
class LineContext:
    """What running lines needs: the same parts the gateway's routes use."""

    client: redis.Redis
    store: BatchStore
    models: ServedModels
    hub: EventHub
    limits: Limits
    priority: int

    def generation(self, prepared: Prepared, wakeup: Any) -> Generation:
        model = self.models.of(prepared.request)
        return Generation(
            self.client,
            self.store.keys,
            model.tokenizer,
            prepared,
            limits=self.limits,
            hub=self.hub,
            watch=model.watch,
            wakeup=wakeup,
        )


def prepare_line(line: Line, endpoint: str, models: ServedModels) -> list[Prepared]:
    """The line's requests (one per prompt), prepared as the endpoint would; LineRefused or APIError."""
    try:
        data = json.loads(line.raw)
    except ValueError as e:
        raise LineRefused(ErrorCode.INVALID_JSON, f"line {line.number} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise LineRefused(ErrorCode.INVALID_JSON, f"line {line.number} is not a JSON object")
    if line.custom_id is None:
        raise LineRefused(ErrorCode.INVALID_REQUEST, f"line {line.number} has no custom_id (a string)")
    if data.get("method", "POST") != "POST":
        raise LineRefused(ErrorCode.INVALID_REQUEST, f"line {line.number}: method must be POST")
    if data.get("url") != endpoint:
        raise LineRefused(
            ErrorCode.INVALID_REQUEST,
            f"line {line.number}: url {json.dumps(data.get('url'))} is not the batch's endpoint '{endpoint}'",
        )
    body = data.get("body")
    if not isinstance(body, dict):
        raise LineRefused(ErrorCode.INVALID_REQUEST, f"line {line.number}: body must be a JSON object")
    if body.get("stream"):
        raise APIError(ErrorCode.INVALID_REQUEST, "a batch's requests cannot stream", param="stream")
    where = f"{endpoint} (batch line {line.number})"
    if is_chat(endpoint):
        chat, _ = validate(ChatCompletionRequest, body, where)
        model = models.get(chat.model)
        return [prepare_chat(chat, model.tokenizer, model.name)]
    plain, _ = validate(CompletionRequest, body, where)
    model = models.get(plain.model)
    return prepare_prompts(plain, model.tokenizer, model.name)


class LineRun:
    """One line of a batch being run: its requests queued (or found, when an earlier run queued them), waited
    for, and its outcome recorded."""

    def __init__(self, ctx: LineContext, batch_id: str, endpoint: str, line: Line) -> None:
        self._ctx = ctx
        self._batch_id = batch_id
        self._endpoint = endpoint
        self.line = line
        self._formats: list[ResponseFormat] = []

    def run(self, stop: Callable[[], str | None]) -> str:
        """Run the line until it ends or stop() names a reason to leave it: "done", "retry" (it failed for a
        reason that may pass; its claim is released) or the reason stop() gave."""
        ctx, line = self._ctx, self.line
        try:
            prepared = prepare_line(line, self._endpoint, ctx.models)
        except CodedError as e:
            refused = isinstance(e, LineRefused)
            outcome = line.refusal(self._batch_id, e.code, e.message) if refused else self._failure(e)
            ctx.store.record(self._batch_id, line.key, outcome, failed=True)
            return "done"
        for one in prepared:
            one.request.priority = ctx.priority
        batch = self._start(prepared)
        try:
            for _ in batch.updates():
                reason = stop()
                if reason is not None:
                    # Cancel and expiry end the requests; a hand-over leaves them running for the next run.
                    batch.close(reason if reason in ("cancel", "expire") else None)
                    return reason
        except GenerationError as e:
            if e.code in RETRYABLE:
                ctx.store.release(self._batch_id, line.key)
                return "retry"
            ctx.store.record(self._batch_id, line.key, self._failure(e), failed=True)
            return "done"
        finally:
            batch.close(None)
        body = batch.response() if len(batch.generations) > 1 else self._formats[0].response()
        response = {"status_code": 200, "request_id": body["id"], "body": body}
        ctx.store.record(self._batch_id, line.key, line.output(self._batch_id, response), failed=False)
        return "done"

    def _failure(self, error: CodedError) -> Json:
        return self.line.failure(self._batch_id, error)

    def _start(self, prepared: list[Prepared]) -> PromptBatch:
        """The line's requests: queued now, or attached to as an earlier run queued them."""
        ctx = self._ctx
        request_ids = [p.request.request_id for p in prepared]
        held = ctx.store.claim(self._batch_id, self.line.key, request_ids)
        if held is not None:
            batch = self._attach(held)
            if batch is not None:
                return batch
            ctx.store.reclaim(self._batch_id, self.line.key, request_ids)  # they were lost before they ran
        batch = PromptBatch(ctx.client, prepared, tick_s=ctx.limits.tick_s)
        for one in prepared:
            self._add(batch, ctx.generation(one, batch.wakeup))
        batch.submit(BATCH_OWNER)
        return batch

    def _attach(self, request_ids: list[str]) -> PromptBatch | None:
        ctx = self._ctx
        chat = is_chat(self._endpoint)
        try:
            metas = [load_request(ctx.client, ctx.store.keys, r, BATCH_OWNER, chat=chat) for r in request_ids]
        except APIError:
            return None  # a record that has gone: its requests never ran, or ran so long ago they expired
        prepared = [Prepared.from_meta(meta, stream=False) for meta in metas]
        batch = PromptBatch(ctx.client, prepared, tick_s=ctx.limits.tick_s)
        for one in prepared:
            generation = ctx.generation(one, batch.wakeup)
            self._add(batch, generation)
            generation.replay(None)
        return batch

    def _add(self, batch: PromptBatch, generation: Generation) -> None:
        model = self._ctx.models.of(generation.request)
        response_format = ResponseFormat(generation, model.tokenizer, model.name)
        self._formats.append(response_format)
        batch.add(generation, response_format)
