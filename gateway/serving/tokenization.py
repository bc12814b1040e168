"""The served model's tokenizer: prompts and chat templates to ids, and ids back to text as they arrive."""

from __future__ import annotations

import inspect
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from gateway.serving.errors import bad_request
from shared.model_files import tokenizer_folder

# Output is decoded after a few prompt tokens, so a tokenizer that drops a leading space at the start of a
# text (SentencePiece) still gives the first output token its space.
_CONTEXT_TOKENS = 4
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE writes every byte as one printable character: printable Latin-1 bytes stand for
    themselves and the rest are moved past 255, in byte order. This is the inverse map."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in chars.items()}


class Tokenizer:
    """The model's tokenizer, chat template and context length, and per-token text for logprobs."""

    def __init__(self, model: str | None, max_model_len: int | None = None) -> None:
        folder = Path(tokenizer_folder(model))
        self.hf: Any = AutoTokenizer.from_pretrained(folder)
        config_file = folder / "config.json"
        config: dict[str, Any] = json.loads(config_file.read_text()) if config_file.exists() else {}
        context = int(config.get("max_position_embeddings") or self.hf.model_max_length)
        self.max_model_len = min(context, max_model_len) if max_model_len else context
        self.vocab_size = max(int(config.get("vocab_size") or 0), len(self.hf))
        decoder = json.loads(self.hf.backend_tokenizer.to_str()).get("decoder") if self.hf.is_fast else None
        self._alphabet = _byte_level_alphabet() if '"ByteLevel"' in json.dumps(decoder) else None
        self._added_ids = set(self.hf.added_tokens_decoder)
        self._bytes: dict[int, bytes] = {}  # at most one entry per vocabulary token
        # Options of apply_chat_template itself: a request's template variables must not set them.
        self._template_parameters = {
            name
            for name, p in inspect.signature(self.hf.apply_chat_template).parameters.items()
            if p.kind is not inspect.Parameter.VAR_KEYWORD
        }

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """A completion prompt as it is (as the offline API tokenizes it): no special tokens unless asked."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    @property
    def writes_tool_calls(self) -> bool:
        """The chat template renders `tools` itself, in the tool-call format served here (serving.tools)."""
        template = self.hf.chat_template
        return isinstance(template, str) and "tools" in template and "<tool_call>" in template

    def encode_chat(
        self,
        conversation: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The chat template applied to a conversation (with tools: for a template that writes_tool_calls),
        then tokenized (the template writes its own special tokens, so none are added unless asked)."""
        template_kwargs = template_kwargs or {}
        reserved = sorted(set(template_kwargs) & self._template_parameters)
        if reserved:
            raise bad_request(
                f"chat_template_kwargs may not set {', '.join(reserved)}: they are not template variables",
                param="chat_template_kwargs",
            )
        try:
            rendered = self.hf.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools or None,
                **template_kwargs,
            )
        except Exception as e:  # the template itself refuses the conversation (e.g. roles out of order)
            raise bad_request(f"the chat template refused the messages: {e}", param="messages") from e
        return self.encode(str(rendered), add_special_tokens=add_special_tokens)

    def token_strs(self, token_ids: list[int]) -> list[str]:
        """Each token as the tokenizer's vocabulary writes it (`Ġthe` for " the" in byte-level BPE)."""
        return [str(t) for t in self.hf.convert_ids_to_tokens(token_ids)]

    def decode(self, token_ids: list[int]) -> str:
        return str(self.hf.decode(token_ids, skip_special_tokens=True))

    def check_ids(self, token_ids: list[int], param: str) -> None:
        bad = next((t for t in token_ids if t >= self.vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"token id {bad} is out of the vocabulary: token ids must be in [0, {self.vocab_size})",
                param=param,
            )

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a token may hold part of a multi-byte character)."""
        cached = self._bytes.get(token_id)
        if cached is None:
            cached = self._bytes[token_id] = self._token_bytes(token_id)
        return cached

    def _token_bytes(self, token_id: int) -> bytes:
        token = self.hf.convert_ids_to_tokens(token_id)
        if token is None:
            return b""
        if token_id in self._added_ids:
            return str(token).encode()
        if self._alphabet is not None and all(c in self._alphabet for c in token):
            return bytes(self._alphabet[c] for c in token)
        match = _BYTE_TOKEN.fullmatch(token)
        if match:
            return bytes([int(match.group(1), 16)])
        return str(self.hf.decode([token_id])).encode()

    def token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def detokenizer(self, prompt_token_ids: list[int]) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_token_ids[-_CONTEXT_TOKENS:])


@cache
def load_tokenizer(model: str | None, max_model_len: int | None = None) -> Tokenizer:
    """One Tokenizer per model and limit in a process (it is only read once loaded)."""
    return Tokenizer(model, max_model_len)


class IncrementalDetokenizer:
    """The text of a growing list of token ids, released only in whole characters.

    Each step decodes a short window: the tokens already released since the last step (for context)
    and the new ones; the new text is what the window gained. While the window ends in U+FFFD a
    character is still incomplete, so nothing is released and the window grows.
    """

    def __init__(self, tokenizer: Tokenizer, context_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._ids = list(context_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """The text token_id completes (often all of its own text, sometimes none, sometimes more)."""
        self._ids.append(token_id)
        return self._release(final=False)

    def flush(self) -> str:
        """Whatever is still held (an incomplete character at the very end comes out as U+FFFD)."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset])
        full = decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        new = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += new
        return new
