"""Prompt logprobs from the engine against a plain transformers forward in fp32 (tiny random Llama)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from gpu_worker import LLM, SamplingParams

PROMPT = [(7 * i + 3) % 4000 + 20 for i in range(75)]  # 75 tokens: 4 full blocks of 16 and a partial one
K = 3
# fp32 rounding of a logprob over this model's 49152-token vocabulary: transformers' own fp32 forward is up to
# 5.5e-4 from an fp64 one at these positions, and the engine's (chunked prefill, the CPU kernel's sums) up to
# 3.5e-4; the two fp32 results differ by up to 2.1e-4 where chunks go through the AVX2 passes.
FP32_LOGPROB = 3e-4


@pytest.fixture(scope="module")
def llm(tiny_model_path: str) -> LLM:
    # A budget of 24 tokens splits the prompt into chunks that do not line up with blocks.
    return LLM(
        tiny_model_path,
        dtype="float32",
        device="cpu",
        num_kv_blocks=64,
        block_size=16,
        max_num_batched_tokens=24,
    )


@pytest.fixture(scope="module")
def reference(tiny_model_path: str) -> torch.Tensor:
    """log_softmax of a plain forward over PROMPT in fp32: row j is the distribution of token j + 1."""
    model: Any = AutoModelForCausalLM.from_pretrained(tiny_model_path, torch_dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_matches(prompt_logprobs: list[dict[int, float] | None] | None, reference: torch.Tensor) -> None:
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(PROMPT)
    assert prompt_logprobs[0] is None
    for i in range(1, len(PROMPT)):
        entry = prompt_logprobs[i]
        assert entry is not None
        expected = reference[i - 1]
        top_ids = expected.topk(K).indices.tolist()
        assert set(entry) == {PROMPT[i], *top_ids}, i
        for token, lp in entry.items():
            assert lp == pytest.approx(float(expected[token]), rel=1e-4, abs=FP32_LOGPROB), (i, token)


def greedy(prompt_logprobs: int | None, **kwargs: Any) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=prompt_logprobs, **kwargs
    )


def test_prompt_logprobs_match_transformers_across_chunks(llm: LLM, reference: torch.Tensor) -> None:
    steps_before = llm.engine.iteration_tokens.cumulative()[-1]
    out = llm.generate([PROMPT], greedy(K), use_tqdm=False)[0]
    assert llm.engine.iteration_tokens.cumulative()[-1] - steps_before > 4  # the prompt did take chunks
    assert_matches(out.prompt_logprobs, reference)
    # The tokens themselves are those of a request that asked for no prompt logprobs.
    plain = llm.generate([PROMPT], greedy(None), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert plain.prompt_logprobs is None


def test_a_cached_prefix_is_not_taken_by_a_request_for_prompt_logprobs(
    llm: LLM, reference: torch.Tensor
) -> None:
    warm = llm.generate([PROMPT], greedy(None), use_tqdm=False)[0]
    again = llm.generate([PROMPT], greedy(None), use_tqdm=False)[0]
    assert again.num_cached_tokens == 64 and warm.outputs[0].token_ids == again.outputs[0].token_ids
    out = llm.generate([PROMPT], greedy(K), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert_matches(out.prompt_logprobs, reference)


def test_zero_gives_each_tokens_own_logprob_only(llm: LLM, reference: torch.Tensor) -> None:
    out = llm.generate([PROMPT], greedy(0), use_tqdm=False)[0]
    assert out.prompt_logprobs is not None
    for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry is not None and list(entry) == [PROMPT[i]]
        assert entry[PROMPT[i]] == pytest.approx(float(reference[i - 1, PROMPT[i]]), rel=1e-4, abs=1e-4)


def test_a_one_token_prompt_has_one_none(llm: LLM) -> None:
    out = llm.generate([[PROMPT[0]]], greedy(K), use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]


def test_parallel_samples_share_the_prompt_logprobs(llm: LLM, reference: torch.Tensor) -> None:
    engine = llm.engine
    params = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=4, ignore_eos=True, prompt_logprobs=K)
    engine.add_request("n3", PROMPT, params)
    while engine.has_unfinished_requests():
        engine.step()
    seqs = engine.release("n3")
    assert len(seqs) == 3
    for seq in seqs:
        assert len(seq.prompt_logprobs) == len(PROMPT) - 1
        assert seq.prompt_logprobs == seqs[0].prompt_logprobs
        assert seq.prompt_top_logprobs == seqs[0].prompt_top_logprobs
    expected = [float(reference[i - 1, PROMPT[i]]) for i in range(1, len(PROMPT))]
    assert seqs[0].prompt_logprobs == pytest.approx(expected, rel=1e-4, abs=1e-4)


def test_a_sequence_preempted_mid_prompt_computes_each_position_once(
    llm: LLM, reference: torch.Tensor
) -> None:
    engine = llm.engine
    engine.add_request("pre", PROMPT, greedy(K))
    engine.step()
    engine.step()
    (seq,) = engine.requests["pre"]
    assert 0 < seq.num_computed_tokens < len(PROMPT) and seq.prompt_logprobs
    engine.step_scheduler._preempt(seq)  # back to waiting, its KV cache gone: recomputed from the start
    while engine.has_unfinished_requests():
        engine.step()
    (seq,) = engine.release("pre")
    expected = [float(reference[i - 1, PROMPT[i]]) for i in range(1, len(PROMPT))]
    assert seq.prompt_logprobs == pytest.approx(expected, rel=1e-4, abs=1e-4)
    assert len(seq.prompt_top_logprobs) == len(PROMPT) - 1
