"""Several prompts in one completions request: one queued request per prompt, one response for all of them.

Each prompt is prepared, queued and failed over as a request of its own. The response is one
`text_completion` whose choices run over prompts, then samples: choice index = prompt_index * n + sample;
its usage is the sum over prompts. The prompts' subscriptions share one wake-up, so the request waits once
for all of them. Resuming a stream (Last-Event-ID, gateway.serving.resume) is for single-prompt requests: a
multi-prompt stream has no event ids, and its prompts are aborted as soon as its client drops.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import redis

from gateway.serving.errors import APIError
from gateway.serving.generation import ClientDisconnected, Generation, GenerationTimeout, queue_requests
from gateway.serving.output import SampleOutput
from gateway.serving.prepare import Prepared, new_request_id, prepare_completion
from gateway.serving.responses import ResponseFormat
from gateway.serving.schemas import CompletionRequest
from gateway.serving.token_receiver import RECONNECT_INTERVAL_S, GenerationError
from gateway.serving.tokenization import Tokenizer

Json = dict[str, Any]


def prepare_prompts(body: CompletionRequest, tokenizer: Tokenizer, model: str = "") -> list[Prepared]:
    """One Prepared per prompt; a prompt that cannot run refuses the whole request, its index named."""
    prompt = body.prompt
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [prepare_completion(body, tokenizer, model)]
    prepared = []
    for i, one in enumerate(prompt):
        try:
            prepared.append(prepare_completion(body.model_copy(update={"prompt": one}), tokenizer, model))
        except APIError as e:
            raise APIError(e.code, f"prompt[{i}]: {e.message}", e.param, e.retry_after) from e
    return prepared


class PromptBatch:
    """The generations of one request's prompts, waited on together, and the response they make."""

    def __init__(self, client: redis.Redis, prepared: list[Prepared], *, tick_s: float) -> None:
        self.id = new_request_id("cmpl")
        self._client = client
        self.wakeup = threading.Event()
        self.stream = prepared[0].stream
        self.include_usage = prepared[0].include_usage
        self._created = prepared[0].created
        self._n = prepared[0].request.sampling.n
        self._tick_s = tick_s
        self.generations: list[Generation] = []
        self._formats: list[ResponseFormat] = []

    def add(self, generation: Generation, response_format: ResponseFormat) -> None:
        """The next prompt's generation, made with this batch's wake-up."""
        self.generations.append(generation)
        self._formats.append(response_format)

    def submit(self, owner: str, *, exclusive: bool = False) -> None:
        """Queue every prompt's request at once (one MULTI): all of them or none (queue_requests)."""
        queue_requests(self._client, self.generations, owner, exclusive=exclusive)

    @property
    def done(self) -> bool:
        return all(g.done for g in self.generations)

    def updates(self) -> Iterator[list[tuple[int, SampleOutput]]]:
        """Each batch of samples that changed, with their prompt's index, in the order they arrived; an empty
        list after every tick_s without events. Raises as Generation.updates() does, after aborting every
        prompt's request.

        Between events it waits on the shared wake-up alone. Every tick_s (sooner while Redis is away, or at
        the deadline) it sweeps every prompt, as a single request's poll does when nothing comes: its record,
        its deadline, the workers.
        """
        try:
            swept_at = time.monotonic()
            while not self.done:
                running = [(i, g) for i, g in enumerate(self.generations) if not g.done]
                self.wakeup.clear()  # before looking: an event that comes after the look sets it again
                # (one whose hub is reconnecting waits for the sweep: its poll catches up from the record)
                ready = [(i, g) for i, g in running if g.pending and g.connected]
                due = self._next_sweep(swept_at, running)
                if not ready and self.wakeup.wait(max(0.0, due - time.monotonic())):
                    continue
                sweep = time.monotonic() >= due
                if sweep:
                    ready, swept_at = running, time.monotonic()
                changed = [(i, s) for i, g in ready for s in self._step(i, g) or []]
                if changed or sweep:
                    yield changed
        except BaseException as e:
            self.close(_abort_reason(e))
            raise

    def _next_sweep(self, swept_at: float, running: list[tuple[int, Generation]]) -> float:
        interval = self._tick_s
        if not all(g.connected for _, g in running):
            interval = min(interval, RECONNECT_INTERVAL_S)  # catch up soon after Redis is back
        return min(swept_at + interval, min(g.deadline for _, g in running))

    def _step(self, index: int, generation: Generation) -> list[SampleOutput] | None:
        try:
            return generation.step(0.0)
        except (ClientDisconnected, GenerationTimeout):
            raise
        except GenerationError as e:
            raise GenerationError(e.code, f"prompt[{index}]: {e.message}") from e

    def close(self, reason: str | None = "client_disconnect") -> None:
        """Close every prompt's generation; one that has not finished is aborted with reason (None: not)."""
        for generation in self.generations:
            generation.close(reason)

    # -- the response -----------------------------------------------------------------------------------

    def response(self) -> Json:
        whole = [f.response() for f in self._formats]
        choices = [c for i, r in enumerate(whole) for c in self._renumbered(i, r["choices"])]
        usage = _sum([r["usage"] for r in whole])
        return {**whole[0], "id": self.id, "created": self._created, "choices": choices, "usage": usage}

    def opening_chunks(self) -> list[Json]:
        return [self._chunk(i, c) for i, f in enumerate(self._formats) for c in f.opening_chunks()]

    def sample_chunks(self, index: int, sample: SampleOutput) -> list[Json]:
        return [self._chunk(index, chunk) for chunk, _ in self._formats[index].sample_chunks(sample)]

    def usage_chunk(self) -> Json:
        chunks = [f.usage_chunk()[0] for f in self._formats]
        usage = _sum([c["usage"] for c in chunks])
        return {**chunks[0], "id": self.id, "created": self._created, "usage": usage}

    def _chunk(self, index: int, chunk: Json) -> Json:
        return {
            **chunk,
            "id": self.id,
            "created": self._created,
            "choices": self._renumbered(index, chunk["choices"]),
        }

    def _renumbered(self, index: int, choices: list[Json]) -> list[Json]:
        return [{**c, "index": index * self._n + c["index"]} for c in choices]


def _abort_reason(error: BaseException) -> str:
    """Why the prompts still running are aborted when the request ends with error."""
    if isinstance(error, ClientDisconnected | GeneratorExit):  # (GeneratorExit: the stream was closed)
        return "client_disconnect"
    return "timeout" if isinstance(error, GenerationTimeout) else "error"


def _sum(usages: list[Json]) -> Json:
    """Usage objects added up field by field (nested details too); a field that is no count is the first's."""
    total: Json = {}
    for usage in usages:
        for key, value in usage.items():
            known = total.get(key)
            if isinstance(value, dict):
                total[key] = _sum([known, value]) if isinstance(known, dict) else value
            elif isinstance(value, int | float) and not isinstance(value, bool) and key in total:
                total[key] = (known or 0) + value
            else:
                total.setdefault(key, value)
    return total
