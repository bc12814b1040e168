"""OpenAI's response objects: `text_completion` and `chat.completion`, whole or as stream chunks."""

from __future__ import annotations

import math
from typing import Any

from gateway.generation import Generation
from gateway.output import LogprobEntry, SampleOutput
from gateway.tokenization import Tokenizer

# OpenAI's stand-in for a log-probability too small to write down (JSON has no -Infinity).
_LOGPROB_FLOOR = -9999.0

Json = dict[str, Any]


def _finite(logprob: float | None) -> float | None:
    if logprob is None:
        return None
    return logprob if math.isfinite(logprob) else _LOGPROB_FLOOR


def _best_first(top: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(top.items(), key=lambda item: -item[1])


def usage(generation: Generation) -> Json:
    prompt, completion = generation.num_prompt_tokens, generation.num_completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class ResponseFormat:
    """The OpenAI shape of one request's output: chat completions or completions, as it was asked."""

    def __init__(self, generation: Generation, tokenizer: Tokenizer, model: str) -> None:
        self._generation = generation
        self._tokenizer = tokenizer
        self._chat = chat = generation.prepared.chat
        self._include_usage = generation.prepared.include_usage
        self._head = {
            "id": generation.request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": generation.prepared.created,
            "model": model,
        }

    # -- whole response ---------------------------------------------------------------------------------

    def response(self) -> Json:
        choices = []
        prepared = self._generation.prepared
        for sample in self._generation.samples:
            logprobs = self._logprobs(sample.logprobs) if prepared.want_logprobs else None
            choice: Json = {"index": sample.index}
            if self._chat:
                choice["message"] = {"role": "assistant", "content": sample.text}
            else:
                choice["text"] = (prepared.prompt_text if prepared.echo else "") + sample.text
            choices.append({**choice, "logprobs": logprobs, "finish_reason": sample.finish_reason})
        return {**self._head, "choices": choices, "usage": usage(self._generation)}

    # -- stream chunks ----------------------------------------------------------------------------------

    def opening_chunks(self) -> list[Json]:
        """Chat: each choice's role first. Completions with echo: each choice's prompt first."""
        prepared = self._generation.prepared
        samples = self._generation.samples
        if self._chat:
            return [self._chunk(s.index, {"role": "assistant", "content": ""}, None, None) for s in samples]
        if prepared.echo:
            return [self._chunk(s.index, prepared.prompt_text, None, None) for s in samples]
        return []

    def sample_chunks(self, sample: SampleOutput) -> list[tuple[Json, list[int]]]:
        """What changed in a sample since its last chunk: new text (and logprobs), then its end; each chunk
        with the cursor a client has reached once it has it (see gateway.resume)."""
        text, entries = sample.take()
        chunks = []
        want_logprobs = self._generation.prepared.want_logprobs
        if text or (entries and want_logprobs):
            logprobs = self._logprobs(entries) if want_logprobs else None
            content: Json | str = {"content": text} if self._chat else text
            chunks.append((self._chunk(sample.index, content, logprobs, None), self.cursor()))
        reason = sample.take_finish()
        if reason is not None:
            chunks.append((self._chunk(sample.index, {} if self._chat else "", None, reason), self.cursor()))
        return chunks

    def cursor(self) -> list[int]:
        return [s.position for s in self._generation.samples]

    def usage_chunk(self) -> tuple[Json, list[int]]:
        chunk: Json = {
            **self._head,
            "object": self._chunk_object,
            "choices": [],
            "usage": usage(self._generation),
        }
        return chunk, [position + 1 for position in self.cursor()]

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self._chat else "text_completion"

    def _chunk(self, index: int, content: Json | str, logprobs: Json | None, reason: str | None) -> Json:
        choice: Json = {"index": index}
        choice["delta" if self._chat else "text"] = content
        choice.update(logprobs=logprobs, finish_reason=reason)
        chunk: Json = {**self._head, "object": self._chunk_object, "choices": [choice]}
        if self._include_usage:
            chunk["usage"] = None
        return chunk

    # -- logprobs ---------------------------------------------------------------------------------------

    def _logprobs(self, entries: list[LogprobEntry]) -> Json:
        return self._chat_logprobs(entries) if self._chat else self._completion_logprobs(entries)

    def _completion_logprobs(self, entries: list[LogprobEntry]) -> Json:
        text = self._tokenizer.token_text
        return {
            "tokens": [text(e.token_id) for e in entries],
            "token_logprobs": [_finite(e.logprob) for e in entries],
            "top_logprobs": [{text(t): _finite(lp) for t, lp in _best_first(e.top)} for e in entries],
            "text_offset": [e.text_offset for e in entries],
        }

    def _chat_logprobs(self, entries: list[LogprobEntry]) -> Json:
        return {
            "content": [
                {
                    **self._token(e.token_id, e.logprob),
                    "top_logprobs": [self._token(t, lp) for t, lp in _best_first(e.top)],
                }
                for e in entries
            ]
        }

    def _token(self, token_id: int, logprob: float | None) -> Json:
        raw = self._tokenizer.token_bytes(token_id)
        text = raw.decode("utf-8", errors="replace")
        return {"token": text, "logprob": _finite(logprob), "bytes": list(raw)}
