"""Shared fixtures: the default model (converted once), and a tiny random Llama that loads in a blink."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from gpu_worker.model_loader import resolve_model_path

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
