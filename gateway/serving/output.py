"""One sample's output as its tokens arrive: text in whole characters, ended by a stop string or token."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from gateway.serving.token_receiver import SampleTokens
from gateway.serving.tokenization import IncrementalDetokenizer
from shared.protocol import TokenLogprob


@dataclass(slots=True)
class LogprobEntry:
    """One output token's log-probability, its top alternatives, and where its text starts."""

    token_id: int
    logprob: float | None
    top: dict[int, float]
    text_offset: int


class SampleOutput:
    """The text, token count and logprobs of one sample, and what of them the client has been sent.

    While streaming, the last len(longest stop string) - 1 characters are held back: they may be the
    start of a stop string that the next tokens complete, and a stop string is never shown (unless
    include_stop_str: then the text ends right after it, and nothing need be held back).

    A token of stop_token_ids ends the sample on its worker, so it is known for the last one as it arrives:
    it is counted and has its logprobs, but its text is left out (unless include_stop_str). The EOS token
    needs no such care: it is a special token, whose text the detokenizer skips.
    """

    def __init__(
        self,
        index: int,
        detokenizer: IncrementalDetokenizer,
        stop: list[str],
        want_logprobs: bool,
        *,
        stop_token_ids: Collection[int] = (),
        include_stop_str: bool = False,
    ) -> None:
        self.index = index
        self._detokenizer = detokenizer
        self._stop = stop
        self._search_back = max((len(s) for s in stop), default=1) - 1
        self._holdback = 0 if include_stop_str else self._search_back
        self._stop_token_ids = frozenset(stop_token_ids)
        self._include_stop_str = include_stop_str
        self._want_logprobs = want_logprobs
        self.text = ""
        self.num_tokens = 0
        self.token_ids: list[int] = []  # every token taken in (what a resent request resumes from)
        self.logprobs: list[LogprobEntry] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop string or stop token id that ended it
        self.stopped_here = False  # a stop string ended it here; its worker may still be generating
        # From the sample's first event (None: not known, as when it was read back from the token record).
        self.num_cached_tokens: int | None = None
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self._sent_chars = 0
        self._sent_logprobs = 0
        self._finish_sent = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def position(self) -> int:
        """How far the client is in this sample once it has what was taken: its tokens, then one more for
        the chunk that ends it. A stream's event ids carry it, and a resumed stream starts after it."""
        return self.num_tokens + int(self._finish_sent)

    @property
    def sent_text(self) -> str:
        """The text taken so far: what the client has."""
        return self.text[: self._sent_chars]

    @property
    def sent_nothing(self) -> bool:
        """Nothing of the sample has been taken yet: its client has had none of it."""
        return self._sent_chars == 0 and self._sent_logprobs == 0 and not self._finish_sent

    def add(self, tokens: SampleTokens) -> None:
        if tokens.num_cached_tokens is not None:
            self.num_cached_tokens = tokens.num_cached_tokens
        if tokens.prompt_logprobs is not None:
            self.prompt_logprobs = tokens.prompt_logprobs
        for token_id, logprob in zip(tokens.token_ids, tokens.logprobs):
            if self.finished:
                return
            self.num_tokens += 1
            self.token_ids.append(token_id)
            if self._want_logprobs:
                self.logprobs.append(
                    LogprobEntry(
                        token_id,
                        None if logprob is None else logprob.logprob,
                        {} if logprob is None else dict(logprob.top),
                        len(self.text),
                    )
                )
            if token_id in self._stop_token_ids:
                self.stop_reason = token_id
                if not self._include_stop_str:
                    continue
            self._append(self._detokenizer.add(token_id))
        if tokens.finish_reason is not None and not self.finished:
            self._append(self._detokenizer.flush())
            if not self.finished:
                self.finish_reason = tokens.finish_reason

    def _append(self, new: str) -> None:
        if not new:
            return
        # A stop string found now ends in the new text, so it starts at most len(stop) - 1 characters
        # before it: earlier text was already searched.
        search_from = max(0, len(self.text) - self._search_back)
        self.text += new
        found = [(i, s) for s in self._stop if (i := self.text.find(s, search_from)) >= 0]
        if found:
            start, stop = min(found, key=lambda hit: (hit[0], len(hit[1])))
            cut = start + len(stop) if self._include_stop_str else start
            assert cut >= self._sent_chars, "held-back text must cover any stop string"
            self.text = self.text[:cut]
            self.finish_reason = "stop"
            self.stop_reason = stop
            self.stopped_here = True

    def take(self) -> tuple[str, list[LogprobEntry]]:
        """The text and logprobs not yet sent, minus the held-back tail while the sample is running."""
        end = len(self.text) if self.finished else max(self._sent_chars, len(self.text) - self._holdback)
        text = self.text[self._sent_chars : end]
        self._sent_chars = end
        logprobs = self.logprobs[self._sent_logprobs :]
        self._sent_logprobs = len(self.logprobs)
        return text, logprobs

    def take_finish(self) -> str | None:
        """The finish reason, once, when the sample has ended (after its last text was taken)."""
        if self.finish_reason is None or self._finish_sent:
            return None
        self._finish_sent = True
        return self.finish_reason
