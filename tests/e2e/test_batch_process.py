"""The Batch API end to end: gunicorn gateway, scheduler, a CPU worker and Celery batch workers as real
processes over a real Redis, driven with the official openai client."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
import requests

from shared.errors import ErrorCode
from tests.support.api_cluster import assert_openai_error, get, post
from tests.support.batch_cluster import (
    BATCH_ENV,
    batch_fixture,
    chat_line,
    jsonl,
    queued_batch_requests,
    results,
    start_batch_worker,
    submit,
    wait_until,
)
from tests.support.cluster import MODEL_NAME, Cluster

MAX_FILE_BYTES = 100_000
MAX_LINES = 300
cluster = batch_fixture(
    "tiny_model_path", BATCH_MAX_FILE_BYTES=str(MAX_FILE_BYTES), BATCH_MAX_LINES=str(MAX_LINES)
)
PRIORITY = int(BATCH_ENV["BATCH_PRIORITY"])
ENDED = {"completed", "failed", "expired", "cancelled"}
TOPICS = ["the sea", "a mountain", "bread", "a violin", "winter", "a library", "coffee", "a bridge"]


def prompt(i: int) -> str:
    return f"Tell me about {TOPICS[i % len(TOPICS)]}, number {i}."


def interactive(c: Cluster, line: dict[str, Any]) -> dict[str, Any]:
    response = post(c, line["url"], line["body"])
    assert response.status_code == 200, response.text
    return dict(response.json())


def comparable(body: dict[str, Any]) -> Any:
    """What two runs of the same greedy request agree on: everything but ids, times and prefix-cache hits."""
    usage = {k: v for k, v in body["usage"].items() if k != "prompt_tokens_details"}
    return {
        "choices": body["choices"],
        "usage": usage,
        "model": body["model"],
        "object": body["object"],
    }


def test_a_200_line_batch_answers_each_line_as_the_api_does(cluster: Cluster) -> None:
    client = cluster.client()
    lines = [chat_line(f"req-{i}", prompt(i), max_tokens=4 + i % 5) for i in range(200)]
    batch = submit(client, lines, metadata={"purpose": "test"})
    assert batch.status == "validating" and batch.metadata == {"purpose": "test"}
    done = wait_until(client, batch.id, ENDED)
    assert done.status == "completed", done
    assert done.request_counts.total == 200 and done.request_counts.completed == 200
    assert done.request_counts.failed == 0 and done.error_file_id is None
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    outputs = results(client, done.output_file_id)
    assert [o["custom_id"] for o in outputs] == [f"req-{i}" for i in range(200)]  # in the file's order
    with ThreadPoolExecutor(8) as pool:
        expected = list(pool.map(lambda line: interactive(cluster, line), lines))
    for output, want in zip(outputs, expected):
        assert output["error"] is None and output["id"].startswith("batch_req_")
        assert output["response"]["status_code"] == 200
        assert comparable(output["response"]["body"]) == comparable(want)
    assert len(queued_batch_requests(cluster, PRIORITY)) == 200  # each line queued once
    cluster.wait_idle()


def test_bad_lines_go_to_the_error_file_and_the_rest_runs(cluster: Cluster) -> None:
    client = cluster.client()
    good = [chat_line(f"good-{i}", prompt(i)) for i in range(4)]
    wrong_url = {**chat_line("wrong-url", "hi"), "url": "/v1/completions"}
    bad_body = chat_line("bad-body", "hi", max_tokens="many")
    too_long = chat_line("too-long", "word " * 5000)
    other_model = chat_line("other-model", "hi", model="gpt-9")
    no_id = {k: v for k, v in chat_line("", "hi").items() if k != "custom_id"}
    lines = [good[0], "{not json", wrong_url, good[1], bad_body, too_long, other_model, no_id, *good[2:]]
    done = wait_until(client, submit(client, lines).id, ENDED)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (
        10,
        4,
        6,
    )
    assert [o["custom_id"] for o in results(client, done.output_file_id)] == [f"good-{i}" for i in range(4)]
    errors = {e["custom_id"]: e for e in results(client, done.error_file_id)}
    assert set(errors) == {None, "wrong-url", "bad-body", "too-long", "other-model"}
    assert errors["wrong-url"]["response"] is None
    assert errors["wrong-url"]["error"]["code"] == ErrorCode.INVALID_REQUEST
    for custom_id, status, code in [
        ("bad-body", 400, ErrorCode.INVALID_REQUEST),
        ("too-long", 400, ErrorCode.CONTEXT_LENGTH_EXCEEDED),
        ("other-model", 404, ErrorCode.MODEL_NOT_FOUND),
    ]:
        response = errors[custom_id]["response"]
        assert response["status_code"] == status, errors[custom_id]
        assert response["body"]["error"]["code"] == code
    codes = [e["error"]["code"] for e in results(client, done.error_file_id) if e["custom_id"] is None]
    assert sorted(codes) == [ErrorCode.INVALID_JSON, ErrorCode.INVALID_REQUEST]  # not JSON; no custom_id


def test_a_completions_batch_with_several_prompts_per_line(cluster: Cluster) -> None:
    client = cluster.client()
    body = {"model": MODEL_NAME, "prompt": ["The sea is", "Bread is"], "max_tokens": 5, "temperature": 0}
    lines = [{"custom_id": "two", "method": "POST", "url": "/v1/completions", "body": body}]
    done = wait_until(client, submit(client, lines, endpoint="/v1/completions").id, ENDED)
    assert done.status == "completed", done
    [output] = results(client, done.output_file_id)
    want = interactive(cluster, lines[0])
    assert comparable(output["response"]["body"]) == comparable(want)
    assert len(output["response"]["body"]["choices"]) == 2


def test_cancel_mid_batch_keeps_what_finished(cluster: Cluster) -> None:
    client = cluster.client()
    lines = [chat_line(f"c-{i}", prompt(i), max_tokens=128, ignore_eos=True) for i in range(120)]
    batch = submit(client, lines)
    wait_until_progress(client, batch.id, 8)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_until(client, batch.id, ENDED, timeout=60)
    assert done.status == "cancelled" and done.cancelling_at and done.cancelled_at
    outputs = results(client, done.output_file_id)
    assert 8 <= len(outputs) < 120
    assert len(outputs) == done.request_counts.completed
    assert all(o["response"]["status_code"] == 200 for o in outputs)
    assert client.batches.cancel(batch.id).status == "cancelled"  # cancelling again changes nothing
    cluster.wait_idle()  # the requests in flight were aborted, their blocks freed


def test_a_batch_past_its_window_expires_with_what_finished(cluster: Cluster) -> None:
    client = cluster.client()
    # The first lines are short, so some finish within the window; the rest cannot.
    lines = [
        chat_line(f"e-{i}", prompt(i), max_tokens=2 if i < 4 else 256, ignore_eos=True) for i in range(120)
    ]
    done = wait_until(client, submit(client, lines, completion_window="3s").id, ENDED, timeout=60)
    assert done.status == "expired" and done.expired_at, done
    finished = results(client, done.output_file_id)
    errors = results(client, done.error_file_id)
    assert 0 < len(finished) < 120 and len(finished) + len(errors) == 120
    assert {e["error"]["code"] for e in errors} == {ErrorCode.BATCH_EXPIRED}
    assert {o["custom_id"] for o in finished} | {e["custom_id"] for e in errors} == {
        f"e-{i}" for i in range(120)
    }
    cluster.wait_idle()


def wait_until_progress(client: openai.OpenAI, batch_id: str, completed: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while client.batches.retrieve(batch_id).request_counts.completed < completed:  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_a_killed_batch_worker_loses_no_line_and_runs_none_twice(
    cluster: Cluster, without_engine: dict[str, str]
) -> None:
    client = cluster.client()
    before = len(queued_batch_requests(cluster, PRIORITY))
    lines = [chat_line(f"k-{i}", prompt(i), max_tokens=128, ignore_eos=True) for i in range(100)]
    batch = submit(client, lines)
    wait_until_progress(client, batch.id, 30)
    cluster.processes["batch"].send_signal(signal.SIGKILL)
    cluster.processes["batch"].wait()
    killed = client.batches.retrieve(batch.id)
    assert killed.status == "in_progress" and killed.request_counts.completed < 100  # type: ignore[union-attr]
    start_batch_worker(cluster, "batch-2", without_engine)
    done = wait_until(client, batch.id, ENDED, timeout=180)
    assert done.status == "completed", done
    outputs = results(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in outputs) == sorted(f"k-{i}" for i in range(100))
    assert done.request_counts.completed == 100 and done.request_counts.failed == 0
    queued = queued_batch_requests(cluster, PRIORITY)
    assert len(queued) - before == 100  # no line was queued twice
    assert all(len(o["response"]["body"]["choices"][0]["message"]["content"]) > 0 for o in outputs)
    cluster.wait_idle()


# -- the API's answers to bad requests ---------------------------------------------------------------------


def upload(c: Cluster, data: bytes, purpose: str = "batch") -> requests.Response:
    files = {"file": ("in.jsonl", data, "application/jsonl")}
    return requests.post(f"{c.base_url}/v1/files", files=files, data={"purpose": purpose}, timeout=30)


def test_a_bad_file_is_refused_naming_its_first_bad_line(cluster: Cluster) -> None:
    line = chat_line("a", "hi")
    error = assert_openai_error(upload(cluster, jsonl([line, line])), 400, ErrorCode.INVALID_REQUEST)
    assert "line 2" in error["message"] and error["param"] == "file"
    error = assert_openai_error(
        upload(cluster, jsonl([line]) + b"\xff\xfe\n"), 400, ErrorCode.INVALID_REQUEST
    )
    assert "line 2" in error["message"]
    assert_openai_error(upload(cluster, b"\n\n"), 400, ErrorCode.INVALID_REQUEST)
    error = assert_openai_error(upload(cluster, jsonl([line]), purpose="fine-tune"), 400)
    assert error["param"] == "purpose"
    response = requests.post(f"{cluster.base_url}/v1/files", json={"purpose": "batch"}, timeout=30)
    assert_openai_error(response, 400, ErrorCode.INVALID_REQUEST)


def test_a_file_past_the_limits_is_refused(cluster: Cluster) -> None:
    line = chat_line("a", "hi")
    lines = [{**line, "custom_id": f"n-{i}"} for i in range(MAX_LINES + 1)]
    error = assert_openai_error(upload(cluster, jsonl(lines)), 400, ErrorCode.INVALID_REQUEST)
    assert f"line {MAX_LINES + 1}" in error["message"] and str(MAX_LINES) in error["message"]
    big = jsonl([{**line, "pad": "x" * 1000, "custom_id": f"b-{i}"} for i in range(120)])
    assert len(big) > MAX_FILE_BYTES
    assert_openai_error(upload(cluster, big), 413, ErrorCode.BODY_TOO_LARGE)
    assert upload(cluster, jsonl(lines[:MAX_LINES])).status_code == 200  # right at the limits


def test_files_round_trip_and_unknown_ids(cluster: Cluster) -> None:
    client = cluster.client()
    data = jsonl([chat_line("x", "hello")])
    uploaded = client.files.create(file=("mine.jsonl", data), purpose="batch")
    assert (uploaded.bytes, uploaded.filename, uploaded.purpose) == (len(data), "mine.jsonl", "batch")
    assert client.files.retrieve(uploaded.id).id == uploaded.id
    assert client.files.content(uploaded.id).content == data
    assert uploaded.id in [f.id for f in client.files.list()]
    assert client.files.delete(uploaded.id).deleted
    assert_openai_error(get(cluster, f"/v1/files/{uploaded.id}"), 404, ErrorCode.FILE_NOT_FOUND)
    assert_openai_error(get(cluster, f"/v1/files/{uploaded.id}/content"), 404, ErrorCode.FILE_NOT_FOUND)
    assert_openai_error(get(cluster, "/v1/batches/batch_nope"), 404, ErrorCode.BATCH_NOT_FOUND)
    body = {"input_file_id": uploaded.id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    assert_openai_error(post(cluster, "/v1/batches", body), 404, ErrorCode.FILE_NOT_FOUND)


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"endpoint": "/v1/embeddings"}, "endpoint"),
        ({"completion_window": "forever"}, "completion_window"),
        ({"completion_window": "30d"}, "completion_window"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"input_file_id": 7}, "input_file_id"),
    ],
)
def test_a_bad_batch_is_refused(cluster: Cluster, change: dict[str, Any], param: str) -> None:
    uploaded = cluster.client().files.create(
        file=("in.jsonl", jsonl([chat_line("x", "hi")])), purpose="batch"
    )
    body = {"input_file_id": uploaded.id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    error = assert_openai_error(
        post(cluster, "/v1/batches", {**body, **change}), 400, ErrorCode.INVALID_REQUEST
    )
    assert error["param"] == param, error


def test_batches_are_listed_newest_first_in_pages(cluster: Cluster) -> None:
    client = cluster.client()
    made = [submit(client, [chat_line("x", "hi", max_tokens=1)]).id for _ in range(3)]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == made[::-1][:2] and page.has_more
    rest = client.batches.list(limit=2, after=page.data[-1].id)
    assert rest.data[0].id == made[0]
    assert_openai_error(get(cluster, "/v1/batches?limit=0"), 400, ErrorCode.INVALID_REQUEST)
    for batch_id in made:
        assert wait_until(client, batch_id, ENDED).status == "completed"
    error = assert_openai_error(
        post(cluster, f"/v1/batches/{made[0]}/cancel", {}), 400, ErrorCode.INVALID_REQUEST
    )
    assert "completed" in error["message"]
