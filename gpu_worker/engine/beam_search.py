"""Beam search over engine sequences: beams fork from their parent and share its KV blocks (copy-on-write).

The rule is transformers' `generate(num_beams=k, do_sample=False)` with its default `early_stopping=False`:

- Scores are cumulative sums of fp32 log_softmax(logits); the first step has one beam (the prompt).
- Each step takes the top K = max(2, 1 + number of stop tokens) * k of (beam score + token logprob) over every
  live beam and token; the union of each beam's own top K holds them all.
- A candidate that ends on a stop token, or reaches the length limit, is a finished hypothesis if its rank
  among the K is below k; it scores cum_logprob / generated_len ** length_penalty (the stop token counted).
  The finished set keeps the best k.
- The best k candidates that did not stop are the next live beams.
- Early stop (the early_stopping=False heuristic): once k hypotheses are finished and the best live score
  over generated_len ** length_penalty is no better than the worst finished one, the search ends. It also
  ends when all K candidates stopped (the length limit).
- The answer is the finished hypotheses, best first.

Beam search is deterministic: temperature, top_p, top_k, min_p and seed are ignored.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from gpu_worker.engine.sampling_params import SamplingParams
from gpu_worker.engine.sequence import Sequence, SequenceStatus
from gpu_worker.engine.step_scheduler import StepScheduler
from shared.errors import ErrorCode, RequestRejected

_FLOAT32 = struct.Struct("f")


def _f32(x: float) -> float:
    """x rounded to float32, so scores add and divide exactly as transformers' fp32 tensors do."""
    return float(_FLOAT32.unpack(_FLOAT32.pack(x))[0])


@dataclass(slots=True)
class BeamSearchParams:
    """The offline `LLM.beam_search` parameters, as in vLLM."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def sampling_params(self) -> SamplingParams:
        """The equivalent request: width beams, all of them returned, with per-token logprobs."""
        return SamplingParams(
            n=self.beam_width,
            best_of=self.beam_width,
            use_beam_search=True,
            temperature=0.0,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            length_penalty=self.length_penalty,
            logprobs=0,
        )


@dataclass(slots=True)
class Hypothesis:
    """A finished beam: its output tokens, their logprobs and its length-penalized score."""

    token_ids: list[int]
    cum_logprob: float
    score: float
    finish_reason: str
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class BeamCandidates:
    """One live beam's top tokens after its latest forward: ids, logprobs, and alternatives to report."""

    token_ids: list[int]
    logprobs: list[float]
    top: dict[int, float] | None


