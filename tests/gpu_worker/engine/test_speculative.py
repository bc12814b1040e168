"""Speculative decoding in the engine: the n-gram proposer, the pause that stops drafts that do not pay, and
verification on the tiny model.

A random tiny model never repeats its prompt, so n-gram lookup would propose nothing it accepts. The
verification tests therefore draft from an oracle: the tokens a run without speculation produced, with some
of them replaced (so drafts are accepted, rejected at every position, and cut short by the budget). The
output must be what the run without speculation gave, token for token, whatever the drafts were."""

from __future__ import annotations

import collections
import math
from typing import Any

import pytest
import torch

from gpu_worker import LLM, SamplingParams
from gpu_worker.engine.speculative import (
    NgramIndex,
    NgramSpeculator,
    SpecState,
    SpeculativeConfig,
)
from shared.prefix import block_hashes
from shared.sampling import StructuredSpec
from tests.support.engine import assert_pool_drained

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 64}
PROMPT_LENS = [1, 7, 16, 17, 33, 64, 100]


# -- the n-gram proposer -------------------------------------------------------------------------------


def test_the_longest_suffix_n_gram_proposes_what_followed_its_latest_occurrence() -> None:
    index = NgramIndex(2, 3)
    #           0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 2, 3]
    # The suffix 3-gram (3, ...) is absent; the 2-gram (2, 3) last occurred ending at 7, then 7 and 8 came.
    assert index.propose(tokens, 2) == [7, 8]
    assert index.propose([*tokens, 7], 4) == [8, 2, 3, 7]  # the 3-gram (2, 3, 7) now, as the list grew
    assert NgramIndex(2, 3).propose([1, 2, 3, 4], 4) == []  # no earlier occurrence
    assert NgramIndex(2, 3).propose([5, 6, 5], 4) == []  # a 1-gram match is below prompt_lookup_min
    assert NgramIndex(1, 3).propose([5, 6, 5], 4) == [6, 5]  # ... and is enough with prompt_lookup_min 1


def test_an_index_kept_up_to_date_proposes_what_a_fresh_one_does() -> None:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 6, (300,), generator=g).tolist()
    kept = NgramIndex(2, 5)
    for end in range(1, len(tokens) + 1, 7):
        assert kept.propose(tokens[:end], 5) == NgramIndex(2, 5).propose(tokens[:end], 5)


def test_drafts_stop_when_they_fail_and_come_back_when_the_text_repeats() -> None:
    """Verifies that fail bring the acceptance down until drafting stops; shadow trials (the draft it would
    have made, against the token that came) bring it back once the proposals start coming true."""
    speculator = NgramSpeculator(SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    tokens = [1, 2, 3, 1, 2]
    state, drafts = speculator.propose(None, tokens, 8)
    assert drafts == [3, 1, 2]
    failures = 0
    while drafts:
        speculator.observe(state, len(drafts), 0)
        failures += 1
        tokens = [*tokens, 9, 1, 2]  # never what was proposed (3), and the suffix (1, 2) again
        state, drafts = speculator.propose(state, tokens, 8)
    # Not drafting now; its shadow is what followed (1, 2) last time: 9.
    assert failures <= 3 and state.shadow == 9 and state.shadow_at == len(tokens)
    quiet = state.acceptance
    cycle = [9, 1, 2]
    tokens.append(9)  # the shadow comes true, and so does every proposal of the cycle after it
    state, drafts = speculator.propose(state, tokens, 8)
    assert state.acceptance > quiet
    steps = 1
    while not drafts:
        tokens.append(cycle[(cycle.index(tokens[-1]) + 1) % 3])
        state, drafts = speculator.propose(state, tokens, 8)
        steps += 1
    assert steps <= 4, "a sequence repeating itself should draft again within a few steps"
    assert speculator.stats.num_drafts == failures  # shadow trials are not verifies


def test_the_config_is_checked() -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=5, prompt_lookup_max=3)
    with pytest.raises(ValueError):
        SpeculativeConfig.model_validate({"method": "eagle", "num_speculative_tokens": 2})


