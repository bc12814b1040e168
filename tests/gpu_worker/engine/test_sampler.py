"""gpu_worker.engine.sampler.Sampler and gpu_worker.engine.sampling_params.SamplingParams (no model)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence as Seq

import pytest
import torch

from gpu_worker.engine.sampler import (
    Sampler,
    SamplerOutput,
    _truncate_top_k_top_p,
    draw_seed,
    first_max_ids,
)
from gpu_worker.engine.sampling_params import SamplingParams
from gpu_worker.engine.sequence import Sequence

VOCAB = 50
EOS = 49
PROMPT = (1, 2, 3)
NUM_DRAWS = 4000


def make_seq(
    params: SamplingParams,
    *,
    prompt: Seq[int] = PROMPT,
    output: Seq[int] = (),
    seed: int | None = 0,
    seq_id: int = 0,
) -> Sequence:
    """A sequence with the given prompt and already-sampled output; non-greedy rows get the seed."""
    seq = Sequence(seq_id, f"req-{seq_id}", list(prompt), params)
    seq.token_ids.extend(output)
    if not params.greedy:
        seq.seed = seed
    return seq


def rand_logits(rows: int, seed: int, scale: float = 2.0, vocab: int = VOCAB) -> torch.Tensor:
    """Reproducible random logits [rows, vocab] (continuous, so no ties)."""
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def logits_for_probs(probs: dict[int, float], rest: float = 0.0) -> torch.Tensor:
    """A [vocab] logit row whose softmax is `probs` on the named tokens, `rest` spread over the others."""
    mass_left = 1.0 - sum(probs.values()) - rest
    assert abs(mass_left) < 1e-9 and rest >= 0.0
    others = VOCAB - len(probs)
    row = torch.full((VOCAB,), math.log(rest / others) if rest > 0 else float("-inf"), dtype=torch.float64)
    for token, p in probs.items():
        row[token] = math.log(p)
    return row.float()


def draw_counts(
    row: torch.Tensor, params: SamplingParams, n: int = NUM_DRAWS, seed: int = 0, eos: Seq[int] = (EOS,)
) -> Counter[int]:
    """n independent draws from one logit row: n sequences with seeds of their own, in one batch."""
    seqs = [make_seq(params, seed=seed * n + i, seq_id=i) for i in range(n)]
    out = Sampler(set(eos))(row.unsqueeze(0).expand(n, -1).contiguous(), seqs)
    return Counter(out.token_ids)


def total_variation(counts: Counter[int], probs: torch.Tensor) -> float:
    total = sum(counts.values())
    emp = torch.zeros(probs.numel(), dtype=torch.float64)
    for token, c in counts.items():
        emp[token] = c / total
    return 0.5 * float((emp - probs.double()).abs().sum())


def greedy_pick(
    row: torch.Tensor,
    params: SamplingParams,
    *,
    prompt: Seq[int] = PROMPT,
    output: Seq[int] = (),
    eos: Seq[int] = (EOS,),
) -> int:
    """The token a single greedy (or truncated-to-one) row picks."""
    seq = make_seq(params, prompt=prompt, output=output)
    return Sampler(set(eos))(row.unsqueeze(0), [seq]).token_ids[0]


# -- greedy and its equivalents ------------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    logits = rand_logits(64, seed=1)
    seqs = [make_seq(SamplingParams(temperature=0.0), seq_id=i) for i in range(64)]
    out = Sampler({EOS})(logits, seqs)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 64 and out.top_logprobs == [None] * 64


def test_greedy_accepts_half_precision_logits() -> None:
    logits = rand_logits(4, seed=2).to(torch.bfloat16)
    seqs = [make_seq(SamplingParams(temperature=0.0), seq_id=i) for i in range(4)]
    assert Sampler({EOS})(logits, seqs).token_ids == logits.float().argmax(-1).tolist()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=1.0, min_p=1.0),
        SamplingParams(temperature=2.0, top_k=1),
    ],
    ids=["top_k=1", "top_p=1e-6", "min_p=1", "top_k=1,T=2"],
)
def test_truncation_to_one_token_is_argmax(params: SamplingParams) -> None:
    # Flat logits: without the truncation, sampling would pick a non-argmax token most of the time.
    rows = 200
    logits = rand_logits(rows, seed=3, scale=0.3)
    seqs = [make_seq(params, seed=100 + i, seq_id=i) for i in range(rows)]
    assert Sampler({EOS})(logits, seqs).token_ids == logits.argmax(-1).tolist()


def test_plain_sampling_is_not_argmax() -> None:
    # Counterpart of the test above: the same flat rows without truncation do stray from argmax.
    rows = 200
    logits = rand_logits(rows, seed=3, scale=0.3)
    seqs = [make_seq(SamplingParams(temperature=1.0), seed=100 + i, seq_id=i) for i in range(rows)]
    picks = Sampler({EOS})(logits, seqs).token_ids
    assert sum(p != a for p, a in zip(picks, logits.argmax(-1).tolist(), strict=True)) > rows // 2


# -- truncation: top-k, top-p, min-p ---------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3, 5, 17])
def test_top_k_support_is_the_k_largest(k: int) -> None:
    row = rand_logits(1, seed=4, scale=0.5)[0]
    counts = draw_counts(row, SamplingParams(temperature=1.0, top_k=k))
    assert set(counts) == set(row.topk(k).indices.tolist())


# Four named tokens at scattered ids with known probabilities, 0.1 spread over the other 46.
KNOWN = {31: 0.35, 4: 0.25, 17: 0.2, 40: 0.1}


@pytest.mark.parametrize(
    ("top_p", "support"),
    [(0.3, {31}), (0.5, {31, 4}), (0.65, {31, 4, 17}), (0.85, {31, 4, 17, 40})],
)
def test_top_p_keeps_smallest_set_reaching_p(top_p: float, support: set[int]) -> None:
    row = logits_for_probs(KNOWN, rest=0.1)
    counts = draw_counts(row, SamplingParams(temperature=1.0, top_p=top_p))
    assert set(counts) == support
    # The kept tokens are renormalised, not just filtered.
    kept = torch.zeros(VOCAB)
    for token in support:
        kept[token] = KNOWN[token]
    assert total_variation(counts, kept / kept.sum()) < 0.05


@pytest.mark.parametrize(("top_p", "size"), [(0.25, 1), (0.5, 2), (0.75, 3), (0.76, 4)])
def test_top_p_boundary_mass_exactly_p(top_p: float, size: int) -> None:
    # Four tokens of exactly 0.25 each (equal logits, the rest -inf): once the kept mass equals p, stop.
    row = logits_for_probs({3: 0.25, 9: 0.25, 27: 0.25, 44: 0.25})
    counts = draw_counts(row, SamplingParams(temperature=1.0, top_p=top_p), n=2000)
    assert set(counts) <= {3, 9, 27, 44} and len(counts) == size


def test_top_p_is_taken_over_top_k_renormalised() -> None:
    # Top-3 renormalised: 0.4375, 0.3125, 0.25, so p=0.7 is reached by two tokens (three over raw probs).
    row = logits_for_probs(KNOWN, rest=0.1)
    counts = draw_counts(row, SamplingParams(temperature=1.0, top_k=3, top_p=0.7))
    assert set(counts) == {31, 4}


@pytest.mark.parametrize(
    ("min_p", "support"),
    [(0.6, {31, 4}), (0.5, {31, 4, 17}), (0.25, {31, 4, 17, 40})],
)
def test_min_p_drops_tokens_below_fraction_of_max(min_p: float, support: set[int]) -> None:
    row = logits_for_probs(KNOWN, rest=0.1)  # rest: 0.1 / 46 each, below every threshold here
    counts = draw_counts(row, SamplingParams(temperature=1.0, min_p=min_p))
    assert set(counts) == support


def test_min_p_uses_temperature_scaled_probs() -> None:
    # At T=2 the probabilities flatten: 0.2 / 0.35 at T=1 becomes sqrt(0.2 / 0.35) ~ 0.76 at T=2.
    row = logits_for_probs(KNOWN, rest=0.1)
    assert 17 not in draw_counts(row, SamplingParams(temperature=1.0, min_p=0.7))
    assert 17 in draw_counts(row, SamplingParams(temperature=2.0, min_p=0.7))


# -- distribution and reproducibility ------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_empirical_distribution_matches_softmax(temperature: float) -> None:
    row = rand_logits(1, seed=5, scale=1.0)[0]
    expected = torch.softmax(row.double() / temperature, -1)
    other = torch.softmax(row.double() / (1.5 - temperature), -1)  # the other temperature's distribution
    counts = draw_counts(row, SamplingParams(temperature=temperature), seed=11)
    assert total_variation(counts, expected) < 0.05
    # The check can tell the two temperatures apart.
    assert total_variation(counts, other) > 0.1


def _draw_sequence(seed: int, params: SamplingParams, steps: int = 30) -> list[int]:
    seq = make_seq(params, seed=seed)
    sampler = Sampler({EOS})
    for i in range(steps):
        seq.token_ids.append(sampler(rand_logits(1, seed=1000 + i, scale=0.5), [seq]).token_ids[0])
    return seq.output_token_ids


def test_same_seed_same_draws() -> None:
    params = SamplingParams(temperature=0.9, top_k=20)
    assert _draw_sequence(7, params) == _draw_sequence(7, params)
    assert _draw_sequence(7, params) != _draw_sequence(8, params)


def test_seeded_row_is_independent_of_its_batch() -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9)
    sampler = Sampler({EOS})
    steps = 20
    alone = _draw_sequence(123, params, steps)
    for layout in range(3):
        target = make_seq(params, seed=123, seq_id=0)
        others = [
            make_seq(SamplingParams(temperature=0.0, repetition_penalty=1.3), seq_id=1),
            make_seq(SamplingParams(temperature=1.3, top_k=5, frequency_penalty=0.5), seed=9, seq_id=2),
            # No generator: draws from the global RNG.
            make_seq(SamplingParams(temperature=0.7, min_p=0.2, top_p=0.5), seed=None, seq_id=3),
            make_seq(SamplingParams(temperature=1.0, min_tokens=3, max_tokens=5), seed=77, seq_id=4),
        ]
        batched: list[int] = []
        for i in range(steps):
            rows = [*others[:layout], target, *others[layout:]]
            logits = rand_logits(len(rows), seed=50_000 + 10 * i + layout, scale=3.0)
            logits[layout] = rand_logits(1, seed=1000 + i, scale=0.5)[0]
            out = sampler(logits, rows)
            batched.append(out.token_ids[layout])
            for seq, token in zip(rows, out.token_ids, strict=True):
                seq.token_ids.append(token)
        assert batched == alone, f"layout {layout}"


def test_a_draw_depends_only_on_the_seed_and_the_position() -> None:
    """A sample resumed from the tokens it streamed (now part of its prompt) draws as it would have."""
    params = SamplingParams(temperature=1.0)
    sampler = Sampler({EOS})
    steps, cut = 24, 9
    whole = _draw_sequence(5, params, steps)
    resumed = make_seq(params, prompt=[*PROMPT, *whole[:cut]], seed=5)
    for i in range(cut, steps):
        resumed.token_ids.append(sampler(rand_logits(1, seed=1000 + i, scale=0.5), [resumed]).token_ids[0])
    assert resumed.token_ids[len(PROMPT) :] == whole
    assert draw_seed(5, 10) != draw_seed(5, 11) and draw_seed(5, 10) != draw_seed(6, 10)
    assert 0 <= draw_seed(-(2**63), 2**40) < 2**63


# -- penalties -------------------------------------------------------------------------------------------


def assert_effective_logit(
    params: SamplingParams,
    token: int,
    raw: float,
    expected: float,
    *,
    prompt: Seq[int] = PROMPT,
    output: Seq[int] = (),
) -> None:
    """Check that `token`'s logit after penalties is `expected` (within 0.01), using an unseen pivot token."""
    pivot = 48
    assert pivot not in prompt and pivot not in output and token != pivot
    for offset, winner in ((-0.01, token), (0.01, pivot)):
        row = torch.full((VOCAB,), -20.0)
        row[token] = raw
        row[pivot] = expected + offset
        got = greedy_pick(row, params, prompt=prompt, output=output)
        assert got == winner, f"token {token}: effective logit is not {expected} (pivot {expected + offset})"


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    prompt, output = (5, 5, 5, 6), (7, 7)
    assert_effective_logit(params, 5, 3.0, 1.5, prompt=prompt, output=output)  # prompt token, seen 3 times
    assert_effective_logit(params, 7, 3.0, 1.5, prompt=prompt, output=output)  # output token
    assert_effective_logit(params, 6, -1.0, -2.0, prompt=prompt, output=output)  # negative: multiplied
    assert_effective_logit(params, 9, 3.0, 3.0, prompt=prompt, output=output)  # never seen: untouched
    assert_effective_logit(params, 9, -1.0, -1.0, prompt=prompt, output=output)


