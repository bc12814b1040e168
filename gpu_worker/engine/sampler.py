"""Turning one step's logits into tokens: penalties, logit bias, allowed tokens, grammars, temperature,
truncation, seeded sampling, logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from gpu_worker.engine.sequence import Sequence
from gpu_worker.engine.structured_output import TokenBitmask, apply_grammars


@dataclass(slots=True)
class SamplerOutput:
    """Per row: the chosen token, its log-probability, and the top-k alternatives when asked."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None]


_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, position: int) -> int:
    """The seed of a sample's draw for the token at `position` (its index in prompt + output).

    A sample's draws depend on its seed and the position alone, never on how many draws came before: a
    sample recomputed after preemption, or resumed on another worker from the tokens it streamed, goes on
    exactly as it would have. The two are mixed (splitmix64's finalizer) so that neighbouring seeds and
    positions give unrelated streams.
    """
    x = (seed * 0x9E3779B97F4A7C15 + position) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1  # 63 bits: what every torch generator takes


def first_max_ids(rows: torch.Tensor) -> torch.Tensor:
    """Each row's index of its first largest value (its first NaN, if it has one), as argmax gives it; on the
    CPU a C++ kernel reads the rows in their own dtype (kernels.first_max_ids)."""
    return kernels.first_max_ids(rows)


def _plain_greedy(seq: Sequence) -> bool:
    """Whether a row takes the first largest of the model's own logits, and asks nothing else of them."""
    params = seq.params
    return (
        params.greedy
        and params.logprobs is None
        and not params.has_penalties
        and seq.num_output_tokens >= params.min_tokens
        and not params.shapes_logits
        and seq.matcher is None
    )


