"""Everything around generation, as vLLM's and llama.cpp's server tests define it: tokenization
(test_tokenization.py, llama.cpp's test_tokenize.py), models and version (basic/test_basic.py), API keys and
CORS (llama.cpp's test_security.py), OpenAI error shapes, and the metrics of vLLM's test_metrics.py. A real
stack serving the tiny random model, with an API key."""

from __future__ import annotations

from typing import Any

import openai
import pytest
import requests

from shared.errors import ErrorCode
from tests.support.api_cluster import assert_openai_error, cluster_fixture, get, poll, post, scrape
from tests.support.cluster import MODEL_NAME, Cluster
from tests.support.metrics import VLLM_NAMES

API_KEY = "sk-this-is-the-secret-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 1024


cluster = cluster_fixture(
    "tiny_model_path", API_KEYS=API_KEY, GATEWAY_WORKERS="2", MAX_MODEL_LEN=str(MAX_MODEL_LEN)
)


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def authed(cluster: Cluster, path: str, body: Any) -> requests.Response:
    return post(cluster, path, body, headers=AUTH)


# -- tokenize / detokenize ----------------------------------------------------------------------------------


@pytest.mark.parametrize("add_special", [False, True])
def test_tokenize_prompt(cluster: Cluster, hf_tokenizer: Any, add_special: bool) -> None:
    prompt = "vllm1 This is a test prompt."
    response = authed(
        cluster, "/tokenize", {"model": MODEL_NAME, "prompt": prompt, "add_special_tokens": add_special}
    )
    assert response.status_code == 200, response.text
    result = response.json()
    tokens = hf_tokenizer.encode(prompt, add_special_tokens=add_special)
    assert result["tokens"] == tokens
    assert result["count"] == len(tokens)
    assert result["max_model_len"] == MAX_MODEL_LEN
    assert result["token_strs"] is None


def test_tokenize_chat(cluster: Cluster, hf_tokenizer: Any) -> None:
    for add_generation in (False, True):
        for add_special in (False, True):
            conversation = [
                {"role": "user", "content": "Hi there!"},
                {"role": "assistant", "content": "Nice to meet you!"},
                {"role": "user", "content": "Can I ask a question? vllm1"},
            ]
            for continue_final in (False, True):
                if add_generation and continue_final:
                    continue
                if continue_final:
                    conversation.append({"role": "assistant", "content": "Sure,"})
                prompt = hf_tokenizer.apply_chat_template(
                    conversation,
                    add_generation_prompt=add_generation,
                    continue_final_message=continue_final,
                    tokenize=False,
                )
                tokens = hf_tokenizer.encode(prompt, add_special_tokens=add_special)
                response = authed(
                    cluster,
                    "/tokenize",
                    {
                        "model": MODEL_NAME,
                        "messages": conversation,
                        "add_generation_prompt": add_generation,
                        "continue_final_message": continue_final,
                        "add_special_tokens": add_special,
                    },
                )
                assert response.status_code == 200, response.text
                result = response.json()
                assert result["tokens"] == tokens, (add_generation, add_special, continue_final)
                assert result["count"] == len(tokens)
                assert result["max_model_len"] == MAX_MODEL_LEN


def test_tokenize_with_token_strs(cluster: Cluster, hf_tokenizer: Any) -> None:
    prompt = "This is a token_strs test prompt! vllm1"
    response = authed(
        cluster, "/tokenize", {"model": MODEL_NAME, "prompt": prompt, "return_token_strs": True}
    )
    assert response.status_code == 200, response.text
    tokens = hf_tokenizer.encode(prompt, add_special_tokens=True)
    result = response.json()
    assert result["tokens"] == tokens
    assert result["token_strs"] == hf_tokenizer.convert_ids_to_tokens(tokens)


def test_detokenize(cluster: Cluster, hf_tokenizer: Any) -> None:
    prompt = "This is a test prompt. vllm1"
    tokens = hf_tokenizer.encode(prompt, add_special_tokens=False)
    response = authed(cluster, "/detokenize", {"model": MODEL_NAME, "tokens": tokens})
    assert response.status_code == 200, response.text
    assert response.json() == {"prompt": prompt}


