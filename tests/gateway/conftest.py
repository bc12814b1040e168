"""Fixtures of the gateway's tests: the Flask app against a real Redis under the test's prefix."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from flask import Flask
from flask.testing import FlaskClient

from gateway.app import create_app
from gateway.serving.event_hub import EventHub
from gateway.settings import GatewaySettings
from shared.keys import Keys
from tests.support.gateway_app import TICK_S, add_worker


@pytest.fixture
def hub(r: redis.Redis) -> Iterator[EventHub]:
    """The process's pub/sub connection, as a gateway process has one."""
    events = EventHub(r)
    yield events
    events.stop()


@pytest.fixture
def make_app(redis_url: str, redis_prefix: str, tiny_model_path: str) -> Callable[..., Flask]:
    def make(**overrides: Any) -> Flask:
        values: dict[str, Any] = {
            "redis_url": redis_url,
            "redis_prefix": redis_prefix,
            "model": tiny_model_path,
            "sse_heartbeat_s": TICK_S,
            "request_timeout_s": 10.0,
            **overrides,
        }
        return create_app(GatewaySettings.model_validate(values))

    return make


@pytest.fixture
def client(make_app: Callable[..., Flask]) -> FlaskClient:
    return make_app().test_client()


@pytest.fixture
def worker(r: redis.Redis, keys: Keys) -> None:
    add_worker(r, keys)
