"""OpenAI request bodies: unknown fields, wrong types and out-of-range values are refused (400)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_LOGPROBS = 20
_INT64 = 2**63


class Body(BaseModel):
    """A JSON body: strict types (no "5" for 5), no unknown fields."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Body):
    """What a stream carries besides the tokens."""

    include_usage: bool = False


class TextPart(Body):
    """One text part of a message's content (images and audio are not supported)."""

    type: Literal["text"]
    text: str


class ChatMessage(Body):
    """One turn of a conversation."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class SamplingBody(Body):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    seed: Annotated[int, Field(ge=-_INT64, lt=_INT64)] | None = None
    stop: str | Annotated[list[str], Field(max_length=16)] | None = Field(
        None, description="a string, or up to 16, that ends a sample where it appears (it is not returned)"
    )
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    user: str | None = None
    priority: Annotated[int, Field(ge=-(2**31), lt=2**31)] = 0
    stream: bool = False
    stream_options: StreamOptions | None = None

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

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingBody):
    """POST /v1/completions."""

    prompt: str | list[Annotated[int, Field(ge=0)]] = Field(
        description="a string or a list of token ids (a list holding one of those is taken as it)"
    )
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        """A list holding a single prompt is that prompt; several prompts in one request are refused."""
        if isinstance(value, list) and value and all(isinstance(p, str | list) for p in value):
            if len(value) > 1:
                raise ValueError("several prompts in one request are not supported; send one per request")
            value = value[0]
        if value == "" or value == []:
            raise ValueError("the prompt is empty")
        if not isinstance(value, str | list):
            raise ValueError("prompt must be a string or a list of token ids")
        return value

    @model_validator(mode="after")
    def _echo_logprobs(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported (prompt logprobs are not computed)")
        return self


class ChatCompletionRequest(SamplingBody):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

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


class TokenizeChatRequest(Body):
    """POST /tokenize with messages: the token ids of the chat template applied to them."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]


class DetokenizeRequest(Body):
    """POST /detokenize: the text of token ids."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]
