"""From a validated request body to a tokenized GenerateRequest within the model's limits."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import jsonschema
import pydantic
from pydantic import Field

from gateway.serving.errors import bad_request, from_validation_error
from gateway.serving.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTemplateBody,
    CompletionRequest,
    MessageToolCall,
    NamedToolChoice,
    SamplingBody,
    conversation,
)
from gateway.serving.structured_params import StructuredError
from gateway.serving.tokenization import Tokenizer
from gateway.serving.tools import (
    EMPTY_PARAMETERS,
    Tool,
    call_text,
    grammar,
    response_text,
    tools_section,
)
from shared.errors import ErrorCode
from shared.protocol import GenerateRequest, RequestMeta
from shared.sampling import SamplingSpec, StructuredSpec, options_of
from shared.structured import grammar_error


class Prepared(RequestMeta):
    """A validated, tokenized request: what its record keeps (RequestMeta, the one definition), and how this
    client reads it (stream)."""

    created: int = Field(default_factory=lambda: int(time.time()))
    stream: bool = False

    def meta(self, owner: str) -> RequestMeta:
        return RequestMeta.model_validate({**self._kept(), "owner": owner})

    @classmethod
    def from_meta(cls, meta: RequestMeta, *, stream: bool) -> Prepared:
        """The request as it was prepared when it was created, for a client that resumes it."""
        return cls.model_validate(
            {**{name: getattr(meta, name) for name in RequestMeta.model_fields}, "stream": stream}
        )

    def _kept(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in RequestMeta.model_fields}


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def prepare_completion(body: CompletionRequest, tokenizer: Tokenizer, model: str = "") -> Prepared:
    if isinstance(body.prompt, str):
        prompt_text, prompt_ids = body.prompt, tokenizer.encode(body.prompt)
    else:
        prompt_ids = [t for t in body.prompt if isinstance(t, int)]
        assert len(prompt_ids) == len(body.prompt), (
            "one prompt at a time (gateway.serving.prompt_batch splits lists)"
        )
        tokenizer.check_ids(prompt_ids, "prompt")
        prompt_text = tokenizer.decode(prompt_ids) if body.echo else ""
    if not prompt_ids:
        raise bad_request("the prompt is empty", param="prompt")
    num_given = len(prompt_ids)
    prompt_ids = _truncate(prompt_ids, body.truncate_prompt_tokens, tokenizer)
    if body.echo and len(prompt_ids) < num_given:
        prompt_text = tokenizer.decode(prompt_ids)  # the echo is the prompt the model saw
    # Echo with logprobs shows the prompt's tokens with theirs, as vLLM does.
    prompt_logprobs = _most(body.logprobs if body.echo else None, _prompt_logprobs(body))
    sampling = _sampling(body, body.max_tokens, body.logprobs, prompt_logprobs, len(prompt_ids), tokenizer)
    return Prepared(
        request=_request("cmpl", prompt_ids, sampling, body.priority, model),
        chat=False,
        stop=body.stop_strings,
        prompt_text=prompt_text,
        echo=body.echo,
        want_logprobs=body.logprobs is not None,
        stream=body.stream,
        include_usage=body.include_usage,
        continuous_usage_stats=body.continuous_usage_stats,
        include_stop_str_in_output=body.include_stop_str_in_output,
        prompt_logprobs=_prompt_logprobs(body),
    )


@dataclass(frozen=True)
class ToolCalling:
    """A request's tools, and how it lets the model call them: choice none, auto, required or a function's
    name; parallel: more than one call."""

    tools: list[Tool]
    choice: str
    parallel: bool

    @property
    def calls(self) -> bool:
        return self.choice != "none"


def tool_calling(body: ChatTemplateBody) -> ToolCalling | None:
    """The tools asked for (None: none), checked: 400 naming the parameter at fault."""
    named = body.tool_choice.function.name if isinstance(body.tool_choice, NamedToolChoice) else None
    tools = body.tools or []
    choice = named or str(body.tool_choice or ("auto" if tools else "none"))
    if not tools:
        if choice != "none":
            raise bad_request(f"tool_choice {choice!r} needs tools to call", param="tool_choice")
        return None
    names = [t.function.name for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise bad_request(f"tools name a function more than once: {', '.join(twice)}", param="tools")
    if named is not None and named not in names:
        raise bad_request(
            f"tool_choice names the function {named!r}, which is not in tools", param="tool_choice"
        )
    checked = []
    for i, tool in enumerate(tools):
        function = tool.function
        parameters = function.parameters if function.parameters is not None else dict(EMPTY_PARAMETERS)
        param = f"tools[{i}].function.parameters"
        try:
            jsonschema.validators.validator_for(parameters).check_schema(parameters)
        except jsonschema.SchemaError as e:
            raise bad_request(f"{param} is not a valid JSON Schema: {e.message}", param=param) from e
        if parameters.get("type") != "object":
            raise bad_request(f"{param} must be the JSON Schema of an object", param=param)
        checked.append(Tool(function.name, function.description, parameters))
    return ToolCalling(checked, choice, body.parallel_tool_calls)


def _tool_grammar(calling: ToolCalling, body: ChatCompletionRequest) -> StructuredSpec:
    if body.structured() is not None:
        raise bad_request(
            "a structured output cannot be combined with tool calls (set tool_choice to none)",
            param="response_format",
        )
    spec = StructuredSpec(kind="grammar", value=grammar(calling.tools, calling.choice, calling.parallel))
    error = grammar_error(spec)
    if error is not None:  # a schema llguidance cannot compile
        raise bad_request(f"the tools' schemas cannot be followed: {error}", param="tools")
    return spec


def chat_turns(body: ChatTemplateBody, calling: ToolCalling | None, native: bool) -> list[dict[str, Any]]:
    """The messages as the chat template takes them. Earlier calls and tools' results are written in the
    tool-call format (serving.tools), unless the template writes them itself (native); so are the tools,
    in the system message."""
    if native:
        return [_native_turn(i, m) for i, m in enumerate(body.messages)]
    turns: list[dict[str, Any]] = []
    results = False  # the last turn holds tools' results
    for i, (message, turn) in enumerate(zip(body.messages, conversation(body.messages))):
        if message.tool_calls:
            calls = [
                call_text(c.function.name, _arguments(i, j, c)) for j, c in enumerate(message.tool_calls)
            ]
            turn["content"] = "\n".join([turn["content"], *calls] if turn["content"] else calls)
        if message.role == "tool":
            content = response_text(turn["content"])
            if results:  # the results of one turn's calls go together
                turns[-1]["content"] += "\n" + content
                continue
            turn = {"role": "user", "content": content}
        results = message.role == "tool"
        turns.append(turn)
    if calling is not None:
        section = tools_section(calling.tools)
        if turns and turns[0]["role"] == "system":
            turns[0]["content"] = f"{turns[0]['content']}\n\n{section}"
        else:
            turns.insert(0, {"role": "system", "content": section})
    return turns


def _native_turn(i: int, message: ChatMessage) -> dict[str, Any]:
    """A message as Hugging Face's tool-calling templates take it (arguments as an object)."""
    turn: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role}
    turn["content"] = message.text()
    if message.name is not None:
        turn["name"] = message.name
    if message.tool_calls:
        turn["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": _arguments(i, j, c)},
            }
            for j, c in enumerate(message.tool_calls)
        ]
    if message.tool_call_id is not None:
        turn["tool_call_id"] = message.tool_call_id
    return turn


