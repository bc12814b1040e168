"""Structured outputs: a StructuredSpec as an llguidance grammar, and whether that grammar is valid.

The gateway checks a request's grammar here (an invalid one is a 400 before anything is queued); the worker
compiles the same grammar against its tokenizer. llguidance has no dependencies and needs no torch.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from llguidance import LLMatcher

if TYPE_CHECKING:  # a TypedDict of the stubs only
    from llguidance._lib import JsonCompileOptions
from llguidance.gbnf_to_lark import any_to_lark

from shared.sampling import StructuredSpec

# What `json_object` asks for: any JSON object.
ANY_JSON_OBJECT = '{"type": "object"}'
# JSON as json.dumps writes it: ", " and ": " between items, no other whitespace. Free whitespace
# (llguidance's default) lets a small model fill its whole budget with newlines and never close the object.
JSON_LAYOUT: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
# A grammar's text, the regex or a schema longer than this is refused: compiling it is work for a worker.
MAX_GRAMMAR_CHARS = 64 * 1024


class GrammarError(ValueError):
    """A structured-output spec that does not give a valid grammar."""


def grammar_of(spec: StructuredSpec) -> str:
    """The llguidance grammar for spec; raises GrammarError for one that cannot be read."""
    if len(spec.value) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the {spec.kind} is longer than {MAX_GRAMMAR_CHARS} characters")
    try:
        if spec.kind == "json_object":
            return LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, JSON_LAYOUT)
        if spec.kind == "json":
            schema = json.loads(spec.value)
            if not isinstance(schema, dict | bool):
                raise GrammarError("a JSON schema must be an object")
            return LLMatcher.grammar_from_json_schema(spec.value, JSON_LAYOUT)
        if spec.kind == "regex":
            return LLMatcher.grammar_from_regex(spec.value)
        if spec.kind == "choice":
            choices = json.loads(spec.value)
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
                raise GrammarError("choice must be a non-empty list of strings")
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        # A grammar: Lark, or llama.cpp's GBNF (`root ::= ...`), which llguidance converts.
        return LLMatcher.grammar_from_lark(any_to_lark(spec.value))
    except GrammarError:
        raise
    except Exception as e:  # llguidance and json raise ValueError, RuntimeError and others
        raise GrammarError(f"the {spec.kind} cannot be read: {e}") from e


def grammar_error(spec: StructuredSpec) -> str | None:
    """Why spec gives no valid grammar, or None when it does (checked without a tokenizer)."""
    try:
        grammar = grammar_of(spec)
    except GrammarError as e:
        return str(e)
    error = LLMatcher.validate_grammar(grammar)
    return f"the {spec.kind} is not valid: {error.strip()}" if error else None
