"""Fixtures of the end-to-end tests: real processes (tests/support/cluster.py), reached over real HTTP."""

from __future__ import annotations

import openai
import pytest

from tests.support.cluster import Cluster


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> openai.OpenAI:
    """The official OpenAI client of the module's cluster."""
    return cluster.client()
