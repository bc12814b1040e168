"""Fixtures every folder's tests share: a real Redis under a key prefix of the test's own, the default model
(converted once), a tiny random Llama that loads in a blink, its tokenizers, and an engine on it."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import redis
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from gateway.serving.tokenization import Tokenizer, load_tokenizer
from gpu_worker import LLM
from gpu_worker.engine.model_loader import resolve_model_path
from scheduler_svc.service import SchedulerService
from scheduler_svc.settings import SchedulerSettings
from shared.keys import Keys
from tests.support.cluster import start_redis_on_a_free_port

# Large enough weights that the random model's next-token distribution is peaked: greedy comparisons
# against transformers then never hinge on a near-tie decided by rounding.
TINY_INIT_RANGE = 0.5


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The default model as a safetensors folder (de-quantized from its GGUF file once, then cached)."""
    return resolve_model_path(None)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory, smollm2_path: str) -> str:
    """A 4-layer random Llama with GQA (8 query heads, 2 KV heads) and the default model's tokenizer."""
    path = Path(tmp_path_factory.mktemp("tiny-llama"))
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=TINY_INIT_RANGE,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Redis: REDIS_URL (default 127.0.0.1:6379) when it answers, else a redis-server started here."""
    url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    try:
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
        yield url
        return
    except redis.RedisError:
        pass
    proc, port = start_redis_on_a_free_port(tmp_path_factory.mktemp("redis"))
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# What the gateway and the scheduler must run without (their images carry none of it).
ENGINE_MODULES = ("torch", "gpu_worker", "kernels")


@pytest.fixture(scope="session")
def without_engine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment under which a Python process cannot import torch, gpu_worker or kernels, as if they were
    not installed: a sitecustomize marks them missing in sys.modules, so `import torch` raises
    ModuleNotFoundError and `importlib.util.find_spec("torch")` is None (what libraries probe). Child
    processes and exec'd interpreters inherit it through PYTHONPATH."""
    folder = tmp_path_factory.mktemp("without-engine")
    (folder / "sitecustomize.py").write_text(
        f"import sys\n\nfor _name in {ENGINE_MODULES!r}:\n    sys.modules[_name] = None\n"
    )
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p)}


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix of this test's own; every key under it is deleted afterwards (and nothing else)."""
    prefix = f"pagedserve-test-{uuid.uuid4().hex[:12]}"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    for pattern in Keys(prefix).all_patterns():
        keys = list(client.scan_iter(match=pattern, count=1000))
        if keys:
            client.delete(*keys)


@pytest.fixture
def scheduler(redis_url: str, redis_prefix: str) -> Iterator[SchedulerService]:
    """The real scheduler service under this test's prefix, running in a thread."""
    service = SchedulerService(SchedulerSettings(redis_url=redis_url, redis_prefix=redis_prefix))
    thread = threading.Thread(target=service.run, daemon=True)
    thread.start()
    yield service
    service.stop()
    thread.join(timeout=10)


@pytest.fixture
def keys(redis_prefix: str) -> Keys:
    """The key names under this test's own prefix."""
    return Keys(redis_prefix)


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    """A client of the tests' Redis whose replies are str (the services' own clients decode them too)."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def tok(tiny_model_path: str) -> Tokenizer:
    """The tiny model's tokenizer as the gateway holds it."""
    return load_tokenizer(tiny_model_path)


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_path: str) -> Any:
    """The tiny model's tokenizer as transformers loads it."""
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def offline(tiny_model_path: str) -> LLM:
    """An engine in this process on the tiny model, in fp32: the reference a service's output must equal."""
    return LLM(tiny_model_path, dtype="float32", num_kv_blocks=128, block_size=16)
