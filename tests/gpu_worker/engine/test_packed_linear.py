"""The CPU linear swap: nn.Linear's outputs up to summation order, every linear swapped, each weight once."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from gpu_worker import LLM
from gpu_worker.engine.llama_forward import LlamaForward
from gpu_worker.engine.packed_linear import PackedLinear, pack_linears, packing_supported

TINY = dict(
    vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1,
)  # fmt: skip


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_rows", [0, 1, 2, 8, 33, 300])
def test_matches_linear_in_fp32(num_rows: int, bias: bool) -> None:
    torch.manual_seed(num_rows)
    linear = nn.Linear(64, 1000, bias=bias)
    x = torch.randn(1, num_rows, 64)
    expected = linear(x)
    out = PackedLinear(linear)(x)
    assert out.shape == (1, num_rows, 1000) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not packing_supported(torch.bfloat16), reason="this CPU's oneDNN has no bf16")
def test_matches_linear_in_bf16() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(576, 1536, bias=False).to(torch.bfloat16)
    x = torch.randn(8, 576, dtype=torch.bfloat16)
    out = PackedLinear(linear)(x)
    assert out.dtype == torch.bfloat16
    # Both accumulate in fp32 and round once to bf16: at most one bf16 step apart.
    torch.testing.assert_close(out.float(), linear(x).float(), atol=0.05, rtol=2**-7)


def test_engine_packs_every_linear(tiny_model_path: str) -> None:
    forward = LLM(tiny_model_path, num_kv_blocks=64).engine.runner.model
    assert isinstance(forward, LlamaForward)
    linears = [
        module for _, module in forward.named_modules() if isinstance(module, (nn.Linear, PackedLinear))
    ]
    assert linears and all(isinstance(module, PackedLinear) for module in linears)
    # transformers' forward, where the runner keeps the model's own modules.
    model = LLM(tiny_model_path, num_kv_blocks=64, model_impl="transformers").engine.runner.model
    assert isinstance(model.get_output_embeddings(), PackedLinear)
    assert not [name for name, m in model.named_modules() if type(m) is nn.Linear]
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, PackedLinear) and isinstance(layer.mlp.down_proj, PackedLinear)


@pytest.mark.parametrize("tied", [False, True])
def test_packed_model_keeps_its_logits_and_one_copy_of_each_weight(tied: bool) -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=tied)).eval()
    ids = torch.randint(0, 100, (1, 12))
    with torch.inference_mode():
        expected = model(ids).logits
    params = sum(p.numel() for p in model.parameters())
    assert pack_linears(model) == 2 * 7 + 1
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, expected, atol=1e-5, rtol=1e-5)
    # Untied, each packed weight replaces its plain one; a tied head adds one copy beside the embeddings.
    head = 100 * 16 if tied else 0
    assert sum(p.numel() for p in model.parameters()) == params + head
    assert model.get_input_embeddings().weight.layout == torch.strided


def test_other_devices_and_dtypes_are_left_alone() -> None:
    half = LlamaForCausalLM(LlamaConfig(**TINY)).to(torch.float16)
    with torch.device("meta"):
        elsewhere = LlamaForCausalLM(LlamaConfig(**TINY))
    for model in (half, elsewhere):
        assert pack_linears(model) == 0
        assert isinstance(model.get_output_embeddings(), nn.Linear)
