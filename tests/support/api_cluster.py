"""What the API test files share: a one-worker cluster per module, raw HTTP calls, OpenAI error checks and
Prometheus scrapes."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from shared.errors import ErrorCode
from tests.support.cluster import Cluster, free_port, running_cluster, service_env

NUM_KV_BLOCKS = 256


@contextlib.contextmanager
def api_cluster(
    model: str,
    redis_url: str,
    logs: Path,
    without_engine: dict[str, str],
    workers: tuple[str, ...] = ("w1",),
    **overrides: str,
) -> Iterator[Cluster]:
    """Scheduler, CPU workers (one by default) and the gateway serving model, under a prefix of their own."""
    prefix = f"pagedserve-api-{uuid.uuid4().hex[:10]}"
    # One gateway process starts faster on two cores; a file that needs two (metrics summed over processes)
    # asks for them.
    overrides = {"GATEWAY_WORKERS": "1", "NUM_KV_BLOCKS": str(NUM_KV_BLOCKS), **overrides}
    env = service_env(redis_url, prefix, model, free_port(), **overrides)
    with running_cluster(env, logs, workers, without_engine) as c:
        yield c


def cluster_fixture(
    model_fixture: str, workers: tuple[str, ...] = ("w1",), make: Any = api_cluster, **overrides: str
) -> Any:
    """A module-scoped `cluster` fixture: api_cluster (or make, which takes the same arguments) serving the
    model that fixture names, with overrides."""

    @pytest.fixture(scope="module")
    def cluster(
        request: pytest.FixtureRequest,
        redis_url: str,
        tmp_path_factory: pytest.TempPathFactory,
        without_engine: dict[str, str],
    ) -> Iterator[Cluster]:
        model = request.getfixturevalue(model_fixture)
        logs = tmp_path_factory.mktemp("logs")
        with make(model, redis_url, logs, without_engine, workers, **overrides) as c:
            yield c

    return cluster


def post(cluster: Cluster, path: str, body: Any, headers: dict[str, str] | None = None) -> requests.Response:
    return requests.post(f"{cluster.base_url}{path}", json=body, headers=headers, timeout=120)


def get(cluster: Cluster, path: str, headers: dict[str, str] | None = None) -> requests.Response:
    return requests.get(f"{cluster.base_url}{path}", headers=headers, timeout=30)


def assert_openai_error(
    response: requests.Response, status: int, code: ErrorCode | None = None
) -> dict[str, Any]:
    """response is an OpenAI-format error with this status (and code); returns its error object."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["Content-Type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert error["code"] in {c.value for c in ErrorCode}, error
    if code is not None:
        assert error["code"] == code.value, error
    return dict(error)


def extra(model: Any, name: str) -> Any:
    """A field the openai client does not declare (vLLM's extensions), as the server sent it."""
    return (model.model_extra or {}).get(name)


def scrape(cluster: Cluster) -> dict[str, float]:
    """Every sample of /metrics, summed over labels (workers, finish reasons), by sample name."""
    response = get(cluster, "/metrics")
    assert response.status_code == 200, response.text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                continue
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def poll(check: Callable[[], Any], timeout: float = 20.0, interval: float = 0.25) -> Any:
    """check() until it returns without an AssertionError (what lags a heartbeat settles); the last try's
    error otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        time.sleep(interval)