class Sampler:
    """Samples one token per row of logits; row i belongs to seqs[i]."""

    def __init__(self, eos_token_ids: set[int]) -> None:
        self.eos_token_ids = eos_token_ids
        self._generators: dict[torch.device, torch.Generator] = {}  # one per device, reseeded per draw
        self._bitmask = TokenBitmask()  # structured outputs: grown once, refilled every step

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device)
        return generator

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        # logits: [num_rows, vocab_size]
        num_rows = len(seqs)
        if all(_plain_greedy(s) for s in seqs):  # the logits as the LM head left them: no float32 copy
            return SamplerOutput(first_max_ids(logits).tolist(), [None] * num_rows, [None] * num_rows)
        logits = raw_logits = logits.float()
        logprobs = self._logprobs(logits, seqs)
        if any(s.params.has_penalties or s.num_output_tokens < s.params.min_tokens for s in seqs):
            logits = logits.clone()
            for i, seq in enumerate(seqs):
                self._apply_penalties(logits[i], seq)
        if any(s.params.shapes_logits for s in seqs):
            logits = _apply_bias_and_allowed(logits, seqs)
        if any(s.matcher is not None for s in seqs):
            if logits is raw_logits:
                logits = logits.clone()
            apply_grammars(self._bitmask, logits, raw_logits, [s.matcher for s in seqs])
        greedy = torch.tensor([s.params.greedy for s in seqs], dtype=torch.bool)
        token_ids = first_max_ids(logits)
        random_rows = (~greedy).nonzero().flatten().tolist()
        if random_rows:
            sampled = self._sample_random(logits[random_rows], [seqs[i] for i in random_rows])
            token_ids[random_rows] = sampled
        token_list = token_ids.tolist()
        chosen: list[float | None] = [None] * num_rows
        top: list[dict[int, float] | None] = [None] * num_rows
        if logprobs is not None:
            for i, seq in enumerate(seqs):
                k = seq.params.logprobs
                if k is None:
                    continue
                chosen[i] = logprobs[i, token_list[i]].item()
                if k > 0:
                    values, ids = logprobs[i].topk(k)
                    top[i] = dict(zip(ids.tolist(), values.tolist()))
        return SamplerOutput(token_list, chosen, top)

    @staticmethod
    def _logprobs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor | None:
        # The model's own distribution, before penalties, logit_bias, allowed_token_ids and temperature (what
        # vLLM reports by default): a logprob says what the model thought, whatever steered the choice.
        if all(s.params.logprobs is None for s in seqs):
            return None
        return torch.log_softmax(logits, dim=-1)

    def _apply_penalties(self, row: torch.Tensor, seq: Sequence) -> None:
        params = seq.params
        if seq.num_output_tokens < params.min_tokens:
            stops = list(params.stop_ids(self.eos_token_ids))
            row[stops] = float("-inf")
        if not params.has_penalties:
            return
        device = row.device
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(seq.token_ids, device=device).unique()
            values = row[seen]
            row[seen] = torch.where(
                values > 0, values / params.repetition_penalty, values * params.repetition_penalty
            )
        if seq.num_output_tokens and (params.presence_penalty or params.frequency_penalty):
            counts = torch.bincount(torch.tensor(seq.output_token_ids, device=device), minlength=row.numel())
            row -= params.frequency_penalty * counts.to(row.dtype)
            row -= params.presence_penalty * (counts > 0).to(row.dtype)

    def _sample_random(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        # logits: [num_rows, vocab_size] -> [num_rows] token ids
        device = logits.device
        temperature = torch.tensor([s.params.temperature for s in seqs], device=device)
        logits = logits / temperature.unsqueeze(1)
        top_k = [s.params.top_k for s in seqs]
        top_p = [s.params.top_p for s in seqs]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            logits = _truncate_top_k_top_p(logits, top_k, top_p)
        probs = torch.softmax(logits, dim=-1)
        min_p = torch.tensor([s.params.min_p for s in seqs], device=device)
        if bool((min_p > 0).any()):
            threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
            probs = probs.masked_fill(probs < threshold, 0.0)
        # Exponential race (argmax p / E with E ~ Exp(1)) samples from p; each row's noise comes from its own
        # seed and position, so a seeded request gets the same tokens whatever else shares the batch.
        noise = torch.empty_like(probs)
        generator = self._generator(device)
        for i, seq in enumerate(seqs):
            if seq.seed is None:  # no seed of its own: the global generator
                noise[i].exponential_()
                continue
            generator.manual_seed(draw_seed(seq.seed, seq.num_tokens))
            noise[i].exponential_(generator=generator)
        return first_max_ids(probs / noise)


def _apply_bias_and_allowed(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits [num_rows, vocab_size] plus each row's logit_bias, then -inf outside its allowed_token_ids.

    Out of place; the masks are built from the named ids only, never by walking the vocabulary.
    """
    device = logits.device
    biased = [i for i, s in enumerate(seqs) if s.params.logit_bias]
    if biased:
        biases = [seqs[i].params.logit_bias for i in biased]
        rows = torch.tensor(biased, device=device).repeat_interleave(
            torch.tensor([len(b) for b in biases], device=device)
        )
        cols = torch.tensor([t for b in biases for t in b], device=device)
        values = torch.tensor([v for b in biases for v in b.values()], dtype=logits.dtype, device=device)
        logits = logits.index_put((rows, cols), values, accumulate=True)
    restricted = [i for i, s in enumerate(seqs) if s.params.allowed_token_ids is not None]
    if restricted:
        allowed = [seqs[i].params.allowed_token_ids or [] for i in restricted]
        local_rows = torch.arange(len(restricted), device=device).repeat_interleave(
            torch.tensor([len(a) for a in allowed], device=device)
        )
        cols = torch.tensor([t for a in allowed for t in a], device=device)
        keep = torch.zeros(len(restricted), logits.shape[-1], dtype=torch.bool, device=device)
        keep[local_rows, cols] = True
        if not biased:
            logits = logits.clone()
        logits[restricted] = logits[restricted].masked_fill(~keep, float("-inf"))
    return logits


def _truncate_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    # logits: [num_rows, vocab_size]; masks everything outside each row's top-k and top-p nucleus.
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab_size, device=logits.device).unsqueeze(0)
    k = torch.tensor([kk if kk > 0 else vocab_size for kk in top_k], device=logits.device).unsqueeze(1)
    remove = ranks >= k
    p = torch.tensor(top_p, device=logits.device, dtype=logits.dtype).unsqueeze(1)
    probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    # Keep a token while the mass before it is below p; the top token always stays. Rows with p = 1 are left
    # alone: a float32 cumsum can reach 1.0 before the tail, which would cut it off.
    mass_before = probs.cumsum(dim=-1) - probs
    remove |= (mass_before >= p) & (p < 1.0)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