def validate_beam_search(
    params: SamplingParams, max_len: int, num_blocks: int, block_size: int, max_num_seqs: int
) -> None:
    """Refuse (RequestRejected) a width the engine cannot hold (what beam search does not combine with is
    refused by SamplingParams itself)."""
    width = params.beam_width()
    if width > max_num_seqs:
        raise RequestRejected(
            ErrorCode.INVALID_REQUEST, f"a beam width of {width} exceeds max_num_seqs ({max_num_seqs})"
        )
    # NOTE: every beam must fit at once, even unshared, or beams could preempt each other forever.
    if width * -(-max_len // block_size) > num_blocks:
        raise RequestRejected(
            ErrorCode.KV_CAPACITY_EXCEEDED,
            f"{width} beams of {max_len} tokens do not fit in the KV pool of {num_blocks} blocks",
        )


def beam_candidates(logits: torch.Tensor, k: list[int], num_top: list[int | None]) -> list[BeamCandidates]:
    """Per row of logits [num_rows, vocab_size]: the top k[i] tokens by fp32 logprob (and num_top[i] of them
    reported as alternatives, when not None)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    width = max(max(k), max((t or 0) for t in num_top))
    values, ids = logprobs.topk(min(width, logprobs.shape[-1]), dim=-1)
    value_rows, id_rows = values.tolist(), ids.tolist()
    out = []
    for i, (row_values, row_ids) in enumerate(zip(value_rows, id_rows)):
        top = num_top[i]
        alternatives = dict(zip(row_ids[:top], row_values[:top])) if top else ({} if top == 0 else None)
        out.append(BeamCandidates(row_ids[: k[i]], row_values[: k[i]], alternatives))
    return out


class BeamSearch:
    """The beam state of one request: live beams (engine sequences) with their scores, and the finished
    hypotheses."""

    def __init__(self, root: Sequence, stop_token_ids: set[int], max_model_len: int) -> None:
        params = root.params
        self.root = root
        self.width = params.best_of or params.n
        self.stop_token_ids = stop_token_ids
        self.num_candidates = max(2, 1 + len(stop_token_ids)) * self.width
        max_tokens = params.max_tokens or max_model_len
        self.max_output_len = min(max_tokens, max_model_len - root.num_prompt_tokens)
        self.live: list[Sequence] = [root]
        self.scores: dict[int, float] = {root.seq_id: 0.0}  # seq_id -> cumulative logprob (fp32)
        self.candidates: dict[int, BeamCandidates] = {}  # seq_id -> its candidates this step
        self.finished: list[Hypothesis] = []  # best first, at most width
        self.done = False

    @property
    def request_id(self) -> str:
        return self.root.request_id

    def add_candidates(self, seq: Sequence, candidates: BeamCandidates) -> None:
        self.candidates[seq.seq_id] = candidates

    def ready(self) -> bool:
        """Whether every live beam has its candidates and still holds its KV (one preempted since must
        recompute first)."""
        return all(
            s.seq_id in self.candidates
            and s.status is SequenceStatus.RUNNING
            and s.num_computed_tokens == s.num_tokens
            for s in self.live
        )

    def step(self, scheduler: StepScheduler, seq_ids: Iterator[int]) -> None:
        """Choose the next live beams from this step's candidates, forking parents and dropping the rest."""
        params = self.root.params
        ranked: list[tuple[float, int, int]] = []  # (cumulative logprob, beam, rank in its candidates)
        for b, seq in enumerate(self.live):
            score = self.scores[seq.seq_id]
            ranked += [(_f32(score + lp), b, r) for r, lp in enumerate(self.candidates[seq.seq_id].logprobs)]
        ranked.sort(key=lambda c: (-c[0], c[1], c[2]))
        generated_len = self.live[0].num_output_tokens + 1
        at_limit = generated_len >= self.max_output_len
        denominator = _f32(generated_len**params.length_penalty)
        chosen: list[tuple[float, int, int]] = []
        new_finished: list[Hypothesis] = []
        for rank, (cum, b, r) in enumerate(ranked[: self.num_candidates]):
            token = self.candidates[self.live[b].seq_id].token_ids[r]
            stopped = token in self.stop_token_ids
            if not (stopped or at_limit):
                if len(chosen) < self.width:
                    chosen.append((cum, b, r))
            elif rank < self.width:
                new_finished.append(
                    self._hypothesis(b, r, cum, _f32(cum / denominator), "stop" if stopped else "length")
                )
        # NOTE: a stable sort keeps earlier hypotheses ahead of new ones on a tie, like transformers.
        self.finished = sorted(self.finished + new_finished, key=lambda h: -h.score)[: self.width]
        if not chosen:
            self.done = True
            return
        best_live = _f32(chosen[0][0] / denominator)
        if len(self.finished) == self.width and best_live <= self.finished[-1].score:
            self.done = True
            return
        self._advance(scheduler, seq_ids, chosen)

    def _hypothesis(self, b: int, r: int, cum: float, score: float, reason: str) -> Hypothesis:
        seq = self.live[b]
        candidates = self.candidates[seq.seq_id]
        hyp = Hypothesis([*seq.output_token_ids, candidates.token_ids[r]], cum, score, reason)
        if self.root.params.logprobs is not None:
            hyp.logprobs = [*seq.logprobs, candidates.logprobs[r]]
            hyp.top_logprobs = [*seq.top_logprobs, candidates.top or {}]
        return hyp

    def _advance(
        self, scheduler: StepScheduler, seq_ids: Iterator[int], chosen: list[tuple[float, int, int]]
    ) -> None:
        # A parent's first child is the parent itself; the others fork it, before any new token is appended,
        # so every child shares the parent's blocks and a write into a shared block copies it first.
        beams: list[Sequence] = []
        used: set[int] = set()
        for index, (_, b, _) in enumerate(chosen):
            parent = self.live[b]
            if parent.seq_id in used:
                child = scheduler.fork(parent, next(seq_ids), index)
                child.logprobs = list(parent.logprobs)
                child.top_logprobs = list(parent.top_logprobs)
                beams.append(child)
            else:
                used.add(parent.seq_id)
                beams.append(parent)
        for seq in self.live:
            if seq.seq_id not in used:
                scheduler.finish(seq, "abort")
        scores: dict[int, float] = {}
        for seq, (cum, b, r) in zip(beams, chosen):
            candidates = self.candidates[self.live[b].seq_id]
            seq.token_ids.append(candidates.token_ids[r])
            if seq.params.logprobs is not None:
                seq.logprobs.append(candidates.logprobs[r])
                seq.top_logprobs.append(candidates.top or {})
            scores[seq.seq_id] = cum
        self.live, self.scores = beams, scores
        self.candidates.clear()

    def free(self, scheduler: StepScheduler) -> None:
        """Finish every live beam, returning its blocks."""
        for seq in self.live:
            if not seq.is_finished:
                scheduler.finish(seq, "abort")
        self.live = []

    def results(self, seq_ids: Iterator[int], now: float) -> list[Sequence]:
        """The n best hypotheses as finished sequences with indexes 0..n-1 (prompt + hypothesis tokens)."""
        root = self.root
        out = []
        for index, hyp in enumerate(self.finished[: root.params.n]):
            seq = Sequence(
                next(seq_ids),
                root.request_id,
                root.token_ids[: root.num_prompt_tokens],
                root.params,
                index=index,
                priority=root.priority,
                arrival=root.arrival,
            )
            seq.token_ids += hyp.token_ids
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = hyp.finish_reason
            seq.num_pending_forks = 0
            seq.logprobs, seq.top_logprobs = hyp.logprobs, hyp.top_logprobs
            seq.prompt_logprobs, seq.prompt_top_logprobs = root.prompt_logprobs, root.prompt_top_logprobs
            seq.num_cached_tokens = root.num_cached_tokens
            seq.arrival_time, seq.first_scheduled_time = root.arrival_time, root.first_scheduled_time
            seq.first_token_time = seq.last_token_time = now
            out.append(seq)
        return out
