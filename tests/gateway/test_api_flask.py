"""The request side of the vLLM-compatible API, through the Flask test client over a real Redis.

Unknown fields (ignored and named), logit_bias and allowed_token_ids,
truncate_prompt_tokens, the chat template's options and chat echo, /tokenize's options, /version, CORS. A
thread plays the worker where a request must finish (tests/support/gateway_app.py's FakeWorker).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from flask import Flask

from gateway.request_body import IGNORED_FIELDS_HEADER
from gateway.serving.tokenization import Tokenizer
from tests.support.gateway_app import (
    CHAT,
    CMPL,
    USER,
    assert_openai_error,
    data_of,
    queued,
    run,
    sent,
    sse_events,
)

HELLO = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, I am"}]


# -- unknown fields -----------------------------------------------------------------------------------------


@pytest.mark.usefixtures("worker")
def test_unknown_fields_are_ignored_and_named_in_a_header(client, r, keys, tok, caplog) -> None:
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache": 1}], "mood": "x"}],
        "stream": True,
        "stream_options": {"include_usage": True, "chunked": True},
        "metadata": {"a": 1},
        "temperature": 0,
        "odd key, with.dots": 1,
    }
    caplog.set_level(logging.WARNING, logger="gateway.request_body")
    response, request = run(client, r, keys, CHAT, body, tok.encode(" Hello"))
    assert response.status_code == 200
    assert response.headers[IGNORED_FIELDS_HEADER].split(", ") == [
        "metadata",
        "odd%20key%2C%20with%2Edots",
        "messages.0.mood",
        "messages.0.content.0.cache",
        "stream_options.chunked",
    ]
    assert "messages.0.content.0.cache" in caplog.text
    assert request is not None and request.sampling.temperature == 0
    assert request.prompt_token_ids == tok.encode_chat([{"role": "user", "content": "hi"}])
    assert data_of(sse_events(response.get_data(as_text=True)))[-1]["usage"]["completion_tokens"] == 1

    plain, _ = run(client, r, keys, CMPL, {"prompt": "hi"}, [5])
    assert plain.status_code == 200 and IGNORED_FIELDS_HEADER not in plain.headers
    tokenized = client.post("/tokenize", json={"prompt": "hi", "add_bos": True})
    assert tokenized.status_code == 200 and tokenized.headers[IGNORED_FIELDS_HEADER] == "add_bos"


@pytest.mark.usefixtures("worker")
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {"messages": USER, "foo": 1, "temperature": "0"}, "temperature"),
        (CHAT, {"messages": [{"role": "user", "content": "hi", "foo": 1, "name": 5}]}, "messages[0].name"),
        (CMPL, {"prompt": "hi", "foo": {"bar": 1}, "top_p": 0}, "top_p"),
        (CMPL, {"prompt": "hi", "stream": True, "stream_options": {"x": 1, "include_usage": "yes"}}, None),
    ],
)
def test_known_fields_beside_unknown_ones_are_still_checked(client, r, keys, path, body, param) -> None:
    error = assert_openai_error(client.post(path, json=body), 400)
    assert param is None or error["param"] == param
    assert queued(r, keys) == 0


# -- logit_bias, allowed_token_ids ------------------------------------------------------------------------


@pytest.mark.usefixtures("worker")
def test_logit_bias_and_allowed_token_ids_reach_the_sampling_spec(client, r, keys, tok) -> None:
    bias = {"5": 100, "17": -100, "2000": 0.5}
    for path, body in ((CMPL, {"prompt": "hi"}), (CHAT, {"messages": USER})):
        request = sent(client, r, keys, path, {**body, "logit_bias": bias, "allowed_token_ids": [5, 9]})
        assert request.sampling.logit_bias == {5: 100.0, 17: -100.0, 2000: 0.5}
        assert request.sampling.allowed_token_ids == [5, 9]
        default = sent(client, r, keys, path, body)
        assert default.sampling.logit_bias == {} and default.sampling.allowed_token_ids is None
    bad_keys = client.post(CHAT, json={"messages": USER, "logit_bias": {"bad1": 1, "2": 1, "bad2": 1}})
    message = assert_openai_error(bad_keys, 400)["message"]
    assert "'bad1'" in message and "'bad2'" in message and "'2'" not in message  # every bad key named
    outside = client.post(CHAT, json={"messages": USER, "logit_bias": {str(tok.vocab_size + 1): 1}})
    message = assert_openai_error(outside, 400)["message"]
    assert str(tok.vocab_size + 1) in message and str(tok.vocab_size) in message  # the id and the bound


@pytest.mark.usefixtures("worker")
@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"1.5": 1}}, "logit_bias"),
        ({"logit_bias": {"": 1}}, "logit_bias"),
        ({"logit_bias": {"9" * 4000: 1}}, "logit_bias"),
        ({"logit_bias": {"999999999": 1}}, "logit_bias"),  # past the vocabulary
        ({"logit_bias": {"5": 100.5}}, "logit_bias[5]"),
        ({"logit_bias": {"5": -101}}, "logit_bias[5]"),
        ({"logit_bias": {"5": "1"}}, "logit_bias[5]"),
        ({"logit_bias": [5]}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [10**9]}, "allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids[0]"),
        ({"allowed_token_ids": ["5"]}, "allowed_token_ids[0]"),
    ],
)
def test_bad_logit_bias_and_allowed_token_ids_are_400s_naming_them(client, r, keys, extra, param) -> None:
    for path, body in ((CMPL, {"prompt": "hi"}), (CHAT, {"messages": USER})):
        assert assert_openai_error(client.post(path, json={**body, **extra}), 400)["param"] == param
    assert queued(r, keys) == 0


# -- truncate_prompt_tokens ---------------------------------------------------------------------------------


@pytest.mark.usefixtures("worker")
def test_truncate_prompt_tokens_keeps_the_last_tokens_before_the_context_check(client, r, keys, tok) -> None:
    prompt = " one two three four five six"
    ids = tok.encode(prompt)
    response, request = run(client, r, keys, CMPL, {"prompt": prompt, "truncate_prompt_tokens": 2}, [5])
    assert request is not None and request.prompt_token_ids == ids[-2:]
    assert response.get_json()["usage"]["prompt_tokens"] == 2
    echoed, _ = run(client, r, keys, CMPL, {"prompt": prompt, "truncate_prompt_tokens": 2, "echo": True}, [5])
    assert echoed.get_json()["choices"][0]["text"] == tok.decode(ids[-2:]) + tok.decode([5])
    assert sent(client, r, keys, CMPL, {"prompt": ids, "truncate_prompt_tokens": 50}).prompt_token_ids == ids
    assert (
        sent(client, r, keys, CMPL, {"prompt": prompt, "truncate_prompt_tokens": -1}).prompt_token_ids == ids
    )
    # Too long for the context (2048 tokens) as given, not once truncated.
    long = " hi" * 3000
    assert (
        sent(client, r, keys, CMPL, {"prompt": long, "truncate_prompt_tokens": 100}).prompt_token_ids
        == (tok.encode(long)[-100:])
    )
    chat = sent(client, r, keys, CHAT, {"messages": USER, "truncate_prompt_tokens": 3})
    assert chat.prompt_token_ids == tok.encode_chat([{"role": "user", "content": "hi"}])[-3:]


@pytest.mark.usefixtures("worker")
@pytest.mark.parametrize(
    ("value", "param", "code"),
    [
        (0, "truncate_prompt_tokens", "invalid_request"),
        (-2, "truncate_prompt_tokens", "invalid_request"),
        ("5", "truncate_prompt_tokens", "invalid_request"),
        (2049, "truncate_prompt_tokens", "invalid_request"),  # more than the context
        (-1, "prompt", "context_length_exceeded"),  # the whole context leaves no room for an output token
    ],
)
def test_bad_truncate_prompt_tokens(client, r, keys, value, param, code) -> None:
    body = {"prompt": " hi" * 3000, "truncate_prompt_tokens": value}
    error = assert_openai_error(client.post(CMPL, json=body), 400)
    assert (error["param"], error["code"]) == (param, code)
    assert queued(r, keys) == 0


# -- the chat template's options and echo -------------------------------------------------------------------


@pytest.mark.usefixtures("worker")
def test_chat_template_options_shape_the_prompt(client, r, keys, tok) -> None:
    plain = sent(client, r, keys, CHAT, {"messages": USER}).prompt_token_ids
    assert plain == tok.encode_chat([{"role": "user", "content": "hi"}])
    bare = sent(client, r, keys, CHAT, {"messages": USER, "add_generation_prompt": False}).prompt_token_ids
    assert plain[: len(bare)] == bare and len(bare) < len(plain)  # no assistant header at the end
    assert tok.hf.decode(plain[len(bare) :]).startswith("<|im_start|>assistant")
    body = {"messages": HELLO, "add_generation_prompt": False, "continue_final_message": True}
    continued = sent(client, r, keys, CHAT, body).prompt_token_ids
    assert tok.hf.decode(continued).endswith("<|im_start|>assistant\nHello, I am")  # left open
    custom = [{"role": "my-custom-role", "content": "hi"}]  # any role the template takes, as vLLM
    assert sent(client, r, keys, CHAT, {"messages": custom}).prompt_token_ids == tok.encode_chat(custom)
    kwargs = sent(
        client, r, keys, CHAT, {"messages": USER, "chat_template_kwargs": {"enable_thinking": False}}
    )
    assert kwargs.prompt_token_ids == plain  # a variable this template does not use changes nothing


@pytest.mark.usefixtures("worker")
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": HELLO, "continue_final_message": True}, "continue_final_message"),
        (
            {"messages": USER, "add_generation_prompt": False, "continue_final_message": True},
            "continue_final_message",
        ),
        ({"messages": USER, "add_generation_prompt": 1}, "add_generation_prompt"),
        ({"messages": USER, "chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
        ({"messages": USER, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs"),
        ({"messages": USER, "chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
        ({"messages": USER, "echo": "yes"}, "echo"),
    ],
)
def test_bad_chat_template_options(client, r, keys, body, param) -> None:
    assert assert_openai_error(client.post(CHAT, json=body), 400)["param"] == param
    assert queued(r, keys) == 0


@pytest.mark.usefixtures("worker")
def test_chat_echo_starts_the_reply_with_the_assistant_message_it_continues(client, r, keys, tok) -> None:
    body = {"messages": HELLO, "add_generation_prompt": False, "continue_final_message": True, "echo": True}
    more = tok.encode(" a model.")
    whole, _ = run(client, r, keys, CHAT, body, more)
    assert whole.get_json()["choices"][0]["message"]["content"] == "Hello, I am a model."
    assert whole.get_json()["usage"]["completion_tokens"] == len(more)
    streamed, _ = run(client, r, keys, CHAT, {**body, "stream": True}, more)
    chunks = data_of(sse_events(streamed.get_data(as_text=True)))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Hello, I am"}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hello, I am a model."
    # The final message is the user's: nothing to echo.
    user_last, _ = run(client, r, keys, CHAT, {"messages": USER, "echo": True}, more)
    assert user_last.get_json()["choices"][0]["message"]["content"] == " a model."


# -- a tokenizer of our own: template variables and a BOS token ---------------------------------------------


@pytest.fixture
def bos_model(tiny_model_path: str, tmp_path: Path) -> str:
    """The tiny model's tokenizer, adding <|endoftext|> (id 0) in front of a text when asked for special
    tokens, with a chat template that writes a `greeting` variable when it is given."""
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(Path(tiny_model_path) / name, tmp_path / name)
    tokenizer = json.loads((tmp_path / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}
    a, b = {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, a],
        "pair": [bos, a, b],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}},
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    template = (
        "{% if greeting is defined %}{{ greeting }}{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (tmp_path / "chat_template.jinja").write_text(template)
    return str(tmp_path)


def test_tokenize_options(make_app: Callable[..., Flask], bos_model: str) -> None:
    client = make_app(model=bos_model).test_client()
    tokenizer = Tokenizer(bos_model)

    def tokenize(**body: Any) -> dict[str, Any]:
        response = client.post("/tokenize", json=body)
        assert response.status_code == 200, response.get_data(as_text=True)
        return response.get_json()

    text = "The capital of France"
    ids = tokenizer.encode(text)
    assert tokenize(prompt=text)["tokens"] == [0, *ids]  # special tokens by default for a prompt, as vLLM
    assert tokenize(prompt=text, add_special_tokens=False)["tokens"] == ids
    strs = tokenize(prompt=text, return_token_strs=True)
    assert strs["token_strs"] == ["<|endoftext|>", "The", "Ġcapital", "Ġof", "ĠFrance"]
    assert tokenize(prompt=text)["token_strs"] is None

    chat = tokenize(messages=USER)  # none for messages: the template writes its own
    assert tokenizer.hf.decode(chat["tokens"]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenize(messages=USER, add_special_tokens=True)["tokens"] == [0, *chat["tokens"]]
    bare = tokenize(messages=USER, add_generation_prompt=False)["tokens"]
    assert tokenizer.hf.decode(bare) == "<|im_start|>user\nhi<|im_end|>\n"
    body = {"messages": HELLO, "add_generation_prompt": False, "continue_final_message": True}
    assert tokenizer.hf.decode(tokenize(**body)["tokens"]).endswith("assistant\nHello, I am")
    greeted = tokenize(messages=USER, chat_template_kwargs={"greeting": "Bonjour"})["tokens"]
    assert tokenizer.hf.decode(greeted) == "Bonjour" + tokenizer.hf.decode(chat["tokens"])
    refused = client.post("/tokenize", json={"messages": USER, "continue_final_message": True})
    assert_openai_error(refused, 400)


@pytest.mark.usefixtures("worker")
def test_chat_template_kwargs_reach_the_template(make_app, bos_model, r, keys) -> None:
    client = make_app(model=bos_model).test_client()
    tokenizer = Tokenizer(bos_model)
    body = {"messages": USER, "chat_template_kwargs": {"greeting": "Bonjour"}}
    request = sent(client, r, keys, CHAT, body)
    assert tokenizer.hf.decode(request.prompt_token_ids).startswith("Bonjour<|im_start|>user")
    completion = sent(client, r, keys, CMPL, {"prompt": "hi"})
    assert completion.prompt_token_ids == tokenizer.encode("hi")  # a completion prompt stays as it is


# -- /version, CORS, the OpenAPI document -------------------------------------------------------------------


def test_version(make_app) -> None:
    client = make_app(api_keys="k").test_client()
    response = client.get("/version")  # public, like /health
    assert response.status_code == 200 and response.get_json() == {"version": "0.1.0"}
    assert client.get("/openapi.json").get_json()["info"]["version"] == "0.1.0"


def test_cors_headers_on_every_response_and_preflights_need_no_key(make_app) -> None:
    client = make_app(api_keys="k").test_client()
    origin = {"Origin": "https://app.example"}
    preflight = client.options(
        CHAT,
        headers={
            **origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert preflight.status_code == 204
    assert preflight.headers["Access-Control-Allow-Origin"] == "*"
    assert "POST" in preflight.headers["Access-Control-Allow-Methods"].split(", ")
    assert preflight.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    denied = client.post(CHAT, json={"messages": USER}, headers=origin)
    assert_openai_error(denied, 401, "authentication_error")
    assert denied.headers["Access-Control-Allow-Origin"] == "*"  # a page can read why it failed
    assert IGNORED_FIELDS_HEADER in denied.headers["Access-Control-Expose-Headers"]
    models = client.get("/v1/models", headers={**origin, "Authorization": "Bearer k"})
    assert models.status_code == 200 and models.headers["Access-Control-Allow-Origin"] == "*"
    assert client.options("/v1/nothing").status_code == 401  # no route: no preflight answer


def test_cors_allowed_origins_are_a_list(make_app) -> None:
    client = make_app(cors_allowed_origins="https://a.example, https://b.example/").test_client()
    for origin in ("https://a.example", "https://b.example"):
        response = client.get("/health", headers={"Origin": origin})
        assert response.headers["Access-Control-Allow-Origin"] == origin
        assert "Origin" in response.headers["Vary"]
    other = client.get("/health", headers={"Origin": "https://evil.example"})
    assert "Access-Control-Allow-Origin" not in other.headers and other.status_code == 200
    preflight = client.options("/tokenize", headers={"Origin": "https://evil.example"})
    assert preflight.status_code == 204 and "Access-Control-Allow-Methods" not in preflight.headers
    closed = (
        make_app(cors_allowed_origins="")
        .test_client()
        .get("/health", headers={"Origin": "https://a.example"})
    )
    assert "Access-Control-Allow-Origin" not in closed.headers


def test_openapi_describes_the_new_fields(client) -> None:
    document = client.get("/openapi.json").get_json()
    schemas = document["components"]["schemas"]
    chat, completion = schemas["ChatCompletionRequest"], schemas["CompletionRequest"]
    for name in ("logit_bias", "allowed_token_ids", "truncate_prompt_tokens", "response_format"):
        assert name in chat["properties"] and name in completion["properties"], name
    for name in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs"):
        assert name in chat["properties"] and name in schemas["TokenizeChatRequest"]["properties"], name
    assert "echo" in chat["properties"]
    assert chat["additionalProperties"] is True  # unknown fields are accepted
    assert {"add_special_tokens", "return_token_strs"} <= set(
        schemas["TokenizeCompletionRequest"]["properties"]
    )
    assert "/version" in document["paths"]
    headers = document["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["headers"]
    assert IGNORED_FIELDS_HEADER in headers
