"""OpenAI's Responses API in terms of chat completions: a request's input items become chat messages, a chat
completion's message and tool calls become output items, and its stream chunks become the Responses API's
typed events (`response.created` ... `response.completed`, each with its sequence_number).

One response is one chat completion with n = 1: the same prompt (the model's chat template, tools in the
tool-call format of serving.tools), the same grammar for tool calls and text.format, the same workers.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import Field

from gateway.serving.body_model import Body
from gateway.serving.errors import APIError, bad_request
from gateway.serving.schemas import MAX_TOOLS
from shared.sampling import MaxTokens

Json = dict[str, Any]

# What an input message's content parts may be: text, whoever wrote it.
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal"})
_ROLES = frozenset({"user", "system", "developer", "assistant"})
# Sampling options a response takes as a chat completion does (vLLM accepts its extras here too).
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
# Status of a response that will not change again.
FINAL = frozenset({"completed", "incomplete", "failed", "cancelled"})


def new_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


class TextFormat(Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(Body):
    format: TextFormat = Field(default_factory=lambda: TextFormat.model_validate({}))


class ResponsesRequest(Body):
    """POST /v1/responses."""

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(
        description="a user message, or items: messages, function_call and function_call_output"
    )
    instructions: str | None = Field(None, description="a system message first (not carried to a later turn)")
    previous_response_id: str | None = Field(
        None, description="a stored response this one continues: its input and output come first"
    )
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="function tools ({type: function, name, description, parameters, strict})"
    )
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    max_output_tokens: MaxTokens | None = None
    stream: bool = False
    store: bool = Field(
        True, description="keep the response (RESPONSE_TTL_S) for GET and previous_response_id"
    )
    background: bool = Field(False, description="answer at once (queued) and run on; needs store")
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = Field(
        None, description="only disabled: a prompt too long is a 400"
    )
    include: list[str] | None = None
    priority: Annotated[int, Field(ge=-(2**31), lt=2**31)] = 0
    temperature: Any = None
    top_p: Any = None
    top_k: Any = None
    min_p: Any = None
    seed: Any = None
    repetition_penalty: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None


# -- the request as a chat completion -----------------------------------------------------------------


def _need(item: Json, name: str, where: str, kind: type = str) -> Any:
    value = item.get(name)
    if not isinstance(value, kind):
        raise bad_request(f"{where}.{name} is required (a {kind.__name__})", param=f"{where}.{name}")
    return value


def _text_of(content: Any, where: str) -> str:
    """An item's content as one text: a string, or text parts (other parts: 400 naming the part)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise bad_request(
                f"{where}[{j}].type {kind!r} is not served: only text parts (input_text, output_text)",
                param=f"{where}[{j}].type",
            )
        texts.append(_need(part, "refusal" if kind == "refusal" else "text", f"{where}[{j}]"))
    return "\n".join(texts)


def input_items(body: ResponsesRequest) -> list[Json]:
    """The request's input as stored items, each with an id (a string input is one user message)."""
    given = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    if not given:
        raise bad_request("input is empty", param="input")
    items = []
    for i, item in enumerate(given):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad_request(
                    f"{where}.role must be one of {', '.join(sorted(_ROLES))}", param=f"{where}.role"
                )
            text = _text_of(item.get("content"), f"{where}.content")
            part = "output_text" if role == "assistant" else "input_text"
            items.append(
                {
                    "type": "message",
                    "id": item.get("id") or new_id("msg"),
                    "role": role,
                    "content": [
                        {"type": part, "text": text, **({"annotations": []} if role == "assistant" else {})}
                    ],
                    "status": "completed",
                }
            )
        elif kind == "function_call":
            items.append(
                {
                    "type": "function_call",
                    "id": item.get("id") or new_id("fc"),
                    "call_id": _need(item, "call_id", where),
                    "name": _need(item, "name", where),
                    "arguments": _need(item, "arguments", where),
                    "status": "completed",
                }
            )
        elif kind == "function_call_output":
            output = item.get("output")
            items.append(
                {
                    "type": "function_call_output",
                    "id": item.get("id") or new_id("fco"),
                    "call_id": _need(item, "call_id", where),
                    "output": _text_of(output, f"{where}.output"),
                    "status": "completed",
                }
            )
        else:
            raise bad_request(
                f"{where}.type {kind!r} is not served: messages, function_call and function_call_output are",
                param=f"{where}.type",
            )
    return items