# -- verification, with drafts from an oracle ------------------------------------------------------------


class Oracle:
    """Drafts the reference continuation of each prompt, every `wrong_every`-th drafted position replaced."""

    def __init__(self, prompts: list[list[int]], reference: list[list[int]], wrong_every: int = 5) -> None:
        self.continuations = {tuple(p): p + r for p, r in zip(prompts, reference)}
        self.wrong_every = wrong_every
        self.calls = 0

    def propose(
        self, state: SpecState | None, token_ids: list[int], limit: int
    ) -> tuple[SpecState, list[int]]:
        state = state or SpecState(NgramIndex(1, 1))
        self.calls += 1
        full = next((c for p, c in self.continuations.items() if list(p) == token_ids[: len(p)]), None)
        if full is None or full[: len(token_ids)] != token_ids:
            return state, []  # off the reference (a sampled run): draft from the start of the prompt
        drafts = full[len(token_ids) : len(token_ids) + min(limit, 1 + self.calls % 4)]
        return state, [
            (t + 1) % 1000 if (len(token_ids) + j) % self.wrong_every == 0 else t
            for j, t in enumerate(drafts)
        ]


def with_oracle(llm: LLM, oracle: Oracle) -> None:
    speculator = llm.engine.step_scheduler.speculator
    assert speculator is not None
    speculator.propose = oracle.propose  # type: ignore[method-assign]


def outputs(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Any]:
    return [list(c.token_ids) for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]


def assert_cache_holds_only_real_tokens(llm: LLM, sequences: list[list[int]]) -> None:
    """Every block in the prefix cache is a block of some sequence's real tokens (never a rejected draft)."""
    allocator = llm.engine.allocator
    real: set[int] = set()
    for tokens in sequences:
        real |= set(block_hashes(tokens, allocator.block_size, 0, len(tokens) // allocator.block_size, None))
    cached = set(allocator.cached_hashes())
    assert cached and cached <= real, f"{len(cached - real)} cached blocks hold tokens no sequence has"


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in PROMPT_LENS]


GREEDY = SamplingParams(temperature=0.0, max_tokens=40)


@pytest.fixture(scope="module")
def reference(tiny_model_path: str, prompts: list[list[int]]) -> list[list[int]]:
    return outputs(LLM(tiny_model_path, dtype="float32", num_kv_blocks=512), prompts, GREEDY)


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"block_size": 16}, id="block16"),
        pytest.param({"block_size": 8}, id="block8"),
        pytest.param({"block_size": 16, "max_num_batched_tokens": 40}, id="small-budget"),
        pytest.param({"block_size": 16, "num_kv_blocks": 14}, id="preempting"),
    ],
)
def test_greedy_output_is_the_same_with_drafts_accepted_and_rejected(
    tiny_model_path: str, prompts: list[list[int]], reference: list[list[int]], options: dict[str, Any]
) -> None:
    llm = LLM(tiny_model_path, dtype="float32", **{"num_kv_blocks": 512, **options}, speculative_config=NGRAM)
    with_oracle(llm, oracle := Oracle(prompts, reference))
    assert outputs(llm, prompts, GREEDY) == reference
    stats = llm.engine.step_scheduler.speculator.stats  # type: ignore[union-attr]
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert stats.accepted_per_position[0] > stats.accepted_per_position[2] > 0
    assert oracle.calls > 0
    assert_cache_holds_only_real_tokens(llm, [p + r for p, r in zip(prompts, reference)])
    assert_pool_drained(llm)
    if options.get("num_kv_blocks"):
        assert llm.stats.num_preemptions > 0


