"""Golden tests: pagedserve's greedy output equals transformers' own generate(), token for token, in fp32."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

import kernels
from gpu_worker import LLM, SamplingParams
from gpu_worker.engine.packed_linear import own_bf16_panels
from tests.support.engine import MAX_NEW_TOKENS, QUESTIONS, assert_pool_drained, hf_greedy

TINY_PROMPT_LENS = [1, 7, 16, 17, 33, 64, 100, 250, 511]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)

ARTICLE = (
    "The river rises in the mountains, gathers snowmelt through the spring, and winds past farms, mills and "
    "old stone bridges before it reaches the sea. Towns grew where it could be crossed, and trade followed. "
)


def token_ids(outputs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# -- tiny random Llama ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in TINY_PROMPT_LENS]


@pytest.fixture(scope="module")
def tiny_reference(tiny_model_path: str, tiny_prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    return hf_greedy(model, tiny_prompts)


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"block_size": 16}, id="block16"),
        pytest.param({"block_size": 16, "model_impl": "transformers"}, id="transformers-forward"),
        pytest.param({"block_size": 8}, id="block8"),
        pytest.param({"block_size": 32, "enable_prefix_caching": False}, id="block32-no-prefix-cache"),
        pytest.param({"block_size": 16, "max_num_batched_tokens": 48}, id="chunked-prefill"),
        pytest.param({"block_size": 16, "max_num_seqs": 3}, id="max-3-seqs"),
    ],
)
def test_tiny_batch_matches_transformers(
    tiny_model_path: str,
    tiny_prompts: list[list[int]],
    tiny_reference: list[list[int]],
    options: dict[str, Any],
) -> None:
    llm = LLM(tiny_model_path, dtype="float32", num_kv_blocks=1024, **options)
    assert token_ids(llm.generate(tiny_prompts, GREEDY, use_tqdm=False)) == tiny_reference
    assert_pool_drained(llm)


def test_tiny_preemption_keeps_output(
    tiny_model_path: str, tiny_prompts: list[list[int]], tiny_reference: list[list[int]]
) -> None:
    # 40 blocks of 16 slots hold the longest request (511 + 24 tokens) but nowhere near all nine at once.
    llm = LLM(tiny_model_path, dtype="float32", num_kv_blocks=40, block_size=16)
    assert token_ids(llm.generate(tiny_prompts, GREEDY, use_tqdm=False)) == tiny_reference
    assert llm.stats.num_preemptions > 0
    assert_pool_drained(llm)


def test_tiny_prefix_cache_hits_keep_output(tiny_model_path: str) -> None:
    g = torch.Generator().manual_seed(11)
    prefix = torch.randint(3, 49152, (150,), generator=g).tolist()
    prompts = [
        prefix + torch.randint(3, 49152, (n,), generator=g).tolist() for n in (1, 5, 16, 30, 47, 2, 9, 64)
    ]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    reference = hf_greedy(model, prompts)
    # Two sequences at a time: later prompts arrive after the shared prefix's blocks are computed and cached.
    llm = LLM(tiny_model_path, dtype="float32", num_kv_blocks=512, block_size=16, max_num_seqs=2)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference
    assert llm.stats.prefix_cache_hit_rate > 0
    # The whole batch again: every full prompt block is now a hit.
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference
    assert llm.engine.allocator.num_prefix_hits >= len(prompts) * (150 // 16)
    assert_pool_drained(llm)


def test_tiny_parallel_greedy_samples_share_prompt_blocks(
    tiny_model_path: str, tiny_prompts: list[list[int]], tiny_reference: list[list[int]]
) -> None:
    # n=3 greedy: each sample must equal the reference, so the copy-on-write copies are exact.
    llm = LLM(tiny_model_path, dtype="float32", num_kv_blocks=1024, block_size=16)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    outputs = llm.generate(tiny_prompts, params, use_tqdm=False)
    for out, ref in zip(outputs, tiny_reference):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert all(c.token_ids == ref for c in out.outputs)
    # Prompts whose length is not a block multiple share a partly filled block: 2 copies each (the last
    # writer writes in place).
    partial = sum(1 for n in TINY_PROMPT_LENS if n % 16)
    assert llm.stats.num_cow_copies == 2 * partial
    assert_pool_drained(llm)


def test_tiny_seeded_samples_reproducible(tiny_model_path: str, tiny_prompts: list[list[int]]) -> None:
    llm = LLM(tiny_model_path, dtype="float32", num_kv_blocks=1024, block_size=16)
    params = SamplingParams(n=3, temperature=1.0, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    first = llm.generate(tiny_prompts[4], params, use_tqdm=False)[0]
    samples = [c.token_ids for c in first.outputs]
    assert len({tuple(s) for s in samples}) > 1, "the three samples should differ"
    assert llm.stats.num_cow_copies == 2
    # Same seed again, now sharing the batch with unseeded requests: identical samples.
    others = SamplingParams(temperature=1.0, max_tokens=16)
    again = llm.generate(tiny_prompts, [others] * 4 + [params] + [others] * 4, use_tqdm=False)[4]
    assert [c.token_ids for c in again.outputs] == samples
    # And in a fresh engine.
    fresh = LLM(tiny_model_path, dtype="float32", num_kv_blocks=64, block_size=16)
    assert [
        c.token_ids for c in fresh.generate(tiny_prompts[4], params, use_tqdm=False)[0].outputs
    ] == samples
    assert_pool_drained(llm)
    assert_pool_drained(fresh)


# -- the default model, SmolLM2-135M-Instruct ----------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_llm(smollm2_path: str) -> LLM:
    return LLM(smollm2_path, dtype="float32", num_kv_blocks=512, block_size=16)


@pytest.fixture(scope="module")
def smollm2_prompts(smollm2_llm: LLM) -> list[list[int]]:
    tokenizer = smollm2_llm.get_tokenizer()
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    conversations.append([{"role": "user", "content": "Summarize this text: " + ARTICLE * 4}])
    conversations.append([{"role": "user", "content": "What crosses the river? " + ARTICLE * 8}])
    return [
        list(
            tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)[
                "input_ids"
            ]
        )
        for c in conversations
    ]


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_path: str, smollm2_prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    return hf_greedy(model, smollm2_prompts)


@pytest.mark.slow
def test_smollm2_batch_matches_transformers(
    smollm2_llm: LLM, smollm2_prompts: list[list[int]], smollm2_reference: list[list[int]]
) -> None:
    assert len(smollm2_prompts) >= 8 and max(map(len, smollm2_prompts)) > 10 * 16
    assert token_ids(smollm2_llm.generate(smollm2_prompts, GREEDY, use_tqdm=False)) == smollm2_reference
    assert_pool_drained(smollm2_llm)
    # Again: the shared system prompt and the previous run's blocks are now prefix-cache hits.
    assert token_ids(smollm2_llm.generate(smollm2_prompts, GREEDY, use_tqdm=False)) == smollm2_reference
    assert smollm2_llm.stats.prefix_cache_hit_rate > 0
    assert_pool_drained(smollm2_llm)


@pytest.mark.slow
def test_smollm2_preemption_and_chunked_prefill(
    smollm2_path: str, smollm2_prompts: list[list[int]], smollm2_reference: list[list[int]]
) -> None:
    longest = max(map(len, smollm2_prompts)) + MAX_NEW_TOKENS
    llm = LLM(
        smollm2_path,
        dtype="float32",
        num_kv_blocks=longest // 16 + 4,
        block_size=16,
        max_num_batched_tokens=64,
    )
    assert token_ids(llm.generate(smollm2_prompts, GREEDY, use_tqdm=False)) == smollm2_reference
    assert llm.stats.num_preemptions > 0
    assert_pool_drained(llm)


@pytest.mark.slow
def test_smollm2_with_ngram_speculation_matches_transformers(
    smollm2_path: str, smollm2_prompts: list[list[int]], smollm2_reference: list[list[int]]
) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 64}
    llm = LLM(smollm2_path, dtype="float32", num_kv_blocks=512, block_size=16, speculative_config=spec)
    # Batched together, then each alone (where drafts pay most, so most are proposed).
    assert token_ids(llm.generate(smollm2_prompts, GREEDY, use_tqdm=False)) == smollm2_reference
    for prompt, reference in zip(smollm2_prompts, smollm2_reference):
        assert token_ids(llm.generate([prompt], GREEDY, use_tqdm=False)) == [reference]
    stats = llm.stats
    assert stats.spec_num_accepted_tokens > 0 and stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens
    assert_pool_drained(llm)


@pytest.mark.slow
def test_smollm2_answers_paris(smollm2_llm: LLM) -> None:
    out = smollm2_llm.chat("What is the capital of France?", SamplingParams(temperature=0, max_tokens=16))
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"


# -- bf16 against fp32 ----------------------------------------------------------------------------------

# bf16 keeps 8 bits of mantissa: logits move by a few hundredths, so where fp32's top two tokens lie closer
# than this, bf16 may pick either. A wrong kernel or a lost accumulation moves them by whole nats.
NEAR_TIE_NATS = 0.5


@pytest.fixture(params=["as-this-cpu", "widened"])
def bf16_matmuls(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """bf16 weights as this CPU multiplies them, and (where it has AVX512_BF16) as a CPU without it would: the
    panel kernel's own panels of pairs, widened to float32."""
    if request.param == "as-this-cpu":
        yield
        return
    if own_bf16_panels() or not kernels.panel_kernel_ready(torch.bfloat16):
        pytest.skip("this CPU runs bf16 as one without AVX512_BF16 already, or has no bf16 panel kernel")
    monkeypatch.setattr("gpu_worker.engine.packed_linear.cpu_has_bf16", lambda: False)
    with kernels.avx512_bf16_tiles(False):
        yield


