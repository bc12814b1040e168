"""Cancellation as clients expect it, tried as vLLM's and llama.cpp's server tests do it (a client that
gives up on a long request after half a second): a non-streamed request whose client goes is aborted at once,
since nobody knows its id; a stream, or a request the client named (X-Request-Id), is kept for the resume
grace and can be fetched again. The resume grace here is long (30 s): "at once" and "after it" differ."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import openai
import pytest
import requests

from shared.protocol import AbortMessage, encode
from tests.support.cluster import MODEL_NAME, Cluster, free_port, running_cluster, service_env

RESUME_GRACE_S = 30
PROMPT = "Paged attention stores the KV cache in blocks"
LONG = 1000  # tokens: far longer than the client waits


@pytest.fixture(scope="module")
def cluster(
    tiny_model_path: str,
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
    without_engine: dict[str, str],
) -> Iterator[Cluster]:
    prefix = f"pagedserve-cancel-{uuid.uuid4().hex[:10]}"
    env = service_env(redis_url, prefix, tiny_model_path, free_port(), RESUME_GRACE_S=str(RESUME_GRACE_S))
    with running_cluster(env, tmp_path_factory.mktemp("logs"), ("w1",), without_engine) as c:
        yield c


def impatient(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=0.5)


def running(cluster: Cluster) -> int:
    """Requests assigned to the worker now (what it runs or is about to)."""
    return int(cluster.redis.hlen(cluster.keys.assigned("w1")))


def seconds_until_idle(cluster: Cluster, timeout: float = 20) -> float:
    started = time.monotonic()
    while running(cluster):
        assert time.monotonic() - started < timeout, "the request still runs"
        time.sleep(0.02)
    return time.monotonic() - started


def abort_reason(cluster: Cluster, request_id: str) -> str | None:
    value = cluster.redis.get(cluster.keys.abort_flag(request_id))
    return None if value is None else str(value)


def test_a_request_whose_client_times_out_is_aborted_at_once(cluster: Cluster) -> None:
    """vLLM's request cancellation and llama.cpp's cancelled request: the client gives up after 0.5 s; the
    worker is free again about as fast, not after the resume grace."""
    for kind in ("completion", "chat"):
        client = impatient(cluster)
        with pytest.raises(openai.APITimeoutError):
            if kind == "completion":
                client.completions.create(
                    model=MODEL_NAME, prompt=PROMPT, max_tokens=LONG, extra_body={"ignore_eos": True}
                )
            else:
                client.chat.completions.create(
                    model=MODEL_NAME,
                    messages=[{"role": "user", "content": PROMPT}],
                    max_tokens=LONG,
                    extra_body={"ignore_eos": True},
                )
        freed_s = seconds_until_idle(cluster)
        print(f"{kind}: the worker was free {freed_s:.2f} s after the client gave up")
        assert freed_s < RESUME_GRACE_S / 10
        flags = [k for k in cluster.redis.scan_iter(match=cluster.keys.abort_flag("*"))]
        assert "client_disconnect" in {cluster.redis.get(k) for k in flags}
    beats = cluster.wait_idle(timeout=10)  # the heartbeat says so too (vllm:num_requests_running 0)
    assert all(b.num_running == 0 for b in beats.values())
    metrics = requests.get(f"{cluster.base_url}/metrics", timeout=10).text
    running_lines = [line for line in metrics.splitlines() if line.startswith("vllm:num_requests_running{")]
    assert running_lines and all(line.endswith(" 0.0") for line in running_lines), running_lines
    # The server goes on serving (vLLM's check after its cancelled requests).
    answer = cluster.client().completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4)
    assert answer.usage is not None and answer.usage.completion_tokens == 4


def test_a_stream_whose_client_drops_is_kept_for_the_resume_grace(cluster: Cluster) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with requests.post(f"{cluster.base_url}/v1/completions", json=body, stream=True, timeout=60) as r:
        first = next(line for line in r.iter_lines() if line.startswith(b"id: "))
    request_id = first[len(b"id: ") :].decode().rpartition(":")[0]
    time.sleep(2)
    assert running(cluster) == 1 and abort_reason(cluster, request_id) is None  # it may be resumed
    cluster.redis.set(cluster.keys.abort_flag(request_id), "test", ex=60)  # done with it
    cluster.redis.publish(cluster.keys.aborts, encode(AbortMessage(request_id=request_id, reason="test")))
    seconds_until_idle(cluster)


def test_a_named_request_whose_client_times_out_runs_on_and_is_fetched_by_its_name(
    cluster: Cluster,
) -> None:
    name = f"named-{uuid.uuid4().hex[:8]}"
    max_tokens = LONG  # so that it outlasts the client's wait however fast the worker is
    with pytest.raises(openai.APITimeoutError):
        impatient(cluster).completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
            extra_headers={"X-Request-Id": name},
        )
    time.sleep(1)
    assert abort_reason(cluster, name) is None
    fetched = requests.get(f"{cluster.base_url}/v1/completions/{name}", timeout=120)
    assert fetched.status_code == 200, fetched.text
    got = fetched.json()
    assert got["id"] == name and got["usage"]["completion_tokens"] == max_tokens
    uninterrupted = cluster.client().completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got["choices"][0]["text"] == uninterrupted.choices[0].text