def test_repetition_penalty_below_one_favours_seen_tokens() -> None:
    params = SamplingParams(temperature=0.0, repetition_penalty=0.5)
    assert_effective_logit(params, 5, 2.0, 4.0, prompt=(5,))
    assert_effective_logit(params, 5, -2.0, -1.0, prompt=(5,))


def test_repeated_token_loses_to_runner_up_under_greedy() -> None:
    row = torch.zeros(VOCAB)
    row[5], row[8] = 4.0, 3.0
    prompt, output = (1, 5, 2, 5), (5, 5, 5)
    assert greedy_pick(row, SamplingParams(temperature=0.0), prompt=prompt, output=output) == 5
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    assert greedy_pick(row, penalised, prompt=prompt, output=output) == 8


def test_frequency_and_presence_penalties_count_output_tokens_only() -> None:
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3)
    prompt, output = (4, 4, 4), (7, 9, 7, 7)
    assert_effective_logit(params, 7, 3.0, 3.0 - 3 * 0.5 - 0.3, prompt=prompt, output=output)
    assert_effective_logit(params, 9, 3.0, 3.0 - 0.5 - 0.3, prompt=prompt, output=output)
    assert_effective_logit(params, 4, 3.0, 3.0, prompt=prompt, output=output)  # in the prompt only
    assert_effective_logit(params, 11, 3.0, 3.0, prompt=prompt, output=output)  # never seen
    # No output yet: nothing is penalised.
    assert_effective_logit(params, 4, 3.0, 3.0, prompt=prompt)


