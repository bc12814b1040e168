"""A bounded fuzz run over the gateway's own OpenAPI document (schemathesis): no input gets a 5xx.

Schemathesis generates requests for every operation in `/openapi.json`, fitting the schema and breaking it,
and sends them to the app (WSGI, in this process) over a real Redis. A live worker's heartbeat and a
responder that answers every queued request with one token per sample stand in for the workers, so that a
valid request ends in a 200, not in a timeout: what is fuzzed is the gateway's handling of input.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation.modes import GenerationMode

from gateway.app import create_app
from gateway.settings import GatewaySettings
from shared.keys import Keys
from shared.protocol import GenerateRequest, Heartbeat, TokenEvent
from shared.records import push_event
from shared.redis_client import connect
from shared.settings import DEFAULT_MODEL_NAME
from shared.streams import read_request

EXAMPLES = 500  # per mode, over all operations


class Responder(threading.Thread):
    """Answers every request on the requests stream: one token per sample, then "length"."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        super().__init__(daemon=True)
        self.client, self.keys = client, keys
        self.stopped = threading.Event()

    def run(self) -> None:
        last = "0"
        while not self.stopped.is_set():
            reply: Any = self.client.xread({self.keys.requests: last}, block=100)
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    last = entry_id
                    self.answer(read_request(fields))

    def answer(self, request: GenerateRequest) -> None:
        pipe = self.client.pipeline(transaction=False)
        for index in request.sample_indices():
            event = TokenEvent(
                request_id=request.request_id,
                index=index,
                start=0,
                token_ids=[request.prompt_token_ids[0]],
                finish_reason="length",
                num_prompt_tokens=len(request.prompt_token_ids),
                worker_id="fuzz",
            )
            push_event(pipe, self.keys, event, ttl_s=60)
        pipe.execute()


@pytest.fixture
def api_schema(redis_url: str, keys: Keys, tiny_model_path: str, tmp_path: Path) -> Iterator[Any]:
    client = connect(redis_url)
    now = time.time()
    beat = Heartbeat(
        worker_id="w0", model=DEFAULT_MODEL_NAME, free_blocks=100, total_blocks=100, block_size=16,
        num_running=0, num_waiting=0, last_step_time=now, started_at=now, max_model_len=2048,
    )  # fmt: skip
    client.hset(keys.worker("w0"), mapping=beat.to_hash())  # type: ignore[arg-type]
    client.sadd(keys.workers, "w0")
    responder = Responder(client, keys)
    responder.start()
    settings_ = GatewaySettings.model_validate(
        {
            "redis_url": redis_url,
            "redis_prefix": keys.prefix,
            "model": tiny_model_path,
            "request_timeout_s": 10.0,
            "sse_heartbeat_s": 0.2,
            "resume_grace_s": 0.2,
            "batch_storage_dir": str(tmp_path / "files"),
        }
    )
    yield schemathesis.openapi.from_wsgi("/openapi.json", create_app(settings_))
    responder.stopped.set()
    responder.join()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_input_gets_a_server_error(api_schema: Any, mode: GenerationMode) -> None:
    """Inputs that fit the schema (mode positive) and inputs that break it (negative), for every operation."""
    statuses: Counter[int] = Counter()

    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=api_schema.as_strategy(mode))
    def send(case: Any) -> None:
        response = case.call()
        statuses[response.status_code] += 1
        assert response.status_code < 500, (case.method, case.formatted_path, case.body, response.text[:500])

    send()
    print(f"{mode}: {sum(statuses.values())} requests, by status {dict(sorted(statuses.items()))}")
    assert sum(statuses.values()) >= EXAMPLES
