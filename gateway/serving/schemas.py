"""OpenAI request bodies: wrong types and out-of-range values are refused (400).

Unknown fields are accepted and ignored, as vLLM does: gateway.request_body names them (`ignored_fields`) in a
warning and in the response's X-Ignored-Fields header.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from gateway.serving.body_model import Body
from gateway.serving.errors import FieldProblem
from gateway.serving.structured_params import OutputControlBody
from gateway.serving.tools import NAME_PATTERN
from shared.sampling import MaxTokens, NumLogprobs, SamplingOptions

MAX_PROMPTS = 64  # prompts in one completions request; each is a request of its own to the scheduler
MAX_TOOLS = 128  # functions in one request (OpenAI's limit)
_TokenIds = list[Annotated[int, Field(ge=0)]]


class StreamOptions(Body):
    """What a stream carries besides the tokens."""

    include_usage: bool = False
    continuous_usage_stats: bool = Field(
        False, description="with include_usage, every chunk carries the usage so far (vLLM)"
    )


class TextPart(Body):
    """One text part of a message's content (images and audio are not supported)."""

    type: Literal["text"]
    text: str


class CalledFunction(Body):
    """The function an assistant's earlier turn called, and its arguments (a JSON object, as text)."""

    name: str
    arguments: str


class MessageToolCall(Body):
    """A call an assistant's earlier turn made."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Body):
    """One turn of a conversation."""

    role: Annotated[str, Field(min_length=1)] = Field(
        description="system, developer, user, assistant or tool, or any other role the chat template knows "
        "(vLLM)"
    )
    content: str | list[TextPart] | None = Field(
        None, description="required, but for an assistant's turn that made tool_calls"
    )
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = Field(
        None, description="an assistant's turn: the calls it made"
    )
    tool_call_id: str | None = Field(None, description="a tool's turn: the call it answers")

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise FieldProblem(
                "content is required (only an assistant's message with tool_calls may omit it)", "content"
            )
        if self.role == "tool" and self.tool_call_id is None:
            raise FieldProblem("a tool message needs the tool_call_id of the call it answers", "tool_call_id")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionDefinition(Body):
    """A function the model may call: its parameters are a JSON Schema of one object."""

    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema (none: no parameters)")
    strict: bool | None = Field(
        None, description="the arguments always follow the schema here, strict or not"
    )


class ChatTool(Body):
    type: Literal["function"] = Field(description="only function tools are served")
    function: FunctionDefinition


class ChosenFunction(Body):
    name: str


class NamedToolChoice(Body):
    """tool_choice naming the one function to call."""

    type: Literal["function"]
    function: ChosenFunction


class SamplingBody(OutputControlBody, SamplingOptions):
    """Fields shared by completions and chat completions: the sampling options (shared.sampling, their one
    definition), structured outputs and what the gateway itself does with the output."""

    model_config = Body.model_config

    model: str | None = None
    stop: str | Annotated[list[str], Field(max_length=16)] | None = Field(
        None, description="a string, or up to 16, that ends a sample where it appears (it is not returned)"
    )
    user: str | None = None
    priority: Annotated[int, Field(ge=-(2**31), lt=2**31)] = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = Field(
        None,
        description="keep only the last k prompt tokens (-1: as many as the model's context holds) (vLLM)",
    )
    include_stop_str_in_output: bool = Field(
        False, description="keep the stop string or stop token that ended a sample in its text (vLLM)"
    )

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate_keeps_a_token(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("truncate_prompt_tokens must be -1 or at least 1")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        if value is not None and any(not s for s in ([value] if isinstance(value, str) else value)):
            raise ValueError("stop strings must not be empty")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingBody:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self) -> SamplingBody:
        if self.stream and self.prompt_logprobs:
            raise ValueError("prompt_logprobs are not available when stream is true")
        return self

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage_stats(self) -> bool:
        options = self.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats


class CompletionRequest(SamplingBody):
    """POST /v1/completions."""

    prompt: str | _TokenIds | list[str] | list[_TokenIds] = Field(
        description=(
            f"a string or a list of token ids, or a list of up to {MAX_PROMPTS} of those: one choice per "
            "prompt and sample, indexed prompt_index * n + sample (a list of one prompt is that prompt)"
        )
    )
    max_tokens: MaxTokens | None = 16
    logprobs: NumLogprobs | None = None
    echo: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        """A list holding a single prompt is that prompt; a list of several stays a list of prompts."""
        if isinstance(value, list) and value and all(isinstance(p, str | list) for p in value):
            if len(value) > MAX_PROMPTS:
                raise ValueError(f"prompt holds {len(value)} prompts; a request takes at most {MAX_PROMPTS}")
            if len({type(p) for p in value}) > 1:
                raise ValueError("prompt must be a list of strings or a list of token-id lists, not a mix")
            empty = [i for i, p in enumerate(value) if p == "" or p == []]
            if empty and len(value) > 1:
                raise ValueError(f"prompt[{empty[0]}] is empty")
            if len(value) == 1:
                value = value[0]
                if isinstance(value, list) and any(isinstance(t, str | list) for t in value):
                    raise ValueError("prompt[0] must be a string or a list of token ids")
        if value == "" or value == []:
            raise ValueError("the prompt is empty")
        if not isinstance(value, str | list):
            raise ValueError("prompt must be a string or a list of token ids, or a list of those")
        return value


class ChatTemplateBody(Body):
    """Messages, and how the chat template turns them into a prompt: its options, and the tools it shows the
    model (with tool_choice and parallel_tool_calls, which also decide the grammar of a generation)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = Field(True, description="end the prompt with the assistant's turn header")
    continue_final_message: bool = Field(
        False,
        description="the final message (the assistant's) is left open for the model to continue; "
        "needs add_generation_prompt false",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="extra variables for the chat template (e.g. enable_thinking)"
    )
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description=f"functions the model may call, at most {MAX_TOOLS}"
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none, auto (the default with tools), required, or the function to call"
    )
    parallel_tool_calls: bool = Field(True, description="false: at most one call")

    @field_validator("continue_final_message")
    @classmethod
    def _continue_the_assistant(cls, value: bool, info: ValidationInfo) -> bool:
        # Fields are validated in order: messages and add_generation_prompt are in info.data when valid.
        if value and info.data.get("add_generation_prompt", False):
            raise ValueError(
                "continue_final_message and add_generation_prompt cannot both be true: set "
                "add_generation_prompt to false to continue the final message"
            )
        messages = info.data.get("messages")
        if value and messages and messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the final message to be the assistant's")
        return value

    def template_options(self) -> dict[str, Any]:
        """Tokenizer.encode_chat's options as this body sets them."""
        return {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "template_kwargs": self.chat_template_kwargs or {},
        }


class ChatCompletionRequest(SamplingBody, ChatTemplateBody):
    """POST /v1/chat/completions."""

    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    echo: bool = Field(
        False, description="when the final message is the assistant's, the response starts with its content"
    )

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self


def conversation(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template takes them (a developer message is a system message)."""
    turns = []
    for m in messages:
        turn = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.name is not None:
            turn["name"] = m.name
        turns.append(turn)
    return turns


class TokenizeCompletionRequest(Body):
    """POST /tokenize with a prompt: its token ids."""

    model: str | None = None
    prompt: Annotated[str, Field(min_length=1)]
    add_special_tokens: bool = Field(True, description="add the tokenizer's special tokens (e.g. BOS)")
    return_token_strs: bool = Field(False, description="also return each token as the tokenizer writes it")


class TokenizeChatRequest(ChatTemplateBody):
    """POST /tokenize with messages: the token ids of the chat template applied to them."""

    model: str | None = None
    add_special_tokens: bool = Field(
        False, description="add the tokenizer's special tokens to the rendered template (it has its own)"
    )
    return_token_strs: bool = Field(False, description="also return each token as the tokenizer writes it")


class DetokenizeRequest(Body):
    """POST /detokenize: the text of token ids."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]
