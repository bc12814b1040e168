"""The offline API and the engine around it: inputs, stop rules, aborts, stats (tiny random Llama)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

from gpu_worker import LLM, EngineConfig, SamplingParams
from gpu_worker.engine.model_loader import resolve_dtype
from gpu_worker.engine.packed_linear import cpu_has_bf16
from shared.errors import ErrorCode, RequestRejected


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
    small = LLM(tiny_model_path, dtype="float32", num_kv_blocks=8, block_size=16)
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
    llm = LLM(tiny_model_path, dtype="float32", kv_cache_memory_bytes=80 * 16384 + 100, block_size=16)
    assert llm.stats.num_total_blocks == 80
    assert llm.engine.runner.kv_cache.kv_cache.dtype == torch.float32
    with pytest.raises(ValueError, match="dtype"):
        LLM(tiny_model_path, dtype="int8", num_kv_blocks=8)


def cpu_flags() -> set[str]:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo to read the CPU's flags from")
    lines = cpuinfo.read_text().splitlines()
    return {flag for line in lines if line.startswith("flags") for flag in line.split()}


def test_auto_dtype_is_bf16_exactly_on_cpus_with_bf16_instructions(tiny_model_path: str) -> None:
    native = bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})
    assert cpu_has_bf16() == native
    expected = torch.bfloat16 if native else torch.float32
    assert resolve_dtype("auto", torch.device("cpu")) == resolve_dtype(None, torch.device("cpu")) == expected
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    llm = LLM(tiny_model_path, num_kv_blocks=8)
    assert llm.engine.runner.kv_cache.kv_cache.dtype == expected
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_chat_applies_the_template(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    chat = llm.chat("hello", params, use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert chat.prompt_token_ids == list(expected)


# -- logit_bias, allowed_token_ids, prefix-cache and step counters ---------------------------------------


def test_logit_bias_and_allowed_token_ids_steer_every_token(llm: LLM) -> None:
    prompt = [41, 42, 43, 44]
    free = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False
    )
    free_run = free[0].outputs[0].token_ids
    target = next(t for t in range(100, 200) if t not in free_run)
    biased = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={target: 100.0}),
        use_tqdm=False,
    )[0].outputs[0]
    assert biased.token_ids == [target] * 6
    avoided = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logit_bias={free_run[0]: -100.0}),
        use_tqdm=False,
    )[0].outputs[0]
    assert avoided.token_ids[0] != free_run[0]
    allowed = [target, target + 1, target + 2]
    for params in (
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed),
        SamplingParams(
            n=3, temperature=1.5, seed=1, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed
        ),
    ):
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert len(out.outputs) == params.n
        assert all(set(o.token_ids) <= set(allowed) and len(o.token_ids) == 6 for o in out.outputs)


def test_allowed_token_ids_with_min_tokens_end_at_eos_only_after_min_tokens(llm: LLM) -> None:
    (eos,) = llm.engine.sampler.eos_token_ids
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=3, allowed_token_ids=[eos, 300])
    out = llm.generate([[61, 62, 63]], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:3] == [300, 300, 300]
    assert set(out.token_ids) <= {eos, 300}
    # With EOS biased up it comes as soon as min_tokens allows, and ends the sample.
    params = SamplingParams(
        temperature=0, max_tokens=8, min_tokens=3, allowed_token_ids=[eos, 300], logit_bias={eos: 100.0}
    )
    out = llm.generate([[61, 62, 63]], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [300, 300, 300, eos] and out.finish_reason == "stop"


def test_token_ids_outside_the_vocabulary_are_refused_with_a_code(llm: LLM) -> None:
    (eos,) = llm.engine.sampler.eos_token_ids
    vocab = llm.engine.vocab_size
    for params, message in (
        (SamplingParams(logit_bias={vocab: 1.0}), "logit_bias"),
        (SamplingParams(logit_bias={-1: 1.0}), "logit_bias"),
        (SamplingParams(allowed_token_ids=[5, vocab + 10]), "allowed_token_ids"),
        (SamplingParams(min_tokens=2, allowed_token_ids=[eos]), "min_tokens"),
        (
            SamplingParams(min_tokens=2, allowed_token_ids=[7], stop_token_ids=[7], ignore_eos=True),
            "min_tokens",
        ),
    ):
        with pytest.raises(RequestRejected, match=message) as info:
            llm.engine.add_request("bad", [1, 2, 3], params)
        assert info.value.code is ErrorCode.INVALID_REQUEST
    assert not llm.engine.has_unfinished_requests()
    llm.engine.add_request("ok", [1, 2, 3], SamplingParams(logit_bias={vocab - 1: 1.0}, max_tokens=1))
    llm.engine.abort_request("ok")


def test_num_cached_tokens_and_prefix_cache_counters(llm: LLM) -> None:
    prompt = list(range(1000, 1050))  # 50 tokens: 3 full blocks can be hit (the last token is computed)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    before = llm.stats
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    second = llm.generate([prompt], params, use_tqdm=False)[0]
    third = llm.generate([prompt[:40] + [7] * 10], params, use_tqdm=False)[0]
    after = llm.stats
    assert (first.num_cached_tokens, second.num_cached_tokens, third.num_cached_tokens) == (0, 48, 32)
    assert after.prefix_cache_queries - before.prefix_cache_queries == 3 * 50
    assert after.prefix_cache_hits - before.prefix_cache_hits == 48 + 32
    assert first.outputs[0].token_ids == second.outputs[0].token_ids


def test_iteration_tokens_count_prompt_and_sampled_tokens_per_step(llm: LLM) -> None:
    engine = llm.engine
    before = (engine.iteration_tokens.cumulative(), engine.iteration_tokens.total)
    engine.add_request(
        "it", list(range(2000, 2020)), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    )
    while engine.has_unfinished_requests():
        engine.step()
    (seq,) = engine.release("it")
    buckets, total = engine.iteration_tokens.cumulative(), engine.iteration_tokens.total
    assert total - before[1] == 20 + 5
    deltas = [a - b for a, b in zip(buckets, before[0])]
    assert deltas[-1] == 5  # one observation per step: a prefill step of 21 tokens, then four of one
    assert deltas[:4] == [4, 4, 4, 5]  # at or below 1, 8, 16, 32
    assert all(x <= y for x, y in itertools.pairwise(buckets))
    assert seq.first_scheduled_time is not None and seq.first_token_time is not None
    assert seq.last_token_time is not None
    assert seq.arrival_time <= seq.first_scheduled_time <= seq.first_token_time < seq.last_token_time
    assert seq.num_cached_tokens == 0