def test_negative_frequency_and_presence_penalties_reward_output_tokens() -> None:
    params = SamplingParams(temperature=0.0, frequency_penalty=-1.0, presence_penalty=-0.5)
    assert_effective_logit(params, 7, 1.0, 1.0 + 2 * 1.0 + 0.5, output=(7, 7))


def test_repetition_penalty_applies_before_frequency_penalty() -> None:
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5)
    assert_effective_logit(params, 7, 3.0, 3.0 / 2.0 - 2 * 0.5, output=(7, 7))


def test_penalties_apply_to_sampled_rows() -> None:
    # Token 5 dominates; with a huge repeated count and the maximum frequency penalty it can't be drawn.
    row = torch.zeros(VOCAB)
    row[5] = 5.0
    params = SamplingParams(temperature=1.0, frequency_penalty=2.0)
    seqs = [make_seq(params, output=[5] * 10, seed=i, seq_id=i) for i in range(500)]
    plain = [make_seq(SamplingParams(temperature=1.0), seed=i, seq_id=i) for i in range(500)]
    sampler = Sampler({EOS})
    assert 5 not in sampler(row.expand(500, -1).contiguous(), seqs).token_ids
    assert Counter(sampler(row.expand(500, -1).contiguous(), plain).token_ids)[5] > 250