@pytest.mark.slow
@pytest.mark.usefixtures("bf16_matmuls")
def test_smollm2_bf16_agrees_with_fp32_transformers_up_to_near_ties(
    smollm2_path: str, smollm2_prompts: list[list[int]]
) -> None:
    """Every token greedy bf16 picks is, by transformers' own fp32 logits on the same context, the top token
    or within NEAR_TIE_NATS of it; and most are the top token exactly."""
    llm = LLM(smollm2_path, dtype="bfloat16", num_kv_blocks=512, block_size=16)
    assert llm.engine.runner.kv_cache.kv_cache.dtype == torch.bfloat16
    outputs = token_ids(llm.generate(smollm2_prompts, GREEDY, use_tqdm=False))
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    exact, gaps = 0, []
    for prompt, output in zip(smollm2_prompts, outputs, strict=True):
        assert len(output) == MAX_NEW_TOKENS or output[-1] == llm.get_tokenizer().eos_token_id
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
        logprobs = logits.log_softmax(-1)
        for position, token in enumerate(output):
            gap = (logprobs[position].max() - logprobs[position, token]).item()
            exact += gap == 0
            if gap > 0:
                gaps.append((position, token, round(gap, 3), logprobs[position].topk(2).values.tolist()))
    total = sum(map(len, outputs))
    assert all(gap < NEAR_TIE_NATS for _, _, gap, _ in gaps), gaps
    assert exact >= 0.9 * total, (exact, total, gaps)
    assert_pool_drained(llm)