def _arguments(i: int, j: int, call: MessageToolCall) -> Any:
    try:
        return json.loads(call.function.arguments)
    except json.JSONDecodeError as e:
        param = f"messages[{i}].tool_calls[{j}].function.arguments"
        raise bad_request(f"{param} is not JSON: {e}", param=param) from e


def encode_conversation(
    body: ChatTemplateBody, tokenizer: Tokenizer, **options: Any
) -> tuple[list[int], ToolCalling | None]:
    """The prompt's token ids (the chat template over the messages, and the tools), and the tools checked."""
    calling = tool_calling(body)
    native = calling is not None and tokenizer.writes_tool_calls
    tools = [t.signature() for t in calling.tools] if calling is not None and native else None
    turns = chat_turns(body, calling, native)
    return tokenizer.encode_chat(turns, **body.template_options(), tools=tools, **options), calling


def prepare_chat(body: ChatCompletionRequest, tokenizer: Tokenizer, model: str = "") -> Prepared:
    prompt_ids, calling = encode_conversation(body, tokenizer)
    if not prompt_ids:
        raise bad_request("the messages make an empty prompt", param="messages")
    prompt_ids = _truncate(prompt_ids, body.truncate_prompt_tokens, tokenizer)
    # Echo: the response starts with the final message when it is the assistant's (the one it continues).
    echo = body.echo and body.messages[-1].role == "assistant"
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    structured = _tool_grammar(calling, body) if calling is not None and calling.calls else None
    sampling = _sampling(
        body, max_tokens, logprobs, _prompt_logprobs(body), len(prompt_ids), tokenizer, structured
    )
    return Prepared(
        request=_request("chatcmpl", prompt_ids, sampling, body.priority, model),
        chat=True,
        tool_calls=calling is not None and calling.calls,
        stop=body.stop_strings,
        prompt_text=body.messages[-1].text() if echo else "",
        echo=echo,
        want_logprobs=body.logprobs,
        stream=body.stream,
        include_usage=body.include_usage,
        continuous_usage_stats=body.continuous_usage_stats,
        include_stop_str_in_output=body.include_stop_str_in_output,
        prompt_logprobs=_prompt_logprobs(body),
    )


