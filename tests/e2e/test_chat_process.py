"""/v1/chat/completions as vLLM's server tests define it (chat_completion/test_chat.py, test_chat_echo.py,
test_chat_logit_bias_validation.py), with llama.cpp's chat cases: the official openai client against a real
stack serving the tiny random model, which has the default model's tokenizer and chat template (the cases
that need the default model's real text are in test_stop_strings.py)."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import openai
import pytest

from tests.support.api_cluster import cluster_fixture, extra, post
from tests.support.cluster import MODEL_NAME, Cluster

MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "you are a helpful assistant"},
    {"role": "user", "content": "what is 1+1?"},
]
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Who won the world series in 2020?"},
    {"role": "assistant", "content": "The Los Angeles Dodgers won the World Series in 2020."},
    {"role": "user", "content": "Where was it played?"},
]


cluster = cluster_fixture("tiny_model_path")


def chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    """A chat completion, or its stream when stream=True."""
    kwargs.setdefault("model", MODEL_NAME)
    kwargs.setdefault("messages", MESSAGES)
    kwargs.setdefault("temperature", 0.0)
    return client.chat.completions.create(**kwargs)


def vocab_size(cluster: Cluster) -> int:
    """The model's vocabulary size, as /tokenize's neighbour /detokenize bounds it."""
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(cluster.env["MODEL"]).vocab_size)


# -- logprobs -----------------------------------------------------------------------------------------------


def test_no_logprobs(client: openai.OpenAI) -> None:
    assert chat(client, max_completion_tokens=5, logprobs=False).choices[0].logprobs is None


@pytest.mark.parametrize("k", [0, 5])
def test_top_logprobs_shapes(client: openai.OpenAI, k: int) -> None:
    choice = chat(client, max_completion_tokens=5, logprobs=True, top_logprobs=k).choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert len(choice.logprobs.content) == 5
    for entry in choice.logprobs.content:
        assert len(entry.top_logprobs) == k
        assert entry.logprob <= 0.0 and entry.bytes is not None
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
    assert "".join(e.token for e in choice.logprobs.content) == choice.message.content


def test_too_many_logprobs(client: openai.OpenAI) -> None:
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        for _ in chat(client, max_completion_tokens=10, logprobs=True, top_logprobs=21, stream=True):
            pass
    with pytest.raises(openai.BadRequestError):
        chat(client, max_completion_tokens=10, logprobs=True, top_logprobs=30)
    assert chat(client, max_completion_tokens=10).choices[0].message.content is not None


@pytest.mark.parametrize("prompt_logprobs", [1, 0, -1, None])
def test_prompt_logprobs(client: openai.OpenAI, prompt_logprobs: int | None) -> None:
    body = {} if prompt_logprobs is None else {"prompt_logprobs": prompt_logprobs}
    if prompt_logprobs is not None and prompt_logprobs < 0:
        with pytest.raises(openai.BadRequestError):
            chat(client, messages=CONVERSATION, max_completion_tokens=2, extra_body=body)
        return
    completion = chat(client, messages=CONVERSATION, max_completion_tokens=2, extra_body=body)
    entries = extra(completion, "prompt_logprobs")
    if prompt_logprobs is None:
        assert entries is None
        return
    assert completion.usage is not None
    assert entries is not None and len(entries) == completion.usage.prompt_tokens
    assert entries[0] is None


def test_more_than_one_prompt_logprob(client: openai.OpenAI) -> None:
    one = chat(client, messages=CONVERSATION, max_completion_tokens=2, extra_body={"prompt_logprobs": 1})
    two = chat(client, messages=CONVERSATION, max_completion_tokens=2, extra_body={"prompt_logprobs": 2})
    for entries, k in ((extra(one, "prompt_logprobs"), 1), (extra(two, "prompt_logprobs"), 2)):
        assert entries is not None
        assert all(k <= len(e) <= k + 1 for e in entries[1:])


# -- sessions and streaming ---------------------------------------------------------------------------------


def test_single_chat_session(client: openai.OpenAI, cluster: Cluster) -> None:
    messages = list(MESSAGES)
    completion = chat(client, messages=messages, max_completion_tokens=5, logprobs=True, top_logprobs=5)
    assert completion.id and completion.object == "chat.completion"
    assert len(completion.choices) == 1
    choice = completion.choices[0]
    assert choice.finish_reason == "length"
    prompt_tokens = post(cluster, "/tokenize", {"model": MODEL_NAME, "messages": messages}).json()["count"]
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (prompt_tokens, 5)
    assert completion.usage.total_tokens == prompt_tokens + 5
    assert choice.message.role == "assistant"
    assert choice.message.content

    messages += [
        {"role": "assistant", "content": choice.message.content},
        {"role": "user", "content": "express your result in json"},
    ]
    follow_up = chat(client, messages=messages, max_completion_tokens=5)
    assert follow_up.choices[0].message.content is not None
    assert follow_up.usage is not None and follow_up.usage.prompt_tokens > prompt_tokens


def test_chat_streaming(client: openai.OpenAI) -> None:
    single = chat(client, max_completion_tokens=10)
    pieces, finishes, roles = [], 0, []
    chunk = None
    for chunk in chat(client, max_completion_tokens=10, stream=True):
        assert chunk.object == "chat.completion.chunk"
        delta = chunk.choices[0].delta
        if delta.role:
            roles.append(delta.role)
        if delta.content:
            pieces.append(delta.content)
        finishes += chunk.choices[0].finish_reason is not None
    assert chunk is not None
    assert roles == ["assistant"]  # once, on the first chunk
    assert finishes == 1
    assert chunk.choices[0].finish_reason == single.choices[0].finish_reason
    assert chunk.choices[0].delta.content  # the finish reason rides with the last token
    assert "".join(pieces) == single.choices[0].message.content


def test_first_chunk_carries_the_role(client: openai.OpenAI) -> None:
    chunks = list(chat(client, max_completion_tokens=3, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id for c in chunks)


def test_stream_options(client: openai.OpenAI) -> None:
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    common: dict[str, Any] = {"messages": messages, "max_completion_tokens": 10}
    assert all(
        c.usage is None for c in chat(client, **common, stream=True, stream_options={"include_usage": False})
    )

    *body, last = list(
        chat(
            client,
            **common,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": False},
        )
    )
    assert all(c.usage is None for c in body)
    assert body[-1].choices[0].finish_reason is not None
    assert last.choices == [] and last.usage is not None
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens > 0

    for options in ({"include_usage": None}, {"include_usage": True}):
        with pytest.raises(openai.BadRequestError):
            chat(client, **common, stream=False, stream_options=options)

    last_count = 0
    for c in chat(
        client,
        **common,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"min_tokens": 10},
    ):
        assert c.usage is not None and c.usage.prompt_tokens > 0
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
        assert c.usage.completion_tokens >= last_count
        last_count = c.usage.completion_tokens
    assert last_count == 10


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_either_name(client: openai.OpenAI, field: str) -> None:
    out = chat(client, extra_body={"min_tokens": 3}, **{field: 3})
    assert out.usage is not None and out.usage.completion_tokens == 3
    assert out.choices[0].finish_reason == "length"


def test_n_non_streaming(client: openai.OpenAI) -> None:
    out = chat(
        client,
        messages=[{"role": "user", "content": "What is the opposite of big?"}],
        max_completion_tokens=12,
        temperature=0.9,
        n=3,
        seed=0,
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.message.content for c in out.choices)
    assert len({c.message.content for c in out.choices}) > 1


def test_n_streaming(client: openai.OpenAI) -> None:
    by_index: dict[int, list[str]] = defaultdict(list)
    for chunk in chat(client, max_completion_tokens=8, temperature=0.7, n=2, seed=1, stream=True):
        for choice in chunk.choices:
            if choice.delta.content:
                by_index[choice.index].append(choice.delta.content)
    assert sorted(by_index) == [0, 1] and all("".join(v) for v in by_index.values())


def test_n_with_seed_is_reproducible(client: openai.OpenAI) -> None:
    def run() -> list[str | None]:
        out = chat(
            client,
            messages=[{"role": "user", "content": "Say hello."}],
            max_completion_tokens=8,
            temperature=0.8,
            n=2,
            seed=42,
        )
        return [c.message.content for c in out.choices]

    assert run() == run()


# -- templates: echo, continue_final_message, add_generation_prompt -----------------------------------------


@pytest.mark.parametrize("echo", [True, False])
def test_echo_and_continue_final_message(client: openai.OpenAI, echo: bool) -> None:
    saying = "Here is a common saying about apple. An apple a day, keeps"
    out = chat(
        client,
        messages=[
            {"role": "user", "content": "tell me a common saying"},
            {"role": "assistant", "content": saying},
        ],
        max_completion_tokens=8,
        extra_body={"echo": echo, "continue_final_message": True, "add_generation_prompt": False},
    )
    choice = out.choices[0]
    assert choice.finish_reason is not None
    assert out.usage is not None and out.usage.completion_tokens >= 1
    assert choice.message.role == "assistant" and choice.message.content
    assert (saying in choice.message.content) is echo
    if echo:
        assert choice.message.content.startswith(saying)


def test_continue_final_message_needs_an_assistant_turn(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        chat(
            client,
            max_completion_tokens=2,
            extra_body={"continue_final_message": True, "add_generation_prompt": True},
        )


def test_add_generation_prompt_changes_the_prompt(cluster: Cluster) -> None:
    counts = {}
    for flag in (True, False):
        r = post(
            cluster, "/tokenize", {"model": MODEL_NAME, "messages": MESSAGES, "add_generation_prompt": flag}
        )
        assert r.status_code == 200, r.text
        counts[flag] = r.json()["count"]
    assert counts[True] > counts[False]


# -- requests vLLM accepts ----------------------------------------------------------------------------------


def test_response_format_text(client: openai.OpenAI) -> None:
    for _ in range(2):
        out = chat(
            client,
            messages=[{"role": "user", "content": "what is 1+1?"}],
            max_completion_tokens=10,
            response_format={"type": "text"},
        )
        assert out.choices[0].message.content is not None


def test_response_format_json_object_and_json_schema(client: openai.OpenAI) -> None:
    """vLLM's test_response_format_json_object and test_response_format_json_schema, on a random model: a
    schema small enough that any path through it ends (the mask, not the model, makes it valid JSON)."""
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
        "required": ["answer", "sure"],
        "additionalProperties": False,
    }
    formats = [{"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}]
    for response_format in formats:
        for temperature in (0.0, 1.0):
            out = chat(
                client,
                messages=[{"role": "user", "content": "Is the sky blue? Answer in JSON."}],
                max_completion_tokens=40,
                temperature=temperature,
                response_format=response_format,
            )
            assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
            reply = json.loads(out.choices[0].message.content)
            assert reply["answer"] in {"yes", "no"} and isinstance(reply["sure"], bool)
    out = chat(
        client,
        messages=[{"role": "user", "content": "Any JSON object, please."}],
        max_completion_tokens=10,
        response_format={"type": "json_object"},
    )
    assert out.choices[0].message.content.startswith("{")


def test_extra_fields_in_a_message_are_allowed(client: openai.OpenAI) -> None:
    out = chat(
        client,
        messages=[{"role": "user", "content": "what is 1+1?", "extra_field": "0"}],
        max_completion_tokens=5,
        seed=0,
    )
    assert out.choices[0].message.content is not None


def test_content_parts_equal_plain_content(client: openai.OpenAI) -> None:
    text = "what is 1+1? please provide the result without any other text."
    plain = chat(client, messages=[{"role": "user", "content": text}], max_completion_tokens=8)
    parts = chat(
        client,
        messages=[{"role": "user", "content": [{"type": "text", "text": text}]}],
        max_completion_tokens=8,
    )
    assert parts.choices[0].message.content == plain.choices[0].message.content


def test_custom_role(client: openai.OpenAI) -> None:
    contents = [
        chat(client, messages=[{"role": "my-custom-role", "content": c}], max_completion_tokens=5, seed=0)
        .choices[0]
        .message.content
        for c in ("what is 1+1?", [{"type": "text", "text": "what is 1+1?"}])
    ]
    assert contents[0] == contents[1]


@pytest.mark.parametrize("seed", [-(2**63) - 1, 2**63])
def test_seed_beyond_int64(client: openai.OpenAI, seed: int) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        chat(client, seed=seed, max_completion_tokens=2)
    assert raised.value.status_code == 400
    assert "seed" in str(raised.value)


# -- logit_bias validation ----------------------------------------------------------------------------------


def test_logit_bias_valid(client: openai.OpenAI, cluster: Cluster) -> None:
    out = chat(client, max_tokens=5, logit_bias={str(vocab_size(cluster) - 1): 1.0})
    assert out.choices[0].message.content is not None


def test_logit_bias_out_of_vocabulary(client: openai.OpenAI, cluster: Cluster) -> None:
    vocab = vocab_size(cluster)
    with pytest.raises(openai.BadRequestError) as raised:
        chat(client, max_tokens=5, logit_bias={str(vocab + 1): 1.0})
    assert raised.value.status_code == 400
    assert str(vocab + 1) in str(raised.value) and str(vocab) in str(raised.value)


def test_logit_bias_non_integer_key(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        chat(client, max_tokens=5, logit_bias={"not_a_token_id": 50})
    assert "not_a_token_id" in str(raised.value) and "logit_bias" in str(raised.value)


def test_logit_bias_non_numeric_value(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        chat(client, max_tokens=5, logit_bias={"1": "not_a_number"})
    assert "logit_bias" in str(raised.value)


def test_logit_bias_every_bad_key_is_named(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        chat(client, max_tokens=5, logit_bias={"bad1": 50.0, "bad2": 20.0})
    assert "bad1" in str(raised.value) and "bad2" in str(raised.value)


# -- what a text-only, single-model server does not serve ---------------------------------------------------


@pytest.mark.skip(reason="LoRA adapters are not served (one base model per server)")
def test_lora_model_names() -> None:
    """vLLM runs most chat cases a second time against a `zephyr-lora` adapter."""