def test_tokenize_round_trip_unicode(cluster: Cluster) -> None:
    """llama.cpp's test_tokenize_detokenize and test_tokenize_with_pieces."""
    content = "This is a test string with unicode 媽 and emoji 🤗"
    tokens = authed(cluster, "/tokenize", {"prompt": content, "return_token_strs": True}).json()
    assert tokens["count"] > 5 and len(tokens["token_strs"]) == tokens["count"]
    assert all(t >= 0 for t in tokens["tokens"]) and all(tokens["token_strs"])
    assert authed(cluster, "/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"] == content


def test_detokenize_out_of_vocabulary(cluster: Cluster) -> None:
    assert_openai_error(authed(cluster, "/detokenize", {"tokens": [10**8]}), 400, ErrorCode.INVALID_REQUEST)


# -- models, version, health --------------------------------------------------------------------------------


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].object == "model"
    assert models[0].model_extra is not None and models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("no-such-model")
    assert raised.value.code == ErrorCode.MODEL_NOT_FOUND.value


def test_version(cluster: Cluster) -> None:
    response = get(cluster, "/version", headers=AUTH)
    assert response.status_code == 200, response.text
    assert set(response.json()) == {"version"}
    assert isinstance(response.json()["version"], str) and response.json()["version"]


@pytest.mark.parametrize("path", ["/health", "/ready", "/metrics"])
def test_public_endpoints_need_no_key(cluster: Cluster, path: str) -> None:
    response = get(cluster, path)
    assert response.status_code == 200, response.text


# -- API keys and CORS (llama.cpp's test_security.py) -------------------------------------------------------


@pytest.mark.parametrize("api_key", [None, "invalid-key"])
def test_incorrect_api_key(cluster: Cluster, api_key: str | None) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = post(
        cluster, "/v1/completions", {"prompt": "I believe the meaning of life is"}, headers=headers
    )
    error = assert_openai_error(response, 401, ErrorCode.INVALID_API_KEY)
    assert error["type"] == "authentication_error"


def test_correct_api_key(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "system", "content": "You are a chatbot."}, {"role": "user", "content": "Hi?"}],
        max_tokens=4,
    )
    assert len(out.choices) == 1
    wrong = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


@pytest.mark.parametrize("origin", ["http://localhost:3000", "https://web.mydomain.fr"])
def test_cors_preflight(cluster: Cluster, origin: str) -> None:
    """A browser's preflight carries no API key and must be answered with what it asked for."""
    response = requests.options(
        f"{cluster.base_url}/v1/completions",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "Authorization, Content-Type",
        },
        timeout=10,
    )
    assert response.status_code in (200, 204), response.text
    assert response.headers.get("Access-Control-Allow-Origin") in ("*", origin)
    methods = response.headers.get("Access-Control-Allow-Methods", "")
    assert methods == "*" or "POST" in methods
    allowed = response.headers.get("Access-Control-Allow-Headers", "").lower()
    assert allowed == "*" or ("authorization" in allowed and "content-type" in allowed)


def test_cors_on_a_response(cluster: Cluster) -> None:
    origin = "https://web.mydomain.fr"
    response = requests.get(f"{cluster.base_url}/v1/models", headers={**AUTH, "Origin": origin}, timeout=10)
    assert response.status_code == 200
    assert response.headers.get("Access-Control-Allow-Origin") in ("*", origin)


# -- error shapes -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"seed": 2**64}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_bad_completion_parameter(cluster: Cluster, body: dict[str, Any], param: str) -> None:
    request = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, **body}
    error = assert_openai_error(authed(cluster, "/v1/completions", request), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] is None or error["param"].startswith(param)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user"}]}, "messages"),
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ],
)
def test_bad_chat_parameter(cluster: Cluster, body: dict[str, Any], param: str) -> None:
    request = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body}
    error = assert_openai_error(authed(cluster, "/v1/chat/completions", request), 400)
    assert error["param"] is None or error["param"].startswith(param)


def test_bad_input_while_streaming_is_a_plain_400(cluster: Cluster) -> None:
    response = authed(cluster, "/v1/completions", {"prompt": "Hello", "stream": True, "temperature": -1})
    assert_openai_error(response, 400, ErrorCode.INVALID_REQUEST)


def test_context_length_exceeded(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=MAX_MODEL_LEN + 1)
    assert raised.value.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED.value
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL_NAME, prompt=[1000] * (MAX_MODEL_LEN + 1), max_tokens=1)
    assert raised.value.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED.value


