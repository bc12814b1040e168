"""pagedserve's own forward for Llama-family models against transformers' modules: each architecture of the
family it takes (biases, Qwen3's head norms, a tied head, a head size that is not hidden / heads) gives
transformers' greedy output token for token and its prompt logprobs within float32 rounding; every other model
keeps the transformers forward."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from gpu_worker import LLM, SamplingParams
from gpu_worker.engine.llama_forward import LlamaForward
from gpu_worker.engine.model_runner import MAX_TOKENS_AS_DECODES
from tests.support.engine import assert_pool_drained, hf_greedy

SIZES = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
    max_position_embeddings=1024, initializer_range=0.1,
)  # fmt: skip
ARCHITECTURES = {
    "llama-tied-biases": ("llama", dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    "mistral": ("mistral", dict(sliding_window=None, head_dim=32)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=False)),
    "qwen3": ("qwen3", dict(head_dim=24, tie_word_embeddings=False)),
}
PROMPT_LENS = (1, 9, 40, 130)


def save_model(folder: Path, tokenizer_path: str, model_type: str, **options: Any) -> str:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), **SIZES, **options)
    config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def family_model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_model_path: str
) -> str:
    model_type, options = ARCHITECTURES[request.param]
    return save_model(tmp_path_factory.mktemp(request.param), tiny_model_path, model_type, **options)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in PROMPT_LENS]


def test_greedy_output_is_transformers_own(family_model: str, prompts: list[list[int]]) -> None:
    reference = hf_greedy(
        AutoModelForCausalLM.from_pretrained(family_model, dtype=torch.float32).eval(), prompts
    )
    llm = LLM(family_model, dtype="float32", num_kv_blocks=128, model_impl="pagedserve")
    assert isinstance(llm.engine.runner.model, LlamaForward)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert_pool_drained(llm)


def test_prompt_logprobs_match_the_transformers_forward(family_model: str, prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0)
    answers = {}
    for impl in ("pagedserve", "transformers"):
        llm = LLM(family_model, dtype="float32", num_kv_blocks=128, model_impl=impl)
        answers[impl] = llm.generate(prompts, params, use_tqdm=False)
    for ours, theirs in zip(answers["pagedserve"], answers["transformers"]):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert ours.prompt_logprobs is not None and theirs.prompt_logprobs is not None
        for mine, other in zip(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:]):
            assert mine is not None and other is not None and mine.keys() == other.keys()
            for token in mine:
                assert abs(mine[token] - other[token]) < 1e-4


def test_the_fused_forward_keeps_one_copy_of_each_weight(tiny_model_path: str) -> None:
    sizes = {}
    for impl in ("pagedserve", "transformers"):
        model = LLM(tiny_model_path, dtype="float32", num_kv_blocks=16, model_impl=impl).engine.runner.model
        sizes[impl] = sum(p.numel() for p in model.parameters())
    assert sizes["pagedserve"] == sizes["transformers"]


def test_a_profile_names_each_op_once_whether_python_or_the_cpp_layers_call_it(tiny_model_path: str) -> None:
    """The C++ layers' loop calls its ops without the dispatcher; a profile of a decode step still gives each
    op of each layer one event of the op's name, as that of a prefill (Python's loop over the layers) does."""
    llm = LLM(tiny_model_path, dtype="float32", num_kv_blocks=16, model_impl="pagedserve")
    engine, forward = llm.engine, llm.engine.runner.model
    assert isinstance(forward, LlamaForward) and forward.use_cpp_layers
    layers = len(forward.layers)
    # Past MAX_TOKENS_AS_DECODES prompt tokens: a prefill through Python's loop, not one-token rows
    prompt = list(range(5, 6 + MAX_TOKENS_AS_DECODES))
    engine.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    for step, cpp_layers in [("prefill", 0), ("decode", 1)]:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.step()
        counts = {event.key: event.count for event in prof.key_averages()}
        assert counts.get("pagedserve_cpu::llama_decode_layers", 0) == cpp_layers, step
        assert counts["pagedserve_cpu::rms_norm"] == 1, step  # the first layer's input norm
        for op, per_layer in [("rotary_write_kv", 1), ("add_rms_norm", 2), ("silu_and_mul", 1)]:
            assert counts[f"pagedserve_cpu::{op}"] == per_layer * layers, (step, op)
        # qkv, o, gate_up and down a layer, and the LM head
        assert counts["pagedserve_cpu::packed_linear"] == 4 * layers + 1, step
    assert counts["pagedserve_cpu::paged_attention_decode"] == layers
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_drained(llm)


def test_other_models_keep_the_transformers_forward(tmp_path: Path, tiny_model_path: str) -> None:
    # A sliding window is not something the paged forward does: auto falls back, and asking for it fails.
    path = save_model(tmp_path, tiny_model_path, "mistral", sliding_window=64)
    llm = LLM(path, dtype="float32", num_kv_blocks=64)
    assert not isinstance(llm.engine.runner.model, LlamaForward)
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="sliding-window"):
        LLM(path, dtype="float32", num_kv_blocks=64, model_impl="pagedserve")