# -- min_tokens and stop tokens ------------------------------------------------------------------------


def _stop_heavy_row() -> torch.Tensor:
    row = torch.zeros(VOCAB)
    row[EOS], row[7], row[48], row[2] = 10.0, 9.5, 9.0, 8.0  # EOS, stop id, second EOS id, ordinary token
    return row


@pytest.mark.parametrize("num_output", [0, 1, 2])
def test_min_tokens_masks_eos_and_stop_ids(num_output: int) -> None:
    params = SamplingParams(temperature=0.0, min_tokens=3, max_tokens=10, stop_token_ids=[7])
    pick = greedy_pick(_stop_heavy_row(), params, output=[2] * num_output, eos=(EOS, 48))
    assert pick == 2


def test_min_tokens_reached_lets_eos_through() -> None:
    params = SamplingParams(temperature=0.0, min_tokens=3, max_tokens=10, stop_token_ids=[7])
    assert greedy_pick(_stop_heavy_row(), params, output=[2, 2, 2], eos=(EOS, 48)) == EOS
    row = _stop_heavy_row()
    row[EOS] = 0.0
    assert greedy_pick(row, params, output=[2, 2, 2], eos=(EOS, 48)) == 7


@pytest.mark.parametrize("penalties", [{}, {"presence_penalty": 0.1}, {"repetition_penalty": 1.1}], ids=repr)
def test_min_tokens_mask_lifts_exactly_at_min_tokens(penalties: dict[str, float]) -> None:
    # With penalties the row goes through the penalty path; the mask must still stop at min_tokens.
    params = SamplingParams(temperature=0.0, min_tokens=3, max_tokens=10, **penalties)  # type: ignore[arg-type]
    row = torch.zeros(VOCAB)
    row[EOS], row[2] = 10.0, 8.0
    assert greedy_pick(row, params, output=[2, 2]) == 2
    assert greedy_pick(row, params, output=[2, 2, 2]) == EOS


