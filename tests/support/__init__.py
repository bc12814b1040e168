"""Harnesses the tests share: real processes (cluster, api_cluster, batch_cluster), the gateway in process
with a thread playing the worker (gateway_app), and helpers of the engine's and the kernels' tests."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
