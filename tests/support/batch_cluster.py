"""What the Batch API test files share: a cluster with batch workers, and a batch's whole round trip."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai

from shared.protocol import GenerateRequest, RequestMeta, decode
from tests.support.api_cluster import api_cluster, cluster_fixture
from tests.support.cluster import MODEL_NAME, Cluster

# Short enough that a killed batch worker's task comes back within the tests' patience; a slice short enough
# that a batch of the tests crosses several (each hands its lines in flight to the next).
BATCH_ENV = {
    "BATCH_VISIBILITY_TIMEOUT_S": "12",
    "BATCH_SLICE_S": "3",
    "BATCH_LINES_IN_FLIGHT": "8",
    "BATCH_PRIORITY": "100",
}


@contextlib.contextmanager
def batch_cluster(
    model: str,
    redis_url: str,
    logs: Path,
    without_engine: dict[str, str],
    workers: tuple[str, ...] = ("w1",),
    **overrides: str,
) -> Iterator[Cluster]:
    """api_cluster with one batch worker ("batch"), sharing a storage folder with the gateway."""
    env = {**BATCH_ENV, "BATCH_STORAGE_DIR": str(logs / "files"), **overrides}
    with api_cluster(model, redis_url, logs, without_engine, workers, **env) as c:
        start_batch_worker(c, "batch", without_engine)
        yield c


def start_batch_worker(c: Cluster, name: str, without_engine: dict[str, str]) -> None:
    c.start(name, "gateway.batch", **without_engine)


def batch_fixture(model_fixture: str, **overrides: str) -> Any:
    """A module-scoped `cluster` fixture: batch_cluster serving the model that fixture names."""
    return cluster_fixture(model_fixture, make=batch_cluster, **overrides)


def chat_line(custom_id: str, content: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": content}],
            "temperature": 0,
            "max_tokens": 8,
            **body,
        },
    }


def jsonl(lines: list[Any]) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


def submit(
    client: openai.OpenAI, lines: list[Any], endpoint: str = "/v1/chat/completions", **options: Any
) -> Any:
    uploaded = client.files.create(file=("requests.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(
        input_file_id=uploaded.id,
        endpoint=endpoint,  # type: ignore[arg-type]
        completion_window=options.pop("completion_window", "24h"),  # type: ignore[arg-type]
        **options,
    )


def wait_until(client: openai.OpenAI, batch_id: str, statuses: set[str], timeout: float = 240) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.25)


def results(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def queued_batch_requests(c: Cluster, priority: int) -> list[GenerateRequest]:
    """Every request queued at the batch priority so far: each queued request leaves its record (the meta
    that a resumed stream reads) for REQUEST_TTL_S."""
    found = []
    for key in c.redis.scan_iter(match=c.keys.request_meta("*"), count=1000):
        data = c.redis.get(key)
        if data is not None:
            found.append(decode(RequestMeta, data).request)
    return [r for r in found if r.priority == priority]