def test_min_tokens_masks_every_eos_id() -> None:
    row = _stop_heavy_row()
    row[EOS] = 0.0  # leaves the second EOS id (48) above the ordinary token
    params = SamplingParams(temperature=0.0, min_tokens=1, max_tokens=10)
    assert greedy_pick(row, params, eos=(EOS, 48)) == 7  # 7 is no stop token for this request
    assert greedy_pick(row, params, eos=(EOS,)) == 7
    row[7] = 0.0
    assert greedy_pick(row, params, eos=(EOS, 48)) == 2
    assert greedy_pick(row, params, eos=(EOS,)) == 48


def test_min_tokens_with_ignore_eos_masks_stop_ids_only() -> None:
    row = torch.zeros(VOCAB)
    row[7], row[EOS], row[2] = 10.0, 9.0, 8.0
    params = SamplingParams(temperature=0.0, min_tokens=3, max_tokens=10, stop_token_ids=[7], ignore_eos=True)
    assert greedy_pick(row, params) == EOS


def test_min_tokens_with_ignore_eos_and_no_stop_ids() -> None:
    row = _stop_heavy_row()
    params = SamplingParams(temperature=0.0, min_tokens=2, max_tokens=10, ignore_eos=True)
    assert greedy_pick(row, params) == EOS


def test_min_tokens_masks_sampled_rows() -> None:
    row = _stop_heavy_row()
    params = SamplingParams(temperature=1.0, min_tokens=2, max_tokens=10, stop_token_ids=[7])
    counts = draw_counts(row, params, n=1000, eos=(EOS, 48))
    assert not {EOS, 48, 7} & set(counts)
    assert counts[2] > 900  # the mass went to the best remaining token
    free = draw_counts(row, SamplingParams(temperature=1.0, stop_token_ids=[7]), n=1000, eos=(EOS, 48))
    assert {EOS, 48, 7} <= set(free)


# -- logit_bias and allowed_token_ids --------------------------------------------------------------------


def test_a_bias_of_plus_100_makes_greedy_pick_the_token() -> None:
    row = rand_logits(1, seed=20, scale=5.0)[0]
    least = int(row.argmin())
    assert greedy_pick(row, SamplingParams(temperature=0.0)) != least
    assert greedy_pick(row, SamplingParams(temperature=0.0, logit_bias={least: 100.0})) == least


def test_a_bias_of_minus_100_on_the_greedy_token_changes_the_pick() -> None:
    row = rand_logits(1, seed=21)[0]
    best, runner_up = row.topk(2).indices.tolist()
    assert greedy_pick(row, SamplingParams(temperature=0.0, logit_bias={best: -100.0})) == runner_up


