"""Fixtures of the engine's tests: an engine on the tiny model, whose pool must be whole after every test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpu_worker import LLM
from tests.support.engine import assert_pool_drained


@pytest.fixture(scope="module")
def llm(tiny_model_path: str) -> LLM:
    return LLM(tiny_model_path, dtype="float32", num_kv_blocks=256, block_size=16)


@pytest.fixture(autouse=True)
def pool_drains(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test that used the engine: no request left, every block free, the allocator consistent."""
    yield
    if "llm" in request.fixturenames:
        llm = request.getfixturevalue("llm")
        assert not llm.engine.requests
        assert_pool_drained(llm)
