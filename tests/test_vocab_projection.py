"""The CPU LM head swap: same logits as nn.Linear, same (tied) weight."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from gpu_worker import LLM
from gpu_worker.vocab_projection import VocabProjection, use_vocab_projection


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_rows", [0, 1, 2, 8, 33])
def test_matches_linear(num_rows: int, bias: bool) -> None:
    torch.manual_seed(num_rows)
    linear = nn.Linear(64, 1000, bias=bias)
    head = VocabProjection(linear)
    x = torch.randn(1, num_rows, 64)
    out = head(x)
    assert out.shape == (1, num_rows, 1000) and out.is_contiguous()
    torch.testing.assert_close(out, linear(x), atol=1e-5, rtol=1e-5)


def test_engine_installs_it(tiny_model_path: str) -> None:
    llm = LLM(tiny_model_path, num_kv_blocks=64)
    assert isinstance(llm.engine.model.get_output_embeddings(), VocabProjection)


def test_a_tied_head_keeps_sharing_the_embedding() -> None:
    config = LlamaConfig(
        vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    use_vocab_projection(model)
    head = model.get_output_embeddings()
    assert isinstance(head, VocabProjection)
    assert head.weight is model.get_input_embeddings().weight