def test_a_step_carries_several_tokens_and_the_steps_are_fewer(
    tiny_model_path: str, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    llm = LLM(tiny_model_path, dtype="float32", num_kv_blocks=512, speculative_config=NGRAM)
    with_oracle(llm, Oracle(prompts[:1], reference[:1], wrong_every=10**9))  # every draft right
    engine = llm.engine
    engine.add_request("r", prompts[0], GREEDY)
    steps: list[int] = []
    while engine.has_unfinished_requests():
        steps += [seq.num_step_tokens for seq in engine.step()]
    assert sum(steps) == len(reference[0]) and max(steps) == 5  # 4 drafts accepted and the token after
    assert len(steps) < len(reference[0]) / 2
    assert engine.release("r")[0].output_token_ids == reference[0]


def test_parallel_samples_fork_then_draft_on_their_own_blocks(
    tiny_model_path: str, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    llm = LLM(tiny_model_path, dtype="float32", num_kv_blocks=512, speculative_config=NGRAM)
    with_oracle(llm, Oracle(prompts, reference))
    params = SamplingParams(n=3, temperature=0.0, max_tokens=40)
    got = outputs(llm, prompts, params)
    assert got == [r for r in reference for _ in range(3)]
    assert llm.stats.num_cow_copies > 0
    assert_cache_holds_only_real_tokens(llm, [p + r for p, r in zip(prompts, reference)])
    assert_pool_drained(llm)


def test_seeded_sampling_gives_the_same_tokens_with_drafts(
    tiny_model_path: str, prompts: list[list[int]]
) -> None:
    params = SamplingParams(temperature=0.8, top_k=3, seed=42, max_tokens=40, ignore_eos=True)
    plain = LLM(tiny_model_path, dtype="float32", num_kv_blocks=512)
    expected = outputs(plain, prompts, params)
    llm = LLM(tiny_model_path, dtype="float32", num_kv_blocks=512, speculative_config=NGRAM)
    with_oracle(llm, Oracle(prompts, expected))
    assert outputs(llm, prompts, params) == expected
    assert llm.engine.step_scheduler.speculator.stats.num_accepted_tokens > 0  # type: ignore[union-attr]
    assert_pool_drained(llm)


def test_logprobs_stop_tokens_and_penalties_are_those_of_the_plain_run(
    tiny_model_path: str, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    stop = reference[3][20]  # a token the greedy run emits: it must stop there, drafted or not
    params = SamplingParams(
        temperature=0.0, max_tokens=40, logprobs=2, stop_token_ids=[stop], repetition_penalty=1.3
    )
    plain = LLM(tiny_model_path, dtype="float32", num_kv_blocks=512)
    expected = plain.generate(prompts, params, use_tqdm=False)
    llm = LLM(tiny_model_path, dtype="float32", num_kv_blocks=512, speculative_config=NGRAM)
    with_oracle(llm, Oracle(prompts, [o.outputs[0].token_ids for o in expected]))
    got = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(got, expected):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
        got_lp, expected_lp = a.outputs[0].logprobs or [], b.outputs[0].logprobs or []
        assert [d.keys() for d in got_lp] == [d.keys() for d in expected_lp]
        for x, y in zip(got_lp, expected_lp):
            assert list(x.values()) == pytest.approx(list(y.values()), abs=1e-3)  # other batch shapes
    assert any(o.outputs[0].finish_reason == "stop" for o in got)
    assert_pool_drained(llm)


def test_a_grammar_refuses_drafts_it_does_not_allow(tiny_model_path: str, prompts: list[list[int]]) -> None:
    words = StructuredSpec(kind="regex", value=r"[a-z]{1,6}( [a-z]{1,6}){6,10}\.")
    params = SamplingParams(temperature=0.0, max_tokens=60, structured=words)
    plain = LLM(tiny_model_path, dtype="float32", num_kv_blocks=512)
    expected = outputs(plain, prompts[:3], params)
    llm = LLM(tiny_model_path, dtype="float32", num_kv_blocks=512, speculative_config=NGRAM)
    with_oracle(llm, Oracle(prompts[:3], expected))
    assert outputs(llm, prompts[:3], params) == expected
    assert_pool_drained(llm)


def test_sampled_tokens_follow_the_distribution_without_drafts(tiny_model_path: str) -> None:
    """Unseeded sampling, 500 requests each way, the second token always drafted (as the likeliest one): the
    drafted token and the one after it (sampled at the draft's position when it was accepted) have the
    distribution they have without speculation (a chi-squared test of the two histograms)."""
    prompt = [17, 4242, 99, 1234, 5]
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True)
    n = 500
    plain = LLM(tiny_model_path, dtype="float32", num_kv_blocks=512, seed=1)
    without = outputs(plain, [prompt] * n, params)
    spec = {**NGRAM, "disable_by_batch_size": 1024}
    llm = LLM(tiny_model_path, dtype="float32", num_kv_blocks=512, seed=2, speculative_config=spec)
    draft = collections.Counter(t[1] for t in without).most_common()[0][0]

    def propose(state: SpecState | None, token_ids: list[int], limit: int) -> tuple[SpecState, list[int]]:
        return state or SpecState(NgramIndex(1, 1)), [draft, draft][:limit]

    llm.engine.step_scheduler.speculator.propose = propose  # type: ignore[union-attr,method-assign]
    with_drafts = outputs(llm, [prompt] * n, params)
    stats = llm.engine.step_scheduler.speculator.stats  # type: ignore[union-attr]
    assert stats.num_drafts >= n and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    for position in (1, 2):
        a = collections.Counter(t[position] for t in without)
        b = collections.Counter(t[position] for t in with_drafts)
        assert chi_squared_p(a, b) > 1e-3, (position, a, b)
    # What a verifier that kept every draft would give is far off: the test would catch it.
    assert chi_squared_p(collections.Counter(t[1] for t in without), collections.Counter({draft: n})) < 1e-9


def chi_squared_p(a: collections.Counter[int], b: collections.Counter[int]) -> float:
    """p-value of the chi-squared test that two histograms come from one distribution (rare bins pooled)."""
    total_a, total_b = sum(a.values()), sum(b.values())
    bins: list[tuple[int, int]] = []
    other = [0, 0]
    for token in set(a) | set(b):
        if a[token] + b[token] >= 10:
            bins.append((a[token], b[token]))
        else:
            other[0] += a[token]
            other[1] += b[token]
    if sum(other) > 0:
        bins.append((other[0], other[1]))
    statistic = 0.0
    for x, y in bins:
        pooled = (x + y) / (total_a + total_b)
        for observed, total in ((x, total_a), (y, total_b)):
            expected = pooled * total
            statistic += (observed - expected) ** 2 / expected
    return chi2_survival(statistic, len(bins) - 1)


def chi2_survival(x: float, dof: int) -> float:
    """P(X > x) for X chi-squared with dof degrees of freedom (the regularised upper gamma, by series)."""
    if dof <= 0:
        return 1.0
    s, z = dof / 2, x / 2
    term = total = 1 / s
    for k in range(1, 500):
        term *= z / (s + k)
        total += term
    lower = math.exp(-z + s * math.log(z) - math.lgamma(s)) * total if z > 0 else 0.0
    return max(0.0, 1.0 - lower)


def test_drafts_per_step_follow_acceptance() -> None:
    state = SpecState(NgramIndex(2, 4))
    state.acceptance = 0.9
    assert state.num_drafts(4) == 4
    state.acceptance = 0.3
    assert 1 <= state.num_drafts(4) < 4
    state.acceptance = 0.15
    assert state.num_drafts(4) == 1
    assert state.num_drafts(4, cost=0.2) == 0  # in a batch of 4, one draft costs more than it brings
    state.acceptance = 0.9
    assert state.num_drafts(4, cost=0.2) == 4
