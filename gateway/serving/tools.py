"""Tool calling (OpenAI's `tools`): the tool-call format, the grammar that holds a model to it, the prompt
that shows a model its tools, and the calls read back out of a sample's text.

One format for every model, the Hermes layout (what SmolLM2's larger sibling and Qwen were trained on): a call
is

    <tool_call>
    {"name": "<function>", "arguments": <a JSON object>}
    </tool_call>

and parallel calls follow one another, a newline apart. A chat template that renders `tools` itself and writes
`<tool_call>` is given the tools as they are (the model's own prompt); any other gets them in a system message
written here (tool_messages).

Calls are held to the format and to the tools' schemas by an llguidance (Lark) grammar, whatever the sampling:
with tool_choice auto, free text until a call opens and then only calls; required, calls only; a named
function, calls of that one; parallel_tool_calls false, one call. The arguments follow their schema in a fixed
JSON layout (shared.structured.JSON_LAYOUT), properties in the schema's order, so the text of a call is read
back by position (read_calls) as it streams, with nothing to guess.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from shared.structured import JSON_LAYOUT

OPEN = "<tool_call>\n"
CLOSE = "\n</tool_call>"
SEPARATOR = "\n"  # between parallel calls
_NAME_START = '{"name": "'
_ARGUMENTS_START = '", "arguments": '
_END = "}" + CLOSE  # the body's brace, then the close
# A function's name: what OpenAI allows, with nothing a JSON string or the grammar would need to escape.
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class Tool:
    """A function the model may call."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=lambda: dict(EMPTY_PARAMETERS))

    def signature(self) -> dict[str, Any]:
        """As OpenAI's request names it, for a prompt."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


# -- the grammar ------------------------------------------------------------------------------------------


def _literal(text: str) -> str:
    return json.dumps(text)  # a Lark string literal: the same escapes as JSON for ASCII text


def grammar(tools: list[Tool], choice: str | None, parallel: bool) -> str:
    """The Lark grammar of an answer: choice "auto" (text, or text then calls), "required" (calls), or the
    name of the one function to call."""
    callable_tools = [t for t in tools if choice in ("auto", "required") or t.name == choice]
    lines = [f"fn: {' | '.join(f'fn{i}' for i in range(len(callable_tools)))}"]
    for i, tool in enumerate(callable_tools):
        schema = {**tool.parameters, "x-guidance": dict(JSON_LAYOUT)}
        lines.append(f"fn{i}: {_literal(tool.name + _ARGUMENTS_START)} %json {json.dumps(schema)}")
    more = f" ({_literal(SEPARATOR + OPEN)} body)*" if parallel else ""
    lines.append(f"body: {_literal(_NAME_START)} fn {_literal('}' + CLOSE)}")
    if choice == "auto":
        # Text with no call in it, or text up to the first opening of a call (one lexeme each: llguidance's
        # lexer does not backtrack, so the opening cannot be a lexeme of its own after free text).
        start = f"start: PLAIN | OPENING body{more}"
        lines += [
            r"PLAIN: /(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/",
            r"OPENING: /(?s:.*)<tool_call>\n/ & ~/(?s:.*)<tool_call>(?s:.*)<tool_call>(?s:.*)/",
        ]
    else:
        start = f"start: {_literal(OPEN)} body{more}"
    return "\n".join([start, *lines])


# -- the prompt ---------------------------------------------------------------------------------------------


def tools_section(tools: list[Tool]) -> str:
    """The system message's part that shows a model without a tool template its tools and the format."""
    signatures = "\n".join(json.dumps(t.signature(), ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\n"
        "You can call functions to answer. Their signatures, one per line, as JSON Schema:\n"
        f"<tools>\n{signatures}\n</tools>\n\n"
        "To call a function, answer with its name and arguments as one JSON object in "
        "<tool_call></tool_call> tags, one call per tag:\n"
        f'{OPEN}{{"name": "<function name>", "arguments": {{<the arguments>}}}}{CLOSE}'
    )


def call_text(name: str, arguments: Any) -> str:
    """One call as the format writes it (an assistant's earlier call, shown to the model again)."""
    body = {"name": name, "arguments": arguments}
    return OPEN + json.dumps(body, ensure_ascii=False, separators=(", ", ": ")) + CLOSE


def response_text(content: str) -> str:
    """A tool's result, as a model without a tool template is shown it (in a user turn)."""
    return f"<tool_response>\n{content}\n</tool_response>"


def call_id(request_id: str, sample: int, index: int) -> str:
    """A call's id: the same each time the request's output is read (a resumed stream, a GET)."""
    digest = hashlib.sha256(f"{request_id}/{sample}/{index}".encode()).hexdigest()
    return f"call_{digest[:24]}"


# -- reading calls back -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """A call as far as the text goes: its name (complete), its arguments so far, and whether it closed."""

    name: str
    arguments: str
    complete: bool


@dataclass(frozen=True)
class ToolView:
    """A sample's text as an assistant message: the content before the calls, and the calls."""

    content: str
    calls: list[Call]

    @property
    def called(self) -> bool:
        """Calls were made and each is complete: the answer's finish_reason is tool_calls."""
        return bool(self.calls) and all(c.complete for c in self.calls)


def read_calls(text: str, final: bool) -> ToolView:
    """The content and calls of text. While a sample runs (final False) only what cannot change is shown:
    content without a tail that may open a call or precede one (whitespace), a call once its name is whole,
    arguments without a tail that may be the call's end. So the view of a longer text always
    extends the view of a shorter one, and a stream's deltas are the differences of successive views."""
    start = text.find(OPEN)
    if start < 0:
        return ToolView(text if final else _settled(text), [])
    calls: list[Call] = []
    at: int | None = start
    while at is not None:
        call, end = _read_call(text, at + len(OPEN), final)
        if call is None:
            break
        calls.append(call)
        at = end + len(SEPARATOR) if end is not None and text.startswith(OPEN, end + len(SEPARATOR)) else None
    return ToolView(text[:start].rstrip(), calls)


def _settled(text: str) -> str:
    """text without its tail that may yet turn out to open a call, or to be the whitespace before one."""
    return _without_start_of(OPEN, text).rstrip()


def _without_start_of(mark: str, text: str) -> str:
    """text without its longest tail that is the start of mark."""
    for size in range(min(len(mark), len(text)), 0, -1):
        if mark.startswith(text[-size:]):
            return text[:-size]
    return text


def _read_call(text: str, at: int, final: bool) -> tuple[Call | None, int | None]:
    """The call whose body starts at `at`, and where it ends (None: not yet)."""
    if not text.startswith(_NAME_START, at):
        return None, None
    name_start = at + len(_NAME_START)
    name_end = text.find('"', name_start)
    if name_end < 0 or not text.startswith(_ARGUMENTS_START, name_end):
        return None, None
    name = text[name_start:name_end]
    args_start = name_end + len(_ARGUMENTS_START)
    # The fixed layout writes no newline inside the arguments: the first one after them closes the call.
    close = text.find(_END, args_start)
    if close >= 0:
        return Call(name, text[args_start:close], True), close + 1 + len(CLOSE)
    arguments = text[args_start:]
    return Call(name, arguments if final else _without_start_of(_END, arguments), False), None