def messages_of(items: list[Json]) -> list[Json]:
    """Stored items as chat messages: consecutive function calls join one assistant message (the one before
    them, when it is the assistant's), a call's output is a tool message."""
    messages: list[Json] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            messages.append({"role": item["role"], "content": "\n".join(p["text"] for p in item["content"])})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function"}
            call["function"] = {"name": item["name"], "arguments": item["arguments"]}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def _chat_tools(body: ResponsesRequest) -> list[Json] | None:
    if body.tools is None:
        return None
    tools = []
    for i, tool in enumerate(body.tools):
        if tool.get("type") != "function":
            raise bad_request(
                f"tools[{i}].type {tool.get('type')!r} is not served: only function tools are",
                param=f"tools[{i}].type",
            )
        function = {k: v for k, v in tool.items() if k != "type"}
        tools.append({"type": "function", "function": function})
    return tools


def _chat_tool_choice(body: ResponsesRequest) -> Any:
    choice = body.tool_choice
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise bad_request(
            "tool_choice must be none, auto, required or {type: function, name}", param="tool_choice"
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(body: ResponsesRequest) -> Json | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None or fmt.name is None:
        raise bad_request("text.format of type json_schema needs a name and a schema", param="text.format")
    schema: Json = {"name": fmt.name, "schema": fmt.schema_}
    schema.update(
        {k: v for k, v in (("description", fmt.description), ("strict", fmt.strict)) if v is not None}
    )
    return {"type": "json_schema", "json_schema": schema}


def chat_request(body: ResponsesRequest, conversation: list[Json]) -> Json:
    """The chat completion body that answers the request: instructions, then the conversation so far."""
    for name in body.include or []:
        if name != "reasoning.encrypted_content":  # (no reasoning items are ever made to include)
            raise bad_request(f"include {name!r} is not served", param="include")
    messages = (
        [{"role": "system", "content": body.instructions}] if body.instructions else []
    ) + conversation
    chat: Json = {
        "model": body.model,
        "messages": messages,
        "stream": body.stream,
        "priority": body.priority,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    optional = {
        "tools": _chat_tools(body),
        "tool_choice": _chat_tool_choice(body),
        "response_format": _response_format(body),
        "max_completion_tokens": body.max_output_tokens,
        "user": body.user,
        **{name: getattr(body, name) for name in SAMPLING_FIELDS},
    }
    chat.update({k: v for k, v in optional.items() if v is not None})
    return chat


# Where a chat completion's parameter is named in a response request.
_PARAMS = (
    ("max_completion_tokens", "max_output_tokens"),
    ("response_format", "text.format"),
    ("messages", "input"),
)


def as_responses_error(error: APIError) -> APIError:
    """A chat completion's error, naming the parameter as the response request does."""
    param = error.param
    if param is None:
        return error
    if param.startswith("tools[") and ".function" in param:
        param = param.replace(".function", "", 1)
    for chat, ours in _PARAMS:
        if param == chat or param.startswith(chat + "[") or param.startswith(chat + "."):
            param = ours + param[len(chat) :] if chat != "messages" else ours
    message = error.message.replace("max_completion_tokens", "max_output_tokens")
    return APIError(error.code, message, param=param, retry_after=error.retry_after)


# -- the response object ------------------------------------------------------------------------------


def response_object(body: ResponsesRequest, response_id: str, model: str, status: str) -> Json:
    """A response before its output: what it was asked, as OpenAI's object echoes it."""
    fmt = body.text.format if body.text is not None else None
    text = {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}}
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "background": body.background,
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": model,
        "output": [],
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "store": body.store,
        "temperature": body.temperature,
        "text": text,
        "tool_choice": body.tool_choice
        if body.tool_choice is not None
        else ("auto" if body.tools else "none"),
        "tools": body.tools or [],
        "top_p": body.top_p,
        "truncation": body.truncation or "disabled",
        "usage": None,
        "user": body.user,
        "metadata": body.metadata or {},
    }


def message_id(response_id: str) -> str:
    return "msg_" + response_id.removeprefix("resp_")


def call_item_id(response_id: str, k: int) -> str:
    return f"fc_{response_id.removeprefix('resp_')}_{k}"


