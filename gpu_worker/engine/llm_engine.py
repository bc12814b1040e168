"""The engine: one step is schedule -> run -> postprocess."""

from __future__ import annotations

import itertools
import random
import time
from typing import Any

import torch
from llguidance import LLMatcher

from gpu_worker.engine.beam_search import BeamSearch, beam_candidates
from gpu_worker.engine.block_allocator import BlockAllocator
from gpu_worker.engine.config import EngineConfig
from gpu_worker.engine.model_runner import ModelRunner, StepRunner
from gpu_worker.engine.prompt_logprobs import prompt_logit_spans, record_prompt_logprobs
from gpu_worker.engine.request_checks import EngineLimits, check_request
from gpu_worker.engine.sampler import Sampler, SamplerOutput
from gpu_worker.engine.sampling_params import SamplingParams
from gpu_worker.engine.sequence import Sequence
from gpu_worker.engine.speculative import SpecDecodeStats
from gpu_worker.engine.step_metrics import EngineStats, IterationTokens
from gpu_worker.engine.step_scheduler import StepSchedule, StepScheduler
from gpu_worker.engine.structured_output import GrammarCache, advance


class LLMEngine:
    """The model, the KV pool and the step scheduler of one worker; callers add requests and call step()."""

    def __init__(
        self,
        model: str | None = None,
        config: EngineConfig | None = None,
        *,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        runner: StepRunner | None = None,
    ) -> None:
        """An engine over model (default: SmolLM2-135M-Instruct) loaded in dtype on device, or over runner,
        which then decides the model, the device and the pool (the simulator's step-time model)."""
        config = config or EngineConfig()
        self.runner = runner or ModelRunner.load(model, config, dtype=dtype, device=device)
        self.device, self.dtype = self.runner.device, self.runner.dtype
        self.tokenizer: Any = self.runner.tokenizer  # None under a runner with no model
        self.config = config
        self.allocator = BlockAllocator(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.max_model_len = self.runner.max_model_len
        self.step_scheduler = StepScheduler(config, self.allocator, self.max_model_len)
        self.sampler = Sampler(self.runner.eos_token_ids)
        self.vocab_size = self.runner.vocab_size
        self.requests: dict[str, list[Sequence]] = {}
        self.beam_searches: dict[str, BeamSearch] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._rng = random.Random(config.seed)
        self.iteration_tokens = IterationTokens()
        self._grammars: GrammarCache | None = None  # built at the first structured request

    # -- requests ---------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        *,
        num_resumed_tokens: int = 0,
    ) -> None:
        """Queue a request; raises RequestRejected (a ValueError) for one that can never run.

        num_resumed_tokens: the last k prompt tokens are output that a sample resumed here (after a failover)
        already streamed; a grammar (params.structured) takes them as its first output tokens.
        """
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._validate(prompt_token_ids, params)
        seq = Sequence(
            next(self._seq_ids),
            request_id,
            prompt_token_ids,
            params,
            priority=priority,
            arrival=next(self._arrivals),
        )
        seq.seed = self._sample_seed(params, 0)
        if params.use_beam_search:
            seq.num_pending_forks = 0  # beams fork as the search goes
            stops = params.stop_ids(self.sampler.eos_token_ids)
            self.beam_searches[request_id] = BeamSearch(seq, stops, self.max_model_len)
        if params.structured is not None:
            seq.matcher = self._structured_matcher(params, prompt_token_ids, num_resumed_tokens)
        self.requests[request_id] = [seq]
        self.step_scheduler.add(seq)

    def _validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        limits = EngineLimits(
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            block_size=self.config.block_size,
            num_blocks=self.allocator.num_blocks,
            max_num_seqs=self.config.max_num_seqs,
            eos_token_ids=frozenset(self.sampler.eos_token_ids),
        )
        check_request(prompt_token_ids, params, limits)

    def _structured_matcher(self, params: SamplingParams, prompt: list[int], num_resumed: int) -> LLMatcher:
        assert params.structured is not None
        if self._grammars is None:  # a simulated engine has no tokenizer: GrammarCache rejects the request
            self._grammars = GrammarCache(self.tokenizer, self.vocab_size, self.sampler.eos_token_ids)
        return self._grammars.matcher(params.structured, prompt, num_resumed)

    def _sample_seed(self, params: SamplingParams, index: int) -> int | None:
        """Sample i of a seeded request draws with seed + i; an unseeded one gets a seed of its own, so that
        its draws too stay the same when it is preempted and recomputed."""
        if params.greedy:
            return None
        return params.seed + index if params.seed is not None else self._rng.getrandbits(63)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its blocks are back in the pool when this returns."""
        self.beam_searches.pop(request_id, None)  # its live beams are the request's sequences
        for seq in self.requests.pop(request_id, []):
            if not seq.is_finished:
                self.step_scheduler.finish(seq, "abort")

    def release(self, request_id: str) -> list[Sequence]:
        """Forget a request whose sequences have all finished, returning them."""
        return self.requests.pop(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.step_scheduler.has_unfinished()

    # -- the step ---------------------------------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """One engine step; returns the sequences that received a token (some of them now finished)."""
        out = self.step_scheduler.schedule()
        if out.is_empty():
            return []
        sample_rows = [
            i
            for i, (seq, n, d) in enumerate(zip(out.seqs, out.num_new_tokens, out.num_draft_tokens))
            if seq.num_computed_tokens + n - d == seq.num_tokens
        ]
        out.prompt_logit_spans = prompt_logit_spans(out)
        logits = self.runner.run(out, sample_rows)
        # Each sample row's logits at its last token, then at each of its drafts (what follows each).
        first_rows: list[int] = []
        verify: list[tuple[Sequence, torch.Tensor]] = []
        row = 0
        for i in sample_rows:
            first_rows.append(row)
            num_draft = out.num_draft_tokens[i]
            if num_draft:
                verify.append((out.seqs[i], logits[row + 1 : row + 1 + num_draft]))
            row += 1 + num_draft
        record_prompt_logprobs(out, logits[row:])
        num_prompt_tokens = _num_prompt_tokens(out)
        self.step_scheduler.update_computed(out)
        sampling = [out.seqs[i] for i in sample_rows]
        sample_logits = logits[first_rows] if verify else logits[: len(sample_rows)]
        for seq in sampling:
            seq.num_step_tokens = 0
        beam_results: list[Sequence] = []
        num_beam_rows = 0
        if self.beam_searches:
            sampling, sample_logits, beam_results = self._advance_beams(sampling, sample_logits)
            num_beam_rows = len(sample_rows) - len(sampling)
        sampled = self._postprocess(sampling, sample_logits)
        self._verify(verify)
        # Tokens computed this step: prompt tokens, the rows that sampled (a live beam's too, though beams
        # return nothing until the search ends) and the drafts verified.
        num_drafts = sum(out.num_draft_tokens)
        self.iteration_tokens.observe(num_prompt_tokens + len(sampled) + num_beam_rows + num_drafts)
        return sampled + beam_results

    def _verify(self, verify: list[tuple[Sequence, torch.Tensor]]) -> None:
        """Keep each sequence's drafts as far as the model agrees with them (speculative module docstring).

        Round j: a sequence whose last sampled token equals its draft j has that draft accepted and samples
        the token after it from the logits at the draft's position; the first token that differs stays in
        its place (a draw from the model, as without speculation) and ends the sequence's run. A sequence
        that accepts every draft samples one token more after them. Then its rejected slots roll back.
        """
        accepted = dict.fromkeys((seq for seq, _ in verify), 0)
        pending = verify
        j = 0
        while pending:
            sampling: list[tuple[Sequence, torch.Tensor]] = []
            for seq, rows in pending:
                matched = seq.token_ids[-1] == seq.draft_token_ids[j]
                accepted[seq] += matched
                if matched and not seq.is_finished:
                    sampling.append((seq, rows))
                else:
                    self.step_scheduler.accept_drafts(seq, accepted[seq])
            if not sampling:
                break
            seqs = [seq for seq, _ in sampling]
            self._append(seqs, self.sampler(torch.stack([rows[j] for _, rows in sampling]), seqs))
            j += 1
            pending = []
            for seq, rows in sampling:
                if j < len(seq.draft_token_ids) and not seq.is_finished:
                    pending.append((seq, rows))
                else:  # every draft accepted (and the token after them sampled), or it finished
                    self.step_scheduler.accept_drafts(seq, accepted[seq])

    def _advance_beams(
        self, sampling: list[Sequence], logits: torch.Tensor
    ) -> tuple[list[Sequence], torch.Tensor, list[Sequence]]:
        """Take the beams' rows out of the step: each gives its beam's candidates, and a request whose live
        beams all have theirs takes a beam step. Returns the other rows and the results of searches that
        ended (beams themselves are never returned)."""
        rows = [i for i, seq in enumerate(sampling) if seq.request_id in self.beam_searches]
        if not rows:
            return sampling, logits, []
        searches = [self.beam_searches[sampling[i].request_id] for i in rows]
        num_top = [sampling[i].params.logprobs for i in rows]
        candidates = beam_candidates(logits[rows], [s.num_candidates for s in searches], num_top)
        for i, search, found in zip(rows, searches, candidates):
            search.add_candidates(sampling[i], found)
        results: list[Sequence] = []
        for search in dict.fromkeys(searches):
            if not search.ready():
                continue  # a sibling is still being recomputed after preemption
            search.step(self.step_scheduler, self._seq_ids)
            if search.done:
                search.free(self.step_scheduler)
                del self.beam_searches[search.request_id]
                self.requests[search.request_id] = search.results(self._seq_ids, time.monotonic())
                results += self.requests[search.request_id]
            else:
                self.requests[search.request_id] = list(search.live)
        keep = sorted(set(range(len(sampling))).difference(rows))
        return [sampling[i] for i in keep], logits[keep], results

    def _postprocess(self, sampling: list[Sequence], logits: torch.Tensor) -> list[Sequence]:
        if not sampling:
            return []  # a step of prefill chunks only
        seqs: list[Sequence] = []
        rows: list[int] = []
        for row, seq in enumerate(sampling):
            seqs.append(seq)
            rows.append(row)
            # n > 1: the siblings are born now, sharing the computed prompt, and sample from the same logits.
            for index in range(1, seq.num_pending_forks + 1):
                child = self.step_scheduler.fork(seq, next(self._seq_ids), index)
                child.seed = self._sample_seed(seq.params, index)
                self.requests[seq.request_id].append(child)
                seqs.append(child)
                rows.append(row)
            seq.num_pending_forks = 0
        if len(rows) != len(sampling):
            logits = logits[rows]
        sampled = self.sampler(logits, seqs)
        self._append(seqs, sampled)
        return seqs

    def _append(self, seqs: list[Sequence], sampled: SamplerOutput) -> None:
        now = time.monotonic()
        for i, seq in enumerate(seqs):
            token = sampled.token_ids[i]
            seq.token_ids.append(token)
            seq.num_step_tokens += 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.last_token_time = now
            if seq.params.logprobs is not None:
                seq.logprobs.append(sampled.logprobs[i] or 0.0)
                seq.top_logprobs.append(sampled.top_logprobs[i] or {})
            reason = self._stop_reason(seq, token)
            if seq.matcher is not None and advance(seq.matcher, token):
                reason = "stop"  # the grammar is complete (or can go no further)
            if reason is not None:
                self.step_scheduler.finish(seq, reason)

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.sampler.eos_token_ids):
            return "stop"
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return "length"
        if seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    # -- stats ------------------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        bs = self.config.block_size
        speculator = self.step_scheduler.speculator
        spec = speculator.stats if speculator is not None else SpecDecodeStats()
        filled: dict[int, int] = {}
        for seq in self.step_scheduler.running:
            for i, block in enumerate(seq.block_table):
                n = max(0, min(bs, seq.num_computed_tokens - i * bs))
                filled[block] = max(filled.get(block, 0), n)
        return EngineStats(
            num_free_blocks=self.allocator.num_free_blocks,
            num_total_blocks=self.allocator.num_blocks,
            block_size=bs,
            num_running=len(self.step_scheduler.running),
            num_waiting=len(self.step_scheduler.waiting),
            num_live_token_slots=sum(filled.values()),
            num_allocated_slots=self.allocator.num_used_blocks * bs,
            prefix_cache_hit_rate=self.allocator.prefix_cache_hit_rate,
            num_preemptions=self.step_scheduler.num_preemptions,
            num_cow_copies=self.allocator.num_cow_copies,
            prefix_cache_queries=self.step_scheduler.num_prefix_cache_queries,
            prefix_cache_hits=self.step_scheduler.num_prefix_cache_hits,
            iteration_tokens_buckets=self.iteration_tokens.cumulative(),
            iteration_tokens_sum=self.iteration_tokens.total,
            spec_num_drafts=spec.num_drafts,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_position=list(spec.accepted_per_position),
        )


def _num_prompt_tokens(out: StepSchedule) -> int:
    """Prompt tokens the step computes (before num_computed_tokens advances past them)."""
    return sum(
        max(0, min(seq.num_computed_tokens + n, seq.num_prompt_tokens) - seq.num_computed_tokens)
        for seq, n in zip(out.seqs, out.num_new_tokens)
    )
