"""The gateway's request side through the Flask test client over a real Redis: bad input gets a 4xx in
OpenAI's format and queues nothing, admission's 503s, health, models, tokenize, OpenAPI, metrics."""

from __future__ import annotations

import re
import time

import pytest

from gateway.serving.errors import HTTP_ERRORS, APIError
from shared.errors import ErrorCode
from shared.protocol import (
    SchedulerStats,
)
from shared.settings import DEFAULT_MODEL_NAME
from shared.streams import read_request
from tests.support import REPO
from tests.support.gateway_app import (
    CHAT,
    CMPL,
    LONG,
    USER,
    add_worker,
    assert_openai_error,
    queued,
)

# -- bad input: a 4xx in OpenAI's format, and nothing queued ------------------------------------------------


BAD_BODIES = [
    (CMPL, {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    (CMPL, {"prompt": "hi", "temperature": "0.5"}, "temperature"),
    (CMPL, {"prompt": "hi", "stream": "yes"}, "stream"),
    (CMPL, {"prompt": "hi", "bogus": 1, "n": "2"}, "n"),  # an unknown field is ignored, not the rest
    (CMPL, {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    (CMPL, {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    (CMPL, {"prompt": "hi", "max_tokens": 10**9}, "max_tokens"),
    (CMPL, {"prompt": "hi", "max_tokens": 1.5}, "max_tokens"),
    (CMPL, {"prompt": "hi", "n": 0}, "n"),
    (CMPL, {"prompt": "hi", "temperature": -1}, "temperature"),
    (CMPL, {"prompt": "hi", "top_p": 0}, "top_p"),
    (CMPL, {"prompt": "hi", "top_p": 2}, "top_p"),
    (CMPL, {"prompt": "hi", "top_k": -2}, "top_k"),
    (CMPL, {"prompt": "hi", "min_p": 1.5}, "min_p"),
    (CMPL, {"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    (CMPL, {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    (CMPL, {"prompt": "hi", "seed": 2**64}, "seed"),
    (CMPL, {"prompt": "hi", "logprobs": 21}, "logprobs"),
    (CMPL, {"prompt": "hi", "logprobs": -1}, "logprobs"),
    (CMPL, {"prompt": "hi", "stop": [""]}, "stop"),
    (CMPL, {"prompt": "hi", "stop": 5}, "stop"),
    (CMPL, {"prompt": "hi", "stop_token_ids": [10**9]}, "stop_token_ids"),
    (CMPL, {"prompt": "hi", "min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    (CMPL, {"prompt": "hi", "stream_options": {"include_usage": True}}, None),
    (CMPL, {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, None),
    (CMPL, {"prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs"),
    (CHAT, {"messages": USER, "prompt_logprobs": 21}, "prompt_logprobs"),
    (CHAT, {"messages": USER, "include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    (CHAT, {"messages": USER, "stream": True, "stream_options": {"continuous_usage_stats": "yes"}}, None),
    (CMPL, {"prompt": ""}, "prompt"),
    (CMPL, {"prompt": []}, "prompt"),
    (CMPL, {"prompt": ["one", ""]}, "prompt"),
    (CMPL, {"prompt": [[1], []]}, "prompt"),
    (CMPL, {"prompt": ["one", [1]]}, "prompt"),
    (CMPL, {"prompt": [["one"]]}, "prompt"),
    (CMPL, {"prompt": [[1], [2, -3]]}, "prompt[1][1]"),
    (CMPL, {"prompt": [[1], [10**9]]}, "prompt"),
    (CMPL, {"prompt": ["one", LONG]}, "prompt"),
    (CMPL, {"prompt": ["x"] * 65}, "prompt"),
    (CMPL, {"prompt": [1, "a"]}, "prompt[1]"),
    (CMPL, {"prompt": [-1]}, "prompt[0]"),
    (CMPL, {"prompt": [10**9]}, "prompt"),
    (CMPL, {"prompt": None}, "prompt"),
    (CMPL, {"max_tokens": 5}, "prompt"),
    (CMPL, {"prompt": LONG}, "prompt"),
    (CMPL, {"prompt": " hi" * 2040, "max_tokens": 16}, "max_tokens"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"max_tokens": 5}, "messages"),
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": [{"role": "", "content": "hi"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user"}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, None),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "extra": 1, "name": 2}]}, "messages[0].name"),
    (CHAT, {"messages": USER, "logprobs": "yes"}, "logprobs"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, None),
    (CHAT, {"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
    (CHAT, {"messages": USER, "max_tokens": 10**9}, "max_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": LONG}]}, "messages"),
    (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, "tools[0].function"),
    (CHAT, {"messages": [{"role": "tool", "content": "4"}]}, "messages[0].tool_call_id"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (CMPL, {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
]


def test_every_error_code_has_a_status_and_a_type() -> None:
    assert set(HTTP_ERRORS) == set(ErrorCode)
    for code, (status, kind) in HTTP_ERRORS.items():
        body = APIError(code, "m").body()["error"]
        assert body == {"message": "m", "type": kind, "param": None, "code": code}
        assert (400 <= status < 500) == (kind != "server_error"), code
        assert f"| `{code}` | {status} | `{kind}` |" in (REPO / "docs" / "operations.md").read_text(), code


@pytest.mark.usefixtures("worker")
@pytest.mark.parametrize(("path", "body", "param"), BAD_BODIES)
def test_bad_bodies_get_400_and_queue_nothing(client, r, keys, path, body, param) -> None:
    error = assert_openai_error(client.post(path, json=body), 400)
    if param is not None:
        assert error["param"] == param
    assert queued(r, keys) == 0


@pytest.mark.usefixtures("worker")
@pytest.mark.parametrize(
    ("data", "content_type", "status"),
    [
        (b"{", "application/json", 400),
        (b"[1, 2]", "application/json", 400),
        (b'{"prompt": "x", "temperature": NaN}', "application/json", 400),
        (b'{"prompt": "\xff"}', "application/json", 400),
        # Half a UTF-16 surrogate pair, escaped: valid JSON, but no text.
        (b'{"prompt": "\\ud800"}', "application/json", 400),
        (b'{"model": "\\udfff", "prompt": "x"}', "application/json", 400),
        (b'{"prompt": "x", "stop": ["a\\ud83d"]}', "application/json", 400),
        (b'{"prompt": "x", "\\ud800": 1}', "application/json", 400),
        (b'{"prompt": "x"}', "text/plain", 415),
        (b"prompt=x", "application/x-www-form-urlencoded", 415),
        (b"", None, 415),
    ],
)
def test_malformed_bodies(client, r, keys, data, content_type, status) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    assert_openai_error(client.post(CMPL, data=data, headers=headers), status)
    assert queued(r, keys) == 0


@pytest.mark.usefixtures("worker")
def test_body_too_large_is_413(make_app, r, keys) -> None:
    client = make_app(max_body_bytes=1000).test_client()
    assert_openai_error(client.post(CMPL, json={"prompt": "x" * 2000}), 413)
    assert queued(r, keys) == 0


def test_unknown_model_route_and_method(client) -> None:
    unknown_model = client.post(CMPL, json={"prompt": "x", "model": "gpt-4"})
    assert assert_openai_error(unknown_model, 404)["param"] == "model"
    assert_openai_error(client.get("/v1/nothing"), 404, "not_found_error")
    response = client.get(CMPL)
    assert_openai_error(response, 405)
    assert "POST" in response.headers["Allow"]
    assert_openai_error(client.get("/v1/models/gpt-4"), 404)


@pytest.mark.usefixtures("worker")
def test_api_keys(make_app, r, keys) -> None:
    client = make_app(api_keys="k1, k2").test_client()
    for value in (None, "Bearer nope", "k1", "Basic k1", "Bearer k1k2"):
        headers = {} if value is None else {"Authorization": value}
        denied = client.post(CMPL, json={"prompt": "hi"}, headers=headers)
        assert_openai_error(denied, 401, "authentication_error")
        assert_openai_error(client.get("/v1/models", headers=headers), 401, "authentication_error")
    assert client.get("/v1/models", headers={"Authorization": "Bearer k2"}).status_code == 200
    for public in ("/health", "/ready", "/metrics", "/openapi.json"):
        assert client.get(public).status_code == 200
    assert queued(r, keys) == 0


# -- admission ----------------------------------------------------------------------------------------------


def test_no_live_worker_is_503_with_retry_after(client, r, keys) -> None:
    response = client.post(CMPL, json={"prompt": "hi"})
    assert_openai_error(response, 503, "server_error")
    assert int(response.headers["Retry-After"]) >= 1
    r.sadd(keys.workers, "gone")  # registered, but its heartbeat expired
    assert_openai_error(client.post(CMPL, json={"prompt": "hi"}), 503, "server_error")
    assert queued(r, keys) == 0


@pytest.mark.usefixtures("worker")
def test_full_queue_is_503_with_retry_after(make_app, r, keys) -> None:
    client = make_app(max_queue_len=5).test_client()
    stats = SchedulerStats(
        num_waiting=6,
        num_assigned=0,
        updated_at=time.time(),
        waiting_by_model={DEFAULT_MODEL_NAME: 5, "other": 1},
    )
    r.hset(keys.scheduler_stats, mapping=stats.to_hash())  # type: ignore[arg-type]
    response = client.post(CHAT, json={"messages": USER})
    assert assert_openai_error(response, 503, "server_error")["code"] == "overloaded"
    assert "Retry-After" in response.headers
    assert queued(r, keys) == 0


# -- operations ---------------------------------------------------------------------------------------------


def test_health_and_ready(client, r, keys) -> None:
    assert client.get("/health").get_json() == {"status": "ok"}
    assert client.get("/ready").status_code == 503
    add_worker(r, keys, "other-model", model="another-model")  # not a worker of the served model
    assert client.get("/ready").status_code == 503
    add_worker(r, keys)
    ready = client.get("/ready")
    assert ready.status_code == 200 and ready.get_json()["workers"] == 1


def test_only_a_worker_of_another_model_is_503_no_worker_and_an_unknown_model_404(client, r, keys) -> None:
    add_worker(r, keys, "other-model", model="another-model")
    response = client.post(CHAT, json={"messages": USER})
    assert assert_openai_error(response, 503, "server_error")["code"] == "no_worker"
    assert "Retry-After" in response.headers
    unknown = client.post(CHAT, json={"model": "another-model", "messages": USER})
    assert assert_openai_error(unknown, 404, "invalid_request_error")["code"] == "model_not_found"
    assert queued(r, keys) == 0


def test_models(client) -> None:
    listing = client.get("/v1/models").get_json()
    assert listing["object"] == "list"
    (card,) = listing["data"]
    assert card["id"] == "SmolLM2-135M-Instruct" and card["owned_by"] == "pagedserve"
    assert card["max_model_len"] == 2048
    assert client.get("/v1/models/SmolLM2-135M-Instruct").get_json()["id"] == card["id"]


def test_several_models_behind_one_gateway(make_app, r, keys, tiny_model_path) -> None:
    client = make_app(extra_models=f"small={tiny_model_path}", max_model_len=1024).test_client()
    add_worker(r, keys)  # a worker of the first model only
    assert [m["id"] for m in client.get("/v1/models").get_json()["data"]] == ["SmolLM2-135M-Instruct"]
    # Served here but with no live worker: 503 no_worker, not a request that waits for nobody.
    response = client.post(CHAT, json={"model": "small", "messages": USER})
    assert assert_openai_error(response, 503, "server_error")["code"] == "no_worker"
    add_worker(r, keys, "w-small", model="small")
    listing = client.get("/v1/models").get_json()["data"]
    assert [m["id"] for m in listing] == ["SmolLM2-135M-Instruct", "small"]
    assert listing[1]["max_model_len"] == 1024
    assert client.get("/v1/models/small").get_json()["id"] == "small"
    assert client.get("/ready").get_json()["models"] == {"SmolLM2-135M-Instruct": 1, "small": 1}
    # Each request is queued for its model (the scheduler gives it only to that model's workers).
    for model in ("small", None, "SmolLM2-135M-Instruct"):
        body = {"prompt": "hi", "max_tokens": 1, "stream": True, **({"model": model} if model else {})}
        client.post(CMPL, json=body).close()  # queued, then dropped by its client: nobody answers it
    models = [read_request(fields).model for _, fields in r.xrange(keys.requests)]
    assert models == ["small", "SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"]
    unknown = client.post(CMPL, json={"model": "nope", "prompt": "hi"})
    assert assert_openai_error(unknown, 404)["code"] == "model_not_found"
    assert "'small'" in unknown.get_json()["error"]["message"]


def test_tokenize_and_detokenize(client, tok) -> None:
    text = "The capital of France is Paris. 日本"
    tokens = client.post("/tokenize", json={"prompt": text}).get_json()
    assert tokens["tokens"] == tok.encode(text) and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == 2048
    assert client.post("/detokenize", json={"tokens": tokens["tokens"]}).get_json() == {"prompt": text}
    chat = client.post("/tokenize", json={"messages": USER}).get_json()
    assert chat["tokens"] == tok.encode_chat([{"role": "user", "content": "hi"}])
    assert_openai_error(client.post("/detokenize", json={"tokens": [10**9]}), 400)
    assert_openai_error(client.post("/detokenize", json={"tokens": "abc"}), 400)
    assert_openai_error(client.post("/tokenize", json={"prompt": ""}), 400)
    assert_openai_error(client.post("/tokenize", json={"messages": []}), 400)


def test_openapi_describes_every_route(client) -> None:
    app_paths = {
        re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule)
        for rule in client.application.url_map.iter_rules()
        if rule.endpoint != "static"
    }
    document = client.get("/openapi.json").get_json()
    assert document["openapi"].startswith("3.")
    assert set(document["paths"]) == app_paths
    schemas = document["components"]["schemas"]
    assert {"CompletionRequest", "ChatCompletionRequest", "DetokenizeRequest", "Error"} <= set(schemas)
    assert "top_logprobs" in schemas["ChatCompletionRequest"]["properties"]


def test_metrics_use_vllm_names(client, r, keys) -> None:
    add_worker(r, keys, "w0", free=30, total=40)
    buckets = [0, 1, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 4]  # 1, 2, 3 ms and one of 20 s
    stats = SchedulerStats(
        num_waiting=0, num_assigned=0, updated_at=time.time(), queue_time_buckets=buckets,
        queue_time_sum_s=20.006,
    )  # fmt: skip
    r.hset(keys.scheduler_stats, mapping=stats.to_hash())  # type: ignore[arg-type]
    text = client.get("/metrics").get_data(as_text=True)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
    ):
        assert f"# TYPE {name.removesuffix('_total')}" in text, name
    assert 'vllm:kv_cache_usage_perc{model_name="SmolLM2-135M-Instruct",worker="w0"} 0.25' in text
    assert 'vllm:generation_tokens_total{model_name="SmolLM2-135M-Instruct",worker="w0"} 45.0' in text
    queue_time = 'vllm:request_queue_time_seconds_bucket{le="%s",model_name="SmolLM2-135M-Instruct"} %s'
    assert queue_time % ("0.002", "1.0") in text and queue_time % ("+Inf", "4.0") in text