def test_bias_is_added_after_penalties() -> None:
    # Token 3 was generated: repetition_penalty 2 halves its logit 4 -> 2, then +2.5 makes it 4.5 > 4.2.
    row = torch.zeros(VOCAB)
    row[3], row[9] = 4.0, 4.2
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={3: 2.5})
    assert greedy_pick(row, params, output=[3]) == 3
    # A bias added before the penalty would have been halved too: 6.5 / 2 = 3.25 < 4.2.
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={3: 0.5})
    assert greedy_pick(row, params, output=[3]) == 9


def test_bias_is_added_before_temperature() -> None:
    row = rand_logits(1, seed=22, scale=1.0)[0]
    bias = {4: 2.0, 11: -1.5, 30: 1.0}
    shifted = row.double().clone()
    for token, b in bias.items():
        shifted[token] += b
    counts = draw_counts(row, SamplingParams(temperature=0.5, logit_bias=bias), seed=12)
    assert total_variation(counts, torch.softmax(shifted / 0.5, -1)) < 0.05
    # Bias divided by the temperature too is a different distribution, which the check tells apart.
    assert total_variation(counts, torch.softmax(row.double() / 0.5, -1)) > 0.1


@pytest.mark.parametrize("temperature", [0.0, 1.0, 3.0])
def test_allowed_token_ids_restrict_every_token(temperature: float) -> None:
    allowed = [2, 17, 33]
    row = rand_logits(1, seed=23, scale=3.0)[0]
    assert int(row.argmax()) not in allowed
    params = SamplingParams(temperature=temperature, allowed_token_ids=allowed)
    counts = draw_counts(row, params, n=500)
    assert set(counts) <= set(allowed)
    if temperature == 0.0:
        assert set(counts) == {max(allowed, key=lambda t: float(row[t]))}
    else:
        assert set(counts) == set(allowed)  # renormalised over the set, not collapsed to one token


def test_allowed_token_ids_with_min_tokens_mask_eos_until_min_tokens() -> None:
    row = _stop_heavy_row()
    params = SamplingParams(temperature=0.0, min_tokens=2, max_tokens=10, allowed_token_ids=[EOS, 5, 6])
    row[6] = 1.0
    assert greedy_pick(row, params) == 6
    assert greedy_pick(row, params, output=[6]) == 6
    assert greedy_pick(row, params, output=[6, 6]) == EOS
    counts = draw_counts(row, SamplingParams(temperature=1.0, min_tokens=1, allowed_token_ids=[EOS, 5, 6]))
    assert set(counts) == {5, 6}


def test_bias_and_allowed_apply_per_row_and_leave_other_rows_and_the_input_alone() -> None:
    logits = rand_logits(3, seed=24)
    before = logits.clone()
    low = int(logits[0].argmin())
    seqs = [
        make_seq(SamplingParams(temperature=0.0, logit_bias={low: 100.0}), seq_id=0),
        make_seq(SamplingParams(temperature=0.0), seq_id=1),
        make_seq(SamplingParams(temperature=0.0, allowed_token_ids=[low, 1]), seq_id=2),
    ]
    out = Sampler({EOS})(logits, seqs)
    assert out.token_ids[0] == low
    assert out.token_ids[1] == int(logits[1].argmax())
    assert out.token_ids[2] in (low, 1) and out.token_ids[2] == max(
        (low, 1), key=lambda t: float(logits[2, t])
    )
    assert torch.equal(logits, before)


def test_logprobs_stay_the_models_under_bias_and_allowed_tokens() -> None:
    logits = rand_logits(2, seed=25)
    low = int(logits[0].argmin())
    seqs = [
        make_seq(SamplingParams(temperature=0.0, logit_bias={low: 100.0}, logprobs=2), seq_id=0),
        make_seq(SamplingParams(temperature=0.0, allowed_token_ids=[low], logprobs=2), seq_id=1),
    ]
    out = Sampler({EOS})(logits, seqs)
    raw = torch.log_softmax(logits.double(), -1)
    for i in range(2):
        chosen = out.logprobs[i]
        top = out.top_logprobs[i]
        assert chosen == pytest.approx(float(raw[i, out.token_ids[i]]), abs=1e-5)
        assert top is not None and list(top) == raw[i].topk(2).indices.tolist()