def message_item(response_id: str, text: str, status: str = "completed") -> Json:
    return {
        "type": "message",
        "id": message_id(response_id),
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def call_item(response_id: str, k: int, call: Json, status: str = "completed") -> Json:
    return {
        "type": "function_call",
        "id": call_item_id(response_id, k),
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": status,
    }


def responses_usage(chat_usage: Json) -> Json:
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def finished(response: Json, completion: Json) -> Json:
    """The response with a chat completion's answer: its output items, usage and status."""
    choice = completion["choices"][0]
    message = choice["message"]
    rid = response["id"]
    output = [message_item(rid, message["content"])] if message.get("content") else []
    output += [call_item(rid, k, call) for k, call in enumerate(message.get("tool_calls") or [])]
    status, details = end_status(choice["finish_reason"])
    if status == "incomplete" and output:  # the item the limit cut
        output[-1]["status"] = "incomplete"
    return {
        **response,
        "status": status,
        "incomplete_details": details,
        "output": output,
        "usage": responses_usage(completion["usage"]),
    }


def end_status(finish_reason: str | None) -> tuple[str, Json | None]:
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":
        return "cancelled", None
    return "completed", None


def output_messages(response: Json) -> list[Json]:
    """A response's output as chat messages (what a later turn's conversation holds)."""
    return messages_of([item for item in response["output"] if item["type"] in ("message", "function_call")])


def failed(response: Json, error: APIError) -> Json:
    return {**response, "status": "failed", "error": {"code": str(error.code), "message": error.message}}


# -- the stream ---------------------------------------------------------------------------------------


class EventStream:
    """A chat completion's stream chunks as the Responses API's events: the message's item and its text part
    opened at its first text, each tool call's item at its id and name, the arguments as they come, every open
    item closed at the end, then the response completed."""

    def __init__(self, response: Json) -> None:
        self.response = response
        self._seq = 0
        self._output: list[Json] = []
        self._text: Json | None = None  # the message item, while its text grows
        self._call: Json | None = None  # the tool call item whose arguments grow
        self._calls = 0

    def event(self, kind: str, **fields: Any) -> Json:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def opening(self) -> list[Json]:
        return [
            self.event("response.created", response={**self.response, "status": "in_progress"}),
            self.event("response.in_progress", response={**self.response, "status": "in_progress"}),
        ]

    def chunk(self, chunk: Json) -> Iterator[Json]:
        """The events of one chat chunk (its delta: content, tool_calls)."""
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("content"):
                yield from self._add_text(delta["content"])
            for call in delta.get("tool_calls") or []:
                if "id" in call:
                    yield from self._close()
                    yield from self._open_call(call)
                fragment = call.get("function", {}).get("arguments")
                if fragment and self._call is not None:
                    self._call["arguments"] += fragment
                    yield self._on_item(self._call, "response.function_call_arguments.delta", delta=fragment)

    def _on_item(self, item: Json, kind: str, **fields: Any) -> Json:
        return self.event(kind, item_id=item["id"], output_index=self._output.index(item), **fields)

    def _add_text(self, text: str) -> Iterator[Json]:
        if self._text is None:
            yield from self._close()
            item = self._text = message_item(self.response["id"], "", status="in_progress")
            item["content"] = []
            self._output.append(item)
            yield self.event(
                "response.output_item.added", output_index=len(self._output) - 1, item=dict(item, content=[])
            )
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            yield self._on_item(item, "response.content_part.added", content_index=0, part=dict(part))
        self._text["content"][0]["text"] += text
        yield self._on_item(
            self._text, "response.output_text.delta", content_index=0, delta=text, logprobs=[]
        )

    def _open_call(self, call: Json) -> Iterator[Json]:
        item = self._call = call_item(
            self.response["id"],
            self._calls,
            {**call, "function": {**call["function"], "arguments": ""}},
            "in_progress",
        )
        self._calls += 1
        self._output.append(item)
        yield self.event("response.output_item.added", output_index=len(self._output) - 1, item=dict(item))
        # (the arguments in the opening delta follow as the first arguments delta)

    def _close(self) -> Iterator[Json]:
        """Close the item that is open: its text (or arguments) done, then the item."""
        if self._text is not None:
            item, self._text = self._text, None
            part = item["content"][0]
            yield self._on_item(
                item, "response.output_text.done", content_index=0, text=part["text"], logprobs=[]
            )
            yield self._on_item(item, "response.content_part.done", content_index=0, part=dict(part))
            item["status"] = "completed"
            yield self.event("response.output_item.done", output_index=self._output.index(item), item=item)
        if self._call is not None:
            item, self._call = self._call, None
            yield self._on_item(
                item, "response.function_call_arguments.done", arguments=item["arguments"], name=item["name"]
            )
            item["status"] = "completed"
            yield self.event("response.output_item.done", output_index=self._output.index(item), item=item)

    def end(self, final: Json) -> Iterator[Json]:
        """Close what is open, then the response's end: completed, incomplete or failed (final: the
        response as it ends)."""
        yield from self._close()
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            final["status"], "response.failed"
        )
        yield self.event(kind, response=final)
