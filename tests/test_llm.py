"""The offline API and the engine around it: inputs, stop rules, aborts, stats (tiny random Llama)."""

from __future__ import annotations

import math

import pytest
import torch

from gpu_worker import LLM, EngineConfig, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_path: str) -> LLM:
    return LLM(tiny_model_path, num_kv_blocks=256, block_size=16)


@pytest.fixture(autouse=True)
def pool_drains(request: pytest.FixtureRequest) -> None:
    yield
    if "llm" in request.fixturenames:
        engine = request.getfixturevalue("llm").engine
        assert not engine.requests
        assert engine.allocator.num_free_blocks == engine.allocator.num_blocks
        engine.allocator.check_invariants()


def test_string_and_token_prompts_agree(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    text = "The quick brown fox"
    ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
    by_text, by_ids = llm.generate([text, ids], params, use_tqdm=False)
    assert by_text.prompt_token_ids == ids
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.outputs[0].text == llm.get_tokenizer().decode(by_ids.outputs[0].token_ids)
    assert llm.generate(text, params, use_tqdm=False)[0].outputs[0].token_ids == by_ids.outputs[0].token_ids


def test_max_tokens_gives_length(llm: LLM) -> None:
    out = llm.generate(
        [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 5
    assert out[0].outputs[0].finish_reason == "length"


def test_stop_token_ids_stop_and_min_tokens_defers_them(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    free_run = llm.generate([[9, 10, 11]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    stop_at = free_run[3]
    first = free_run.index(stop_at)
    stopped = llm.generate(
        [[9, 10, 11]],
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=[stop_at]),
        use_tqdm=False,
    )[0].outputs[0]
    assert stopped.token_ids == free_run[: first + 1]
    assert stopped.finish_reason == "stop"
    deferred = llm.generate(
        [[9, 10, 11]],
        SamplingParams(
            temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=[stop_at], min_tokens=first + 2
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(deferred.token_ids) > first + 1
    assert stop_at not in deferred.token_ids[: first + 2]


def test_logprobs_are_reported(llm: LLM) -> None:
    out = llm.generate(
        [[1, 2, 3, 4]],
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry
        # greedy: the chosen token is the most likely one
        assert entry[token] == pytest.approx(max(entry.values()))
        assert all(v <= 0 for v in entry.values())
    assert out.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(out.token_ids, out.logprobs)))
    assert math.isfinite(out.cumulative_logprob)


def test_per_prompt_params(llm: LLM) -> None:
    outs = llm.generate(
        [[3, 4], [3, 4]],
        [
            SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        ],
        use_tqdm=False,
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 6]
    assert outs[1].outputs[0].token_ids[:2] == outs[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate([[3], [4]], [SamplingParams()], use_tqdm=False)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "empty"),
        ([10**9], SamplingParams(), r"\[0, "),
        ([-1], SamplingParams(), r"\[0, "),
        ([1] * 2048, SamplingParams(), "context"),
    ],
)
def test_bad_requests_are_refused_and_leave_nothing_behind(
    llm: LLM, prompt: list[int], params: SamplingParams, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate([[1, 2, 3], prompt], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_request_larger_than_the_pool_is_refused(tiny_model_path: str) -> None:
    small = LLM(tiny_model_path, num_kv_blocks=8, block_size=16)
    with pytest.raises(ValueError, match="KV pool"):
        small.generate([[1] * 100], SamplingParams(max_tokens=100), use_tqdm=False)
    # 8 blocks hold 128 tokens: this one fits exactly.
    out = small.generate([[1] * 100], SamplingParams(max_tokens=28, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 28


def test_abort_returns_blocks_at_once(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("a", list(range(5, 60)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.add_request(
        "b", list(range(5, 40)), SamplingParams(n=2, temperature=1.0, max_tokens=50, ignore_eos=True)
    )
    for _ in range(3):
        engine.step()
    stats = llm.stats
    assert stats.num_running == 3 and stats.num_free_blocks < stats.num_total_blocks
    assert 0 < stats.slot_utilization <= 1
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [1], SamplingParams())
    engine.abort_request("a")
    engine.abort_request("b")
    engine.abort_request("never-existed")
    assert not engine.has_unfinished_requests()


def test_engine_config_validation() -> None:
    for bad in (
        {"block_size": 12},
        {"num_kv_blocks": 0},
        {"max_num_seqs": 0},
        {"gpu_memory_utilization": 1.5},
    ):
        with pytest.raises(ValueError):
            EngineConfig(**bad)  # type: ignore[arg-type]


def test_kv_pool_sized_from_memory_budget(tiny_model_path: str) -> None:
    # 4 layers x (K, V) x 16 slots x 2 KV heads x 16 dims x 4 bytes = 16 KiB per block
    llm = LLM(tiny_model_path, kv_cache_memory_bytes=80 * 16384 + 100, block_size=16)
    assert llm.stats.num_total_blocks == 80
    assert llm.engine.kv_cache.kv_cache.dtype == torch.float32
    with pytest.raises(ValueError, match="dtype"):
        LLM(tiny_model_path, dtype="int8", num_kv_blocks=8)


def test_chat_applies_the_template(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    chat = llm.chat("hello", params, use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert chat.prompt_token_ids == list(expected)
