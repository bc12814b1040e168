"""OpenAI's response objects: `text_completion` and `chat.completion`, whole or as stream chunks."""

from __future__ import annotations

import math
from typing import Any

from gateway.serving.generation import Generation
from gateway.serving.output import LogprobEntry, SampleOutput
from gateway.serving.tokenization import Tokenizer
from gateway.serving.tools import Call, ToolView, call_id, read_calls

# OpenAI's stand-in for a log-probability too small to write down (JSON has no -Infinity).
_LOGPROB_FLOOR = -9999.0

Json = dict[str, Any]


def _finite(logprob: float | None) -> float | None:
    if logprob is None:
        return None
    return logprob if math.isfinite(logprob) else _LOGPROB_FLOOR


def _best_first(top: dict[int, float], k: int | None = None) -> list[tuple[int, float]]:
    ranked = sorted(top.items(), key=lambda item: -item[1])
    return ranked if k is None else ranked[:k]


def usage(generation: Generation) -> Json:
    """The tokens so far; cached_tokens: the prompt tokens a worker found in its prefix cache (the samples
    share one prompt, so the most any sample's worker found; 0 when no first event said)."""
    prompt, completion = generation.num_prompt_tokens, generation.num_completion_tokens
    cached = max((s.num_cached_tokens or 0 for s in generation.samples), default=0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class ResponseFormat:
    """The OpenAI shape of one request's output: chat completions or completions, as it was asked, with
    vLLM's additions (stop_reason, prompt_logprobs, continuous usage stats).

    Prompt logprobs come with each sample's first event. A stream resumed from the token record (a client
    that reconnects, or a GET of the request) has not seen that event: it shows prompt_logprobs as null, and
    an echoed prompt's tokens with null logprobs.
    """

    def __init__(self, generation: Generation, tokenizer: Tokenizer, model: str) -> None:
        self._generation = generation
        self._tokenizer = tokenizer
        self._chat = chat = generation.prepared.chat
        prepared = generation.prepared
        self._include_usage = prepared.include_usage
        self._continuous_usage = prepared.include_usage and prepared.continuous_usage_stats
        self._num_logprobs = prepared.request.sampling.logprobs or 0
        # Echo with logprobs: a sample's prompt goes out with its first chunk, which brings the prompt's
        # logprobs (as vLLM streams it); a sample its client has had nothing of (resumed or not) needs it.
        self._echo_first = prepared.echo and prepared.want_logprobs and not chat
        self._echo_pending = (
            {s.index for s in generation.samples if s.sent_nothing} if self._echo_first else set()
        )
        self._prompt_offsets: list[int] | None = None
        self._tool_calls = prepared.tool_calls
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
        samples = self._generation.samples
        for sample in samples:
            logprobs = None
            if prepared.want_logprobs:
                logprobs = self._logprobs(sample.logprobs, sample if prepared.echo else None)
            choice: Json = {"index": sample.index}
            finish_reason = sample.finish_reason
            if self._tool_calls:
                view = read_calls(sample.text, final=True)
                choice["message"] = {"role": "assistant", "content": view.content or None}
                if view.calls:
                    choice["message"]["tool_calls"] = [
                        self._call(sample.index, k, call) for k, call in enumerate(view.calls)
                    ]
                finish_reason = self._finish_reason(finish_reason, view)
            elif self._chat:
                echoed = prepared.prompt_text if prepared.echo else ""  # the assistant message it continues
                choice["message"] = {"role": "assistant", "content": echoed + sample.text}
            else:
                choice["text"] = (prepared.prompt_text if prepared.echo else "") + sample.text
            choice.update(logprobs=logprobs, finish_reason=finish_reason, stop_reason=sample.stop_reason)
            if not self._chat:
                choice["prompt_logprobs"] = self._prompt_logprobs(sample)
            choices.append(choice)
        whole: Json = {**self._head, "choices": choices, "usage": usage(self._generation)}
        if self._chat:  # vLLM gives a chat completion's prompt_logprobs once, beside its choices
            known = [s for s in samples if s.prompt_logprobs is not None]
            whole["prompt_logprobs"] = self._prompt_logprobs(known[0] if known else samples[0])
        return whole

    # -- stream chunks ----------------------------------------------------------------------------------

    def opening_chunks(self) -> list[Json]:
        """Chat: each choice's role first. Completions with echo: each choice's prompt first."""
        prepared = self._generation.prepared
        samples = self._generation.samples
        if self._chat:
            echoed = prepared.prompt_text if prepared.echo else ""
            return [
                self._chunk(s.index, {"role": "assistant", "content": echoed}, None, None) for s in samples
            ]
        if prepared.echo and not self._echo_first:
            return [self._chunk(s.index, prepared.prompt_text, None, None) for s in samples]
        return []

    def sample_chunks(self, sample: SampleOutput) -> list[tuple[Json, list[int]]]:
        """What changed in a sample since its last chunk: new text (and logprobs), and its end with its last
        text, as vLLM streams it; with the cursor a client has reached once it has it (see serving.resume)."""
        if self._tool_calls:
            return self._tool_chunks(sample)
        text, entries = sample.take()
        reason = sample.take_finish()
        prepared = self._generation.prepared
        want_logprobs = prepared.want_logprobs
        # (A sample that has sent nothing yet waits for its first tokens, and the prompt logprobs with them.)
        echo = sample.index in self._echo_pending and (sample.num_tokens > 0 or sample.finished)
        news = bool(text or (entries and want_logprobs) or echo)
        if not news and reason is None:
            return []
        logprobs = None
        if news and want_logprobs:
            logprobs = self._logprobs(entries, sample if echo else None)
        if echo:
            text = prepared.prompt_text + text
            self._echo_pending.discard(sample.index)
        content: Json | str = text
        if self._chat:
            content = {"content": text} if news else {}
        stop_reason = sample.stop_reason if reason is not None else None
        return [(self._chunk(sample.index, content, logprobs, reason, stop_reason), self.cursor())]

    def _tool_chunks(self, sample: SampleOutput) -> list[tuple[Json, list[int]]]:
        """sample_chunks for an answer that may call tools: the content and the calls (id and name first,
        then the arguments piece by piece) as the text shows them, the differences of its successive views
        (serving.tools.read_calls); so a resumed stream goes on from what its client had."""
        before = read_calls(sample.sent_text, final=False)
        _, entries = sample.take()
        reason = sample.take_finish()
        after = read_calls(sample.sent_text, final=sample.finished)
        delta: Json = {}
        if len(after.content) > len(before.content):
            delta["content"] = after.content[len(before.content) :]
        calls = []
        for k, call in enumerate(after.calls):
            if k >= len(before.calls):
                calls.append({"index": k, **self._call(sample.index, k, call)})
            elif len(call.arguments) > len(before.calls[k].arguments):
                fragment = call.arguments[len(before.calls[k].arguments) :]
                calls.append({"index": k, "function": {"arguments": fragment}})
        if calls:
            delta["tool_calls"] = calls
        logprobs = self._logprobs(entries) if entries and self._generation.prepared.want_logprobs else None
        if not delta and logprobs is None and reason is None:
            return []
        if reason is not None:
            reason = self._finish_reason(reason, after)
        stop_reason = sample.stop_reason if reason is not None else None
        return [(self._chunk(sample.index, delta, logprobs, reason, stop_reason), self.cursor())]

    def _call(self, sample: int, k: int, call: Call) -> Json:
        request_id = self._generation.request_id
        function = {"name": call.name, "arguments": call.arguments}
        return {"id": call_id(request_id, sample, k), "type": "function", "function": function}

    @staticmethod
    def _finish_reason(reason: str | None, view: ToolView) -> str | None:
        """tool_calls for an answer that ended with its calls complete (the grammar's end), as OpenAI's."""
        return "tool_calls" if reason == "stop" and view.called else reason

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

    def _chunk(
        self,
        index: int,
        content: Json | str,
        logprobs: Json | None,
        reason: str | None,
        stop_reason: int | str | None = None,
    ) -> Json:
        choice: Json = {"index": index}
        choice["delta" if self._chat else "text"] = content
        choice.update(logprobs=logprobs, finish_reason=reason, stop_reason=stop_reason)
        chunk: Json = {**self._head, "object": self._chunk_object, "choices": [choice]}
        if self._include_usage:
            chunk["usage"] = usage(self._generation) if self._continuous_usage else None
        return chunk

    # -- logprobs ---------------------------------------------------------------------------------------

    def _logprobs(self, entries: list[LogprobEntry], echo_of: SampleOutput | None = None) -> Json:
        """Chat's or completions' logprobs of entries; completions with echo_of: its prompt's tokens first."""
        if self._chat:
            return self._chat_logprobs(entries)
        out = self._completion_logprobs(entries, len(self._generation.prepared.prompt_text) if echo_of else 0)
        if echo_of is None:
            return out
        prompt = self._completion_logprobs(self._prompt_entries(echo_of), 0)
        return {key: prompt[key] + out[key] for key in out}

    def _completion_logprobs(self, entries: list[LogprobEntry], shift: int) -> Json:
        text = self._tokenizer.token_text
        return {
            "tokens": [text(e.token_id) for e in entries],
            "token_logprobs": [_finite(e.logprob) for e in entries],
            "top_logprobs": [self._completion_top(e) for e in entries],
            "text_offset": [shift + e.text_offset for e in entries],
        }

    def _completion_top(self, entry: LogprobEntry) -> dict[str, float | None] | None:
        """The top logprobs asked for, and the token's own when it is not among them (as OpenAI and vLLM
        do); None where the token's logprob is not known (a prompt's first token, a gap read back)."""
        if entry.logprob is None:
            return None
        ranked = _best_first(entry.top, self._num_logprobs)
        if all(t != entry.token_id for t, _ in ranked):
            ranked.append((entry.token_id, entry.logprob))
        text = self._tokenizer.token_text
        return {text(t): _finite(lp) for t, lp in ranked}

    def _prompt_entries(self, sample: SampleOutput) -> list[LogprobEntry]:
        """The prompt's tokens as logprob entries, their text offsets in the prompt's decoded text."""
        prompt_ids = self._generation.request.prompt_token_ids
        if self._prompt_offsets is None:
            detokenizer = self._tokenizer.detokenizer([])
            self._prompt_offsets = []
            for token_id in prompt_ids:
                self._prompt_offsets.append(len(detokenizer.text))
                detokenizer.add(token_id)
        known = sample.prompt_logprobs or []
        entries = []
        for i, (token_id, offset) in enumerate(zip(prompt_ids, self._prompt_offsets)):
            lp = known[i] if i < len(known) else None
            if lp is None:
                entries.append(LogprobEntry(token_id, None, {}, offset))
            else:
                entries.append(LogprobEntry(token_id, lp.logprob, dict(lp.top), offset))
        return entries

    def _prompt_logprobs(self, sample: SampleOutput) -> list[Json | None] | None:
        """vLLM's prompt_logprobs: per prompt token (None for the first) its id's logprob, rank among the top
        (None when it is not among those the worker sent) and text, then the top k's; None when they were
        not asked for, or are not known (see the class)."""
        k = self._generation.prepared.prompt_logprobs
        if k is None or sample.prompt_logprobs is None:
            return None
        out: list[Json | None] = []
        for lp in sample.prompt_logprobs:
            if lp is None:
                out.append(None)
                continue
            ranked = _best_first(lp.top)
            ranks = {t: rank for rank, (t, _) in enumerate(ranked, 1)}
            entry = {str(lp.token_id): self._ranked(lp.token_id, lp.logprob, ranks.get(lp.token_id))}
            for t, value in ranked[:k]:
                entry.setdefault(str(t), self._ranked(t, value, ranks[t]))
            out.append(entry)
        return out

    def _ranked(self, token_id: int, logprob: float, rank: int | None) -> Json:
        return {
            "logprob": _finite(logprob),
            "rank": rank,
            "decoded_token": self._tokenizer.token_text(token_id),
        }

    def _chat_logprobs(self, entries: list[LogprobEntry]) -> Json:
        return {
            "content": [
                {
                    **self._token(e.token_id, e.logprob),
                    "top_logprobs": [self._token(t, lp) for t, lp in _best_first(e.top, self._num_logprobs)],
                }
                for e in entries
            ]
        }

    def _token(self, token_id: int, logprob: float | None) -> Json:
        raw = self._tokenizer.token_bytes(token_id)
        text = raw.decode("utf-8", errors="replace")
        return {"token": text, "logprob": _finite(logprob), "bytes": list(raw)}