# -- logprobs --------------------------------------------------------------------------------------------


def test_chosen_logprob_is_raw_log_softmax() -> None:
    logits = rand_logits(3, seed=6)
    params = [
        SamplingParams(temperature=0.5, repetition_penalty=1.8, presence_penalty=1.0, logprobs=0),
        SamplingParams(temperature=0.0, frequency_penalty=2.0, logprobs=2),
        SamplingParams(temperature=1.3, top_k=4, logprobs=1),
    ]
    seqs = [make_seq(p, output=[3, 3, 8], seed=i, seq_id=i) for i, p in enumerate(params)]
    out = Sampler({EOS})(logits, seqs)
    raw = torch.log_softmax(logits.double(), -1)
    for i, token in enumerate(out.token_ids):
        chosen = out.logprobs[i]
        assert chosen is not None
        assert chosen == pytest.approx(float(raw[i, token]), abs=1e-5)


def test_top_logprobs_are_k_largest_sorted() -> None:
    logits = rand_logits(1, seed=7)
    out = Sampler({EOS})(logits, [make_seq(SamplingParams(temperature=0.7, logprobs=5))])
    top = out.top_logprobs[0]
    assert top is not None and len(top) == 5
    raw = torch.log_softmax(logits[0].double(), -1)
    assert list(top) == raw.topk(5).indices.tolist()
    values = list(top.values())
    assert values == sorted(values, reverse=True)
    for token, lp in top.items():
        assert lp == pytest.approx(float(raw[token]), abs=1e-5)


def test_logprobs_none_and_zero() -> None:
    logits = rand_logits(2, seed=8)
    seqs = [
        make_seq(SamplingParams(temperature=0.0, logprobs=None), seq_id=0),
        make_seq(SamplingParams(temperature=0.0, logprobs=0), seq_id=1),
    ]
    out = Sampler({EOS})(logits, seqs)
    assert out.logprobs[0] is None and out.top_logprobs[0] is None
    assert isinstance(out.logprobs[1], float) and out.top_logprobs[1] is None


def test_sampler_output_shape() -> None:
    out = Sampler({EOS})(rand_logits(3, seed=9), [make_seq(SamplingParams(), seq_id=i) for i in range(3)])
    assert isinstance(out, SamplerOutput)
    assert len(out.token_ids) == 3 and all(isinstance(t, int) and 0 <= t < VOCAB for t in out.token_ids)


