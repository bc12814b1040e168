"""The gateway as its own process, under gunicorn with gevent workers (a thread plays the worker)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import requests

from gateway.settings import GatewaySettings
from shared.protocol import (
    GenerateRequest,
)
from shared.streams import read_request
from tests.support import REPO
from tests.support.gateway_app import (
    FakeWorker,
    add_worker,
    answer_with,
    data_of,
    emit,
    sse_events,
)

# -- under gunicorn, with gevent workers --------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


GUNICORN_REDIS_CONNECTIONS = 8


@pytest.fixture
def gunicorn_url(redis_url, redis_prefix, tiny_model_path, tmp_path) -> Iterator[str]:
    port = _free_port()
    env = {
        **os.environ,
        "REDIS_URL": redis_url,
        "REDIS_PREFIX": redis_prefix,
        "MODEL": tiny_model_path,
        "PORT": str(port),
        "GATEWAY_WORKERS": "1",
        "SSE_HEARTBEAT_S": "0.1",
        "RESUME_GRACE_S": "0.5",
        "REDIS_MAX_CONNECTIONS": str(GUNICORN_REDIS_CONNECTIONS),
        "LOG_LEVEL": "WARNING",
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "metrics"),
    }
    log = (tmp_path / "gunicorn.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "gateway"], env=env, cwd=REPO, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "gunicorn.log").read_text()
            try:
                if requests.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:  # not listening yet, or its worker still loading
                pass
            assert time.monotonic() < deadline, "gunicorn did not start"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()  # exec'd: this is gunicorn's master, which stops its workers gracefully
        proc.wait(timeout=30)
        log.close()


def test_gunicorn_gevent_worker_holds_many_streams_at_once(gunicorn_url, r, keys, tok) -> None:
    add_worker(r, keys)
    ids = tok.encode(" in parallel")
    count = 200
    # The fake worker answers nothing until all requests are queued: they all wait at once, on one
    # gunicorn worker process, on one pub/sub connection and a few pooled ones.
    fake = FakeWorker(r, keys, answer_with(r, keys, ids), count=count, hold=True)
    fake.start()
    bodies: list[str] = []

    def stream() -> None:
        body = {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
        with requests.post(f"{gunicorn_url}/v1/completions", json=body, stream=True, timeout=60) as response:
            bodies.append(response.text)

    clients = [threading.Thread(target=stream) for _ in range(count)]
    for t in clients:
        t.start()
    while len(fake.requests) < count and fake.is_alive():
        started = time.monotonic()
        assert requests.get(f"{gunicorn_url}/health", timeout=5).status_code == 200
        assert time.monotonic() - started < 1.0  # the waiting streams do not block the process
        time.sleep(0.05)
    connections = [c for c in r.client_list() if c["name"] == f"{keys.prefix}:gateway"]
    assert 1 <= len(connections) <= GUNICORN_REDIS_CONNECTIONS + 1  # the pool, and the hub's pub/sub
    for t in clients:
        t.join(timeout=60)
    fake.join()
    assert fake.error is None and len(bodies) == count
    for body in bodies:
        chunks = data_of(sse_events(body))
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == " in parallel"
        assert body.endswith("data: [DONE]\n\n")
    metrics = requests.get(f"{gunicorn_url}/metrics", timeout=5).text
    # Counted in the worker process's multiprocess files, summed by the scrape.
    expected = f'vllm:e2e_request_latency_seconds_count{{model_name="SmolLM2-135M-Instruct"}} {count}.0'
    assert expected in metrics


def test_the_openai_client_reads_a_stream_that_pauses_mid_way(gunicorn_url, r, keys, tok) -> None:
    """Keep-alive comments come between events that carry ids: no blank line may follow them, or the client
    (which keeps the last id) takes the blank line for an event without data."""
    add_worker(r, keys)
    ids = tok.encode(" slow and steady")

    def respond(request: GenerateRequest) -> None:
        emit(r, keys, request.request_id, 0, 0, ids[:1])
        time.sleep(0.5)  # five keep-alive ticks
        emit(r, keys, request.request_id, 0, 1, ids[1:], "length")

    fake = FakeWorker(r, keys, respond)
    fake.start()
    client = openai.OpenAI(base_url=f"{gunicorn_url}/v1", api_key="none", max_retries=0)
    stream = client.completions.create(model="SmolLM2-135M-Instruct", prompt="x", stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == tok.decode(ids)
    fake.join()
    assert fake.error is None


def test_gunicorn_notices_a_client_that_hangs_up(gunicorn_url, r, keys) -> None:
    add_worker(r, keys)
    host, port = gunicorn_url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "x", "stream": True}).encode()
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert b"200 OK" in conn.recv(4096)
        deadline = time.monotonic() + 5
        while not r.xlen(keys.requests):
            assert time.monotonic() < deadline
            time.sleep(0.02)
    (entry,) = r.xrange(keys.requests)  # type: ignore[misc]
    rid = read_request(entry[1]).request_id
    deadline = time.monotonic() + 5
    while r.get(keys.abort_flag(rid)) is None:
        assert time.monotonic() < deadline, "the hang-up went unnoticed"
        time.sleep(0.05)
    assert r.get(keys.abort_flag(rid)) == "client_disconnect"


def raw_exchange(url: str, request: bytes) -> tuple[int, dict[str, Any]]:
    """Send bytes as they are; the status and the JSON body of the answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(request)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), answer[:300]
    return int(head.split()[1]), json.loads(body)


@pytest.mark.parametrize(
    ("request_bytes", "status", "code"),
    [
        (b"GET /v1/models?" + b"x" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, "uri_too_long"),
        (
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"y" * 9000 + b"\r\n\r\n",
            431,
            "headers_too_large",
        ),
        (b"NOT A REQUEST\r\n\r\n", 400, "invalid_request"),
        (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
            + b"".join(b"%x\r\n%s\r\n" % (65536, b"z" * 65536) for _ in range(80))
            + b"0\r\n\r\n",
            413,
            "body_too_large",
        ),
    ],
    ids=["long-url", "large-header", "garbage", "chunked-5mb"],
)
def test_gunicorn_refusals_are_openai_errors(
    gunicorn_url, request_bytes: bytes, status: int, code: str
) -> None:
    got, body = raw_exchange(gunicorn_url, request_bytes)
    assert got == status and body["error"]["code"] == code and body["error"]["message"], body


def test_launcher_help_lists_every_setting() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # argparse wraps lines anywhere
    for name in GatewaySettings.model_fields:
        assert f"env {name.upper()}," in text, name