def _prompt_logprobs(body: SamplingBody) -> int | None:
    """The prompt_logprobs a response shows: none in a stream (where only 0 is accepted), as in vLLM."""
    return None if body.stream else body.prompt_logprobs


def _most(*counts: int | None) -> int | None:
    """The largest of the logprob counts asked for (None: none was)."""
    return max((c for c in counts if c is not None), default=None)


def _truncate(prompt_ids: list[int], keep: int | None, tokenizer: Tokenizer) -> list[int]:
    """The last `keep` prompt tokens (vLLM's truncate_prompt_tokens; -1: as many as the model's context)."""
    if keep is None:
        return prompt_ids
    limit = tokenizer.max_model_len
    if keep > limit:
        raise bad_request(
            f"truncate_prompt_tokens ({keep}) is more than the model's context of {limit} tokens",
            param="truncate_prompt_tokens",
        )
    return prompt_ids[-limit:] if keep == -1 else prompt_ids[-keep:]


def _sampling(
    body: SamplingBody,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    num_prompt_tokens: int,
    tokenizer: Tokenizer,
    structured: StructuredSpec | None = None,
) -> SamplingSpec:
    """structured: the request's grammar when it is not the body's own structured output (tool calls)."""
    limit = tokenizer.max_model_len
    if num_prompt_tokens >= limit:
        raise bad_request(
            f"the prompt has {num_prompt_tokens} tokens; the model's context is {limit} tokens "
            "and the prompt must leave room for at least one more",
            param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            code=ErrorCode.CONTEXT_LENGTH_EXCEEDED,
        )
    param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
    if max_tokens is None:
        max_tokens = limit - num_prompt_tokens
    elif num_prompt_tokens + max_tokens > limit:
        raise bad_request(
            f"the prompt ({num_prompt_tokens} tokens) plus {param} ({max_tokens}) is more than the model's "
            f"context of {limit} tokens",
            param=param,
            code=ErrorCode.CONTEXT_LENGTH_EXCEEDED,
        )
    tokenizer.check_ids(body.stop_token_ids, "stop_token_ids")
    tokenizer.check_ids(list(body.logit_bias), "logit_bias")
    if body.allowed_token_ids is not None:
        tokenizer.check_ids(body.allowed_token_ids, "allowed_token_ids")
    options = {**options_of(body), "prompt_logprobs": prompt_logprobs}
    try:
        return SamplingSpec(
            **options, max_tokens=max_tokens, logprobs=logprobs, structured=structured or _structured(body)
        )
    except pydantic.ValidationError as e:  # options that cannot be served together (shared.sampling)
        raise from_validation_error(e) from e


def _structured(body: SamplingBody) -> StructuredSpec | None:
    try:
        return body.structured()
    except StructuredError as e:
        raise bad_request(str(e), param=e.param) from e


def _request(
    kind: str, prompt_ids: list[int], sampling: SamplingSpec, priority: int, model: str
) -> GenerateRequest:
    """model: the served model name, which only its workers take ("": any worker)."""
    return GenerateRequest(
        model=model,
        request_id=new_request_id(kind),
        prompt_token_ids=prompt_ids,
        sampling=sampling,
        priority=priority,
        arrival_time=time.time(),
    )
