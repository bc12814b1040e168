"""Structured outputs in the engine: grammars compiled once per engine, and the per-step token bitmask.

A request's StructuredSpec becomes an llguidance grammar (shared.structured), compiled here against the
engine's tokenizer into an LLMatcher. Each sequence holds its own matcher, in step with its output tokens;
every step the sampler asks the matchers of its constrained rows for a bitmask of the tokens the grammar
allows next (one bit per token, 32 to an int32 word) and sets every other logit to -inf.
"""

from __future__ import annotations

import logging
import sys
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import llguidance.hf
import torch
from llguidance import LLMatcher, LLTokenizer

from shared.errors import ErrorCode, RequestRejected
from shared.sampling import StructuredSpec
from shared.structured import GrammarError, grammar_of

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 64
assert sys.byteorder == "little", "TokenBitmask.allowed reads the int32 words byte by byte"


class GrammarCache:
    """The engine's grammars, each compiled once against its tokenizer; every sequence gets a copy."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        max_grammars: int = MAX_CACHED_GRAMMARS,
    ) -> None:
        """tokenizer: the engine's Hugging Face (fast) tokenizer, None for an engine without one (rejected);
        vocab_size: the model's, which may exceed the tokenizer's."""
        if tokenizer is None:
            raise RequestRejected(ErrorCode.INVALID_REQUEST, "this engine has no tokenizer for grammars")
        eos = sorted(eos_token_ids)
        # About a second for a 50k vocabulary: built once per engine.
        self.ll_tokenizer: LLTokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=eos or None
        )
        self.vocab_size = vocab_size
        self.max_grammars = max_grammars
        # (kind, value) of a spec -> a matcher that has consumed nothing; only ever copied, never advanced.
        self._compiled: OrderedDict[tuple[str, str], LLMatcher] = OrderedDict()
        self.num_compiles = 0

    def __len__(self) -> int:
        return len(self._compiled)

    def matcher(
        self, spec: StructuredSpec, prompt_token_ids: Sequence[int] = (), num_resumed_tokens: int = 0
    ) -> LLMatcher:
        """A fresh matcher for spec that has consumed the last num_resumed_tokens of the prompt: output that a
        sample resumed after a failover already streamed.

        Raises RequestRejected(INVALID_REQUEST) for a grammar that does not compile, or resumed tokens that it
        refuses.
        """
        if not 0 <= num_resumed_tokens < max(1, len(prompt_token_ids)):
            raise RequestRejected(
                ErrorCode.INVALID_REQUEST, "num_resumed_tokens must be below the prompt's length"
            )
        key = (spec.kind, spec.value)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compile(spec)
            self._compiled[key] = compiled
            if len(self._compiled) > self.max_grammars:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        matcher = compiled.deep_copy()
        resumed = (
            list(prompt_token_ids[len(prompt_token_ids) - num_resumed_tokens :]) if num_resumed_tokens else []
        )
        if resumed and not matcher.consume_tokens(resumed):
            raise RequestRejected(
                ErrorCode.INVALID_REQUEST,
                f"the resumed output does not follow the {spec.kind}: {matcher.get_error().strip()}",
            )
        return matcher

    def _compile(self, spec: StructuredSpec) -> LLMatcher:
        try:
            grammar = grammar_of(spec)
        except GrammarError as e:
            raise RequestRejected(ErrorCode.INVALID_REQUEST, str(e)) from e
        self.num_compiles += 1
        try:
            matcher = LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        except Exception as e:  # documented never to raise; an API misuse would
            raise RequestRejected(ErrorCode.INVALID_REQUEST, f"the {spec.kind} does not compile: {e}") from e
        if matcher.is_error():
            raise RequestRejected(
                ErrorCode.INVALID_REQUEST, f"the {spec.kind} does not compile: {matcher.get_error().strip()}"
            )
        return matcher


def advance(matcher: LLMatcher, token_id: int) -> bool:
    """Feed the sampled token to the matcher; True when the grammar lets the sequence go no further."""
    if not matcher.consume_token(token_id):
        # The mask allows only what the grammar accepts, so this means a matcher that failed on its own
        # (a resource limit): end the sequence rather than sample unconstrained text.
        logger.warning("a grammar matcher failed: %s", matcher.get_error().strip())
        return True
    return matcher.is_stopped()


class TokenBitmask:
    """A preallocated int32 bitmask, a row per constrained sequence of a step, words of 32 tokens each."""

    def __init__(self) -> None:
        self._buffer = torch.zeros(0, 0, dtype=torch.int32)
        self._byte_bits: dict[torch.device, torch.Tensor] = {}  # [256, 8] bool: the bits of each byte

    def fill(self, matchers: Sequence[LLMatcher], vocab_size: int) -> torch.Tensor:
        """Row i: the tokens matchers[i] allows next. [len(matchers), (vocab_size + 31) // 32], on the CPU."""
        num_words = (vocab_size + 31) // 32
        rows = len(matchers)
        if self._buffer.shape[0] < rows or self._buffer.shape[1] != num_words:
            self._buffer = torch.zeros(
                max(rows, 2 * self._buffer.shape[0]),
                num_words,
                dtype=torch.int32,
                pin_memory=torch.cuda.is_available(),
            )
        nbytes = num_words * 4
        base = self._buffer.data_ptr()
        for i, matcher in enumerate(matchers):
            # Releases the GIL; llguidance checks nbytes against its tokenizer's vocabulary.
            matcher.unsafe_compute_mask_ptr(base + i * nbytes, nbytes)
        return self._buffer[:rows]

    def allowed(self, bitmask: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
        """The bitmask [rows, words] unpacked to bool [rows, vocab_size] on device (False past the words)."""
        table = self._byte_bits.get(device)
        if table is None:
            byte = torch.arange(256, device=device).unsqueeze(1)
            table = self._byte_bits[device] = ((byte >> torch.arange(8, device=device)) & 1).bool()
        words = bitmask.to(device, non_blocking=True)
        # One lookup per byte: on a CPU several times faster than shifting each word 32 ways. Byte i of a
        # (little-endian) word w holds tokens 32 * w + 8 * i ... + 7.
        index = words.view(torch.uint8).flatten().int()
        bits = table.index_select(0, index).view(words.shape[0], -1)
        if bits.shape[1] >= vocab_size:
            return bits[:, :vocab_size]
        return torch.nn.functional.pad(bits, (0, vocab_size - bits.shape[1]), value=False)


def apply_token_bitmask(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab_size] with -inf where allowed [rows, vocab_size] is False (out of place)."""
    return logits.masked_fill(~allowed, float("-inf"))


def apply_grammars(
    bitmask: TokenBitmask, logits: torch.Tensor, raw_logits: torch.Tensor, matchers: list[LLMatcher | None]
) -> None:
    """Hold each constrained row of logits [num_rows, vocab_size] (matchers[i] not None) to its grammar, in
    place: logits must be the sampler's own tensor, not raw_logits.

    The grammar wins over min_tokens, stop tokens and allowed_token_ids: a row they leave with no token the
    grammar allows (say the grammar allows only EOS while min_tokens masks it) samples from the model's own
    logits (raw_logits) under the grammar alone, never from an all -inf row.
    """
    assert logits is not raw_logits
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    vocab_size = logits.shape[-1]
    words = bitmask.fill([m for m in matchers if m is not None], vocab_size)
    refused = ~bitmask.allowed(words, vocab_size, logits.device)
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(refused, float("-inf"))
    else:
        # Row by row, in place: cheaper than gathering the rows and scattering them back.
        for j, i in enumerate(rows):
            logits[i].masked_fill_(refused[j], float("-inf"))
    dead = torch.isneginf(logits.amax(dim=-1))
    if bool(dead.any()):
        for j, i in enumerate(rows):
            if dead[i]:
                logits[i] = raw_logits[i].masked_fill(refused[j], float("-inf"))