def test_unknown_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="gpt-nothing", prompt="Hello", max_tokens=2)
    assert raised.value.code == ErrorCode.MODEL_NOT_FOUND.value


def test_invalid_json(cluster: Cluster) -> None:
    response = requests.post(
        f"{cluster.base_url}/v1/completions",
        data=b"{not json",
        headers={**AUTH, "Content-Type": "application/json"},
        timeout=10,
    )
    assert_openai_error(response, 400, ErrorCode.INVALID_JSON)


def test_wrong_content_type(cluster: Cluster) -> None:
    """vLLM's test_request_wrong_content_type: form-encoded bodies are refused with an error status."""
    response = requests.post(
        f"{cluster.base_url}/v1/chat/completions",
        data="messages=hi",
        headers={**AUTH, "Content-Type": "application/x-www-form-urlencoded"},
        timeout=10,
    )
    assert_openai_error(response, 415, ErrorCode.UNSUPPORTED_MEDIA_TYPE)


def test_unknown_endpoint_and_method(cluster: Cluster) -> None:
    assert_openai_error(get(cluster, "/v1/nothing-here", headers=AUTH), 404, ErrorCode.NOT_FOUND)
    assert_openai_error(get(cluster, "/v1/completions", headers=AUTH), 405, ErrorCode.METHOD_NOT_ALLOWED)


# -- metrics (vLLM's test_metrics.py) -----------------------------------------------------------------------


def test_metrics_exist(client: openai.OpenAI, cluster: Cluster) -> None:
    client.completions.create(model=MODEL_NAME, prompt="Hello, my name is", max_tokens=5, temperature=0.0)
    text = get(cluster, "/metrics").text
    missing = [name for name in VLLM_NAMES if name not in text]
    assert not missing, missing


def test_metrics_counts(client: openai.OpenAI, cluster: Cluster, hf_tokenizer: Any) -> None:
    """k requests move each counter and histogram by what vLLM's _get_expected_values says. Those read from
    worker heartbeats lag by a heartbeat: the check is repeated until they settle."""
    prompt_ids = hf_tokenizer.encode("Hello my name is Robert and I love magic", add_special_tokens=False)
    k, max_tokens, num_prompt = 3, 6, len(prompt_ids)
    cluster.wait_idle()
    before = scrape(cluster)
    for _ in range(k):
        out = client.completions.create(
            model=MODEL_NAME, prompt=prompt_ids, max_tokens=max_tokens, extra_body={"ignore_eos": True}
        )
        assert out.usage is not None and out.usage.completion_tokens == max_tokens
    expected = {
        "vllm:time_to_first_token_seconds_count": k,
        "vllm:e2e_request_latency_seconds_count": k,
        "vllm:request_queue_time_seconds_count": k,
        "vllm:request_inference_time_seconds_count": k,
        "vllm:request_prefill_time_seconds_count": k,
        "vllm:request_decode_time_seconds_count": k,
        "vllm:request_prompt_tokens_sum": k * num_prompt,
        "vllm:request_prompt_tokens_count": k,
        "vllm:request_generation_tokens_sum": k * max_tokens,
        "vllm:request_generation_tokens_count": k,
        "vllm:request_params_n_count": k,
        "vllm:request_params_max_tokens_sum": k * max_tokens,
        "vllm:request_params_max_tokens_count": k,
        "vllm:iteration_tokens_total_sum": k * (num_prompt + max_tokens),
        "vllm:iteration_tokens_total_count": k * max_tokens,
        "vllm:prompt_tokens_total": k * num_prompt,
        "vllm:generation_tokens_total": k * max_tokens,
        "vllm:request_success_total": k,
    }

    def settled() -> None:
        after = scrape(cluster)
        moved = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in expected}
        assert moved == {name: float(value) for name, value in expected.items()}

    poll(settled, timeout=20)


def test_gauges_return_to_zero(client: openai.OpenAI, cluster: Cluster) -> None:
    """vLLM's test_abort_metrics_reset, on finished requests: running, waiting and KV usage go back to 0."""
    client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4)

    def idle() -> None:
        now = scrape(cluster)
        assert now["vllm:num_requests_running"] == 0
        assert now["vllm:num_requests_waiting"] == 0
        assert now["vllm:kv_cache_usage_perc"] == 0.0

    poll(idle, timeout=20)