# -- SamplingParams --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": 0},
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": 1.01},
        {"top_p": -0.5},
        {"top_k": -2},
        {"min_p": -0.01},
        {"min_p": 1.01},
        {"presence_penalty": 2.01},
        {"presence_penalty": -2.01},
        {"frequency_penalty": 2.5},
        {"frequency_penalty": -2.5},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": -1.0},
        {"max_tokens": 0},
        {"max_tokens": -3},
        {"min_tokens": -1},
        {"min_tokens": 5, "max_tokens": 4},
        {"logprobs": -1},
        {"top_p": float("nan")},
        {"min_p": float("nan")},
        {"presence_penalty": float("nan")},
        {"prompt_logprobs": -1},
        {"logit_bias": {3: 100.5}},
        {"logit_bias": {3: -101.0}},
        {"logit_bias": {3: float("nan")}},
        {"allowed_token_ids": []},
    ],
    ids=repr,
)
def test_invalid_sampling_params_raise(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs", [{"temperature": float("nan")}, {"repetition_penalty": float("nan")}], ids=repr
)
def test_nan_sampling_params_raise(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"top_p": 1.0, "top_k": -1, "min_p": 1.0},
        {"presence_penalty": 2.0, "frequency_penalty": -2.0, "repetition_penalty": 0.01},
        {"min_tokens": 4, "max_tokens": 4},
        {"min_tokens": 100, "max_tokens": None},
        {"logprobs": 0},
        {"temperature": 0.0},
        {"prompt_logprobs": 0},
        {"logit_bias": {3: 100.0, 4: -100.0}},
        {"allowed_token_ids": [5]},
    ],
    ids=repr,
)
def test_valid_sampling_params_accepted(kwargs: dict[str, float]) -> None:
    SamplingParams(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("temperature", [0.0, 1e-6])
def test_greedy_normalises_truncation(temperature: float) -> None:
    p = SamplingParams(temperature=temperature, top_k=5, top_p=0.5, min_p=0.3)
    assert p.greedy and p.temperature == 0.0
    assert (p.top_k, p.top_p, p.min_p) == (0, 1.0, 0.0)


def test_top_k_minus_one_means_disabled() -> None:
    p = SamplingParams(temperature=1.0, top_k=-1)
    assert p.top_k == 0 and not p.greedy
    assert SamplingParams(temperature=0.01, top_k=3).top_k == 3


def test_has_penalties() -> None:
    assert not SamplingParams().has_penalties
    assert SamplingParams(presence_penalty=0.1).has_penalties
    assert SamplingParams(frequency_penalty=-0.1).has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties


# -- known defects ---------------------------------------------------------------------------------------


def test_top_p_one_row_untruncated_whatever_its_batch() -> None:
    # Llama-3-sized vocabulary: the float32 softmax of the sorted row sums to about 1 + 2.6e-5, so the running
    # sum reaches 1.0 well before the last token and `mass_before >= p` drops the tail of a row that asked for
    # no top-p at all. Alone (or with other top_p=1.0 rows) the truncation is skipped, so the row's
    # distribution depends on what else shares its batch.
    logits = rand_logits(2, seed=0, scale=4.0, vocab=128_256)
    out = _truncate_top_k_top_p(logits, [0, 0], [1.0, 0.9])
    assert not torch.isinf(out[0]).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_max_ids_picks_argmaxs_index_on_ties_nan_and_inf(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    rows = torch.randint(0, 4, (40, 49152)).to(dtype)  # every row full of ties
    rows[1, [7, 300]] = float("nan")  # NaN wins, the first one
    rows[2] = float("-inf")
    rows[3, [5, 40000]] = float("inf")
    rows[4, -1] = 9  # the last column alone
    ids = first_max_ids(rows)
    assert torch.equal(ids, rows.argmax(dim=-1))
    assert ids[1:5].tolist() == [7, 0, 5, 49151]
    assert rows[0, ids[0]] == 3 and (rows[0, : ids[0]] < 3).all()  # the first of the row's ties


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 7, 8, 13, 1003])
def test_first_max_ids_reads_any_width_and_rows_apart(dtype: torch.dtype, vocab: int) -> None:
    # Widths past the kernel's eight lanes and short of them, a lone NaN or maximum in the tail, rows taken
    # from a wider tensor (a stride of their own).
    torch.manual_seed(1)
    wide = torch.randn(6, vocab + 5).to(dtype)
    rows = wide[:, 2 : vocab + 2]
    rows[1, -1] = 50.0
    rows[2, vocab // 2] = float("nan")
    rows[3] = rows[3, 0]  # all ties
    ids = first_max_ids(rows)
    assert torch.equal(ids, rows.float().argmax(dim=-1))
    assert ids[1:4].tolist() == [vocab - 1, vocab // 2, 0]


def test_greedy_rows_asking_nothing_else_take_the_bf16_logits_as_they_are() -> None:
    # The fast path (no float32 copy) and the full one pick the same tokens.
    torch.manual_seed(2)
    logits = torch.randn(5, 4096).to(torch.bfloat16)
    plain = [make_seq(SamplingParams(temperature=0.0), seq_id=i) for i in range(5)]
    asked = [make_seq(SamplingParams(temperature=0.0, logprobs=1), seq_id=i) for i in range(5)]
    fast = Sampler(set())(logits, plain)
    full = Sampler(set())(logits, asked)
    assert fast.token_ids == full.token_ids == logits.float().argmax(dim=-1).tolist()
    assert fast.logprobs == [None] * 5 and all(lp is not None for lp in full.logprobs)
