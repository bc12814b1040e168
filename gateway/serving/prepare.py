"""From a validated request body to a tokenized GenerateRequest within the model's limits."""

from __future__ import annotations

import time
import uuid

import pydantic
from pydantic import Field

from gateway.serving.errors import bad_request, from_validation_error
from gateway.serving.schemas import ChatCompletionRequest, CompletionRequest, SamplingBody, conversation
from gateway.serving.structured_params import StructuredError
from gateway.serving.tokenization import Tokenizer
from shared.errors import ErrorCode
from shared.protocol import GenerateRequest, RequestMeta
from shared.sampling import SamplingSpec, StructuredSpec, options_of


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


def prepare_chat(body: ChatCompletionRequest, tokenizer: Tokenizer, model: str = "") -> Prepared:
    prompt_ids = tokenizer.encode_chat(conversation(body.messages), **body.template_options())
    if not prompt_ids:
        raise bad_request("the messages make an empty prompt", param="messages")
    prompt_ids = _truncate(prompt_ids, body.truncate_prompt_tokens, tokenizer)
    # Echo: the response starts with the final message when it is the assistant's (the one it continues).
    echo = body.echo and body.messages[-1].role == "assistant"
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    sampling = _sampling(body, max_tokens, logprobs, _prompt_logprobs(body), len(prompt_ids), tokenizer)
    return Prepared(
        request=_request("chatcmpl", prompt_ids, sampling, body.priority, model),
        chat=True,
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
) -> SamplingSpec:
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
        return SamplingSpec(**options, max_tokens=max_tokens, logprobs=logprobs, structured=_structured(body))
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
