"""Step scheduler: decides which sequences run this step and how many of their tokens."""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from gpu_worker.engine.block_allocator import BlockAllocator
from gpu_worker.engine.config import EngineConfig
from gpu_worker.engine.sequence import Sequence, SequenceStatus
from gpu_worker.engine.speculative import NgramSpeculator


@dataclass(slots=True)
class StepSchedule:
    """One step's work: sequences with the number of new tokens each computes, and CoW copies to do first."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    copy_pairs: list[tuple[int, int]] = field(default_factory=list)
    # Per row: how many of its new tokens are drafts to verify (seq.draft_token_ids), after its last token.
    num_draft_tokens: list[int] = field(default_factory=list)
    # (row in seqs, first token of its chunk, count): chunk tokens whose logits prompt logprobs need.
    prompt_logit_spans: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def is_empty(self) -> bool:
        return not self.seqs


class StepScheduler:
    """Continuous batching under a token budget: running sequences first, then waiting ones in priority order.

    One rule covers prefill, chunked prefill, prefix-cache hits and recompute after preemption: each step a
    sequence computes up to `num_tokens - num_computed_tokens` tokens, as the budget allows.
    """

    def __init__(
        self, config: EngineConfig, allocator: BlockAllocator, max_model_len: int | None = None
    ) -> None:
        self.config = config
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.max_model_len = max_model_len
        spec = config.speculative_config
        self.speculator = NgramSpeculator(spec) if spec is not None else None
        # Both lists stay sorted by Sequence.sort_key, so the tail of `running` is the preemption victim.
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Prompt tokens of new sequences looked up in the prefix cache, and found there.
        self.num_prefix_cache_queries = 0
        self.num_prefix_cache_hits = 0

    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=Sequence.sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepSchedule:
        out = StepSchedule()
        budget = self.config.max_num_batched_tokens
        num_preemptions = self.num_preemptions
        budget = self._schedule_running(out, budget)
        out.num_draft_tokens = [0] * len(out.seqs)
        if self.speculator is not None and len(out.seqs) < self.speculator.config.disable_by_batch_size:
            budget = self._add_drafts(out, budget)
        # NOTE: after a preemption the pool is full; admitting now would only readmit the victim and
        # recompute what it just dropped.
        if self.num_preemptions == num_preemptions:
            self._schedule_waiting(out, budget)
            if out.is_empty() and self.waiting and self.running:
                # Every running sequence is a beam waiting for a sibling, and no waiting one fits: free the
                # lowest-priority beam's blocks so that the next step admits one (the victim recomputes).
                self._preempt(self.running[-1])
        return out

    def _schedule_running(self, out: StepSchedule, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new == 0:
                i += 1  # a beam holding its candidates until its siblings have theirs
                continue
            if not self._reserve_or_preempt(seq, num_new):
                break  # seq itself was the lowest-priority one and is now waiting
            out.copy_pairs += self.allocator.append_slots(
                seq.block_table, seq.num_computed_tokens, seq.num_computed_tokens + num_new
            )
            out.seqs.append(seq)
            out.num_new_tokens.append(num_new)
            budget -= num_new
            i += 1
        return budget

    def _add_drafts(self, out: StepSchedule, budget: int) -> int:
        """Give each decoding sequence its drafts to verify, as the budget and the free blocks allow (a draft
        never preempts anything: without blocks to spare, only the slots its last block has left)."""
        assert self.speculator is not None
        self.speculator.begin_step(len(out.seqs))
        for i, seq in enumerate(out.seqs):
            if budget <= 0:
                break
            if out.num_new_tokens[i] != 1 or not self._may_draft(seq):
                continue
            limit = budget
            if seq.params.max_tokens is not None:
                limit = min(limit, seq.params.max_tokens - seq.num_output_tokens - 1)
            if self.max_model_len is not None:
                limit = min(limit, self.max_model_len - seq.num_tokens - 1)
            if limit <= 0:
                continue
            seq.spec, drafts = self.speculator.propose(seq.spec, seq.token_ids, limit)
            if drafts and seq.matcher is not None:  # the grammar checks the proposal first
                drafts = drafts[: seq.matcher.validate_tokens(drafts)]
            if not drafts:
                continue
            end = seq.num_tokens  # the last token's slot is allocated already
            need = self.allocator.num_blocks_to_append(seq.block_table, end, end + len(drafts))
            if not self.allocator.can_allocate(need):
                drafts = drafts[: len(seq.block_table) * self.block_size - end]
                if not drafts:
                    continue
            out.copy_pairs += self.allocator.append_slots(seq.block_table, end, end + len(drafts))
            seq.draft_token_ids = drafts
            out.num_new_tokens[i] += len(drafts)
            out.num_draft_tokens[i] = len(drafts)
            budget -= len(drafts)
        return budget

    @staticmethod
    def _may_draft(seq: Sequence) -> bool:
        """A sample decoding one token at a time (no beams, no sibling still to fork)."""
        return (
            seq.num_output_tokens > 0
            and seq.num_computed_tokens == seq.num_tokens - 1
            and not seq.params.use_beam_search
            and seq.num_pending_forks == 0
        )

    def accept_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """After a verify: the accepted drafts are computed tokens now; the rejected ones' slots are rolled
        back (the blocks past the sequence's tokens go back to the pool; the slots left in its last block are
        written over later, and only blocks full of accepted tokens enter the prefix cache)."""
        num_draft = len(seq.draft_token_ids)
        seq.draft_token_ids = []
        if seq.spec is not None and self.speculator is not None:
            self.speculator.observe(seq.spec, num_draft, num_accepted)
        if seq.is_finished:
            return  # its blocks are back in the pool
        seq.num_computed_tokens += num_accepted
        self._cache_full_blocks(seq)
        keep = -(-seq.num_tokens // self.block_size)
        if len(seq.block_table) > keep:
            tail = seq.block_table[keep:]
            del seq.block_table[keep:]
            self.allocator.free(tail)

    def _reserve_or_preempt(self, seq: Sequence, num_new: int) -> bool:
        """Preempt from the tail of `running` until `seq` can grow by num_new tokens; False if seq went."""
        while True:
            need = self.allocator.num_blocks_to_append(
                seq.block_table, seq.num_computed_tokens, seq.num_computed_tokens + num_new
            )
            if self.allocator.can_allocate(need):
                return True
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False

    def _schedule_waiting(self, out: StepSchedule, budget: int) -> None:
        if not self.waiting:
            return
        in_flight = self._blocks_in_flight()
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[i]
            # NOTE: prompt logprobs need the logits of every prompt position, so cached blocks are no use.
            if not seq.block_table and not seq.needs_prompt_logprobs:
                self._take_cached_prefix(seq)
                if self._next_block_hashes(seq, 1) & in_flight:
                    # Its next block is being computed by another sequence now: wait and hit the cache
                    # instead of computing the same prefix twice.
                    self._release_prefix(seq)
                    i += 1
                    continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            need = self.allocator.num_blocks_to_append(
                seq.block_table, seq.num_computed_tokens, seq.num_computed_tokens + num_new
            )
            if not self.allocator.can_allocate(need):
                self._release_prefix(seq)
                break
            out.copy_pairs += self.allocator.append_slots(
                seq.block_table, seq.num_computed_tokens, seq.num_computed_tokens + num_new
            )
            self.waiting.pop(i)
            if seq.first_scheduled_time is None:
                self._first_scheduled(seq)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=Sequence.sort_key)
            in_flight |= self._next_block_hashes(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(num_new)
            out.num_draft_tokens.append(0)
            budget -= num_new

    def _first_scheduled(self, seq: Sequence) -> None:
        seq.first_scheduled_time = time.monotonic()
        seq.num_cached_tokens = seq.num_computed_tokens  # what the prefix cache gave it
        if self.allocator.enable_prefix_caching and not seq.needs_prompt_logprobs:
            self.num_prefix_cache_queries += seq.num_prompt_tokens
            self.num_prefix_cache_hits += seq.num_computed_tokens

    def _release_prefix(self, seq: Sequence) -> None:
        """Give back the hit blocks of a sequence that stays waiting; the next attempt looks them up again."""
        self.allocator.free(seq.block_table)
        seq.reset_computed()

    def _next_block_hashes(self, seq: Sequence, limit: int | None = None) -> set[int]:
        """Hashes of the full prompt blocks after those in the prefix cache (at most limit of them)."""
        if not self.allocator.enable_prefix_caching:
            return set()
        end = (seq.num_tokens - 1) // self.block_size
        if limit is not None:
            end = min(end, seq.num_cached_blocks + limit)
        return set(
            self.allocator.block_hashes(seq.token_ids, seq.num_cached_blocks, end, seq.last_block_hash)
        )

    def _blocks_in_flight(self) -> set[int]:
        """Hashes of prompt blocks that running sequences have still to compute."""
        in_flight: set[int] = set()
        for seq in self.running:
            if seq.num_computed_tokens < seq.num_tokens - 1:
                in_flight |= self._next_block_hashes(seq)
        return in_flight

    def _take_cached_prefix(self, seq: Sequence) -> None:
        # NOTE: at least the last token is always computed, since its logits are needed for sampling.
        max_blocks = (seq.num_tokens - 1) // self.block_size
        block_ids, hashes = self.allocator.find_cached_prefix(seq.token_ids, max_blocks)
        if not block_ids:
            return
        self.allocator.take(block_ids)
        seq.block_table = block_ids
        seq.num_cached_blocks = len(block_ids)
        seq.last_block_hash = hashes[-1]
        seq.num_computed_tokens = len(block_ids) * self.block_size

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.free(seq.block_table)
        seq.reset_computed()
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=Sequence.sort_key)
        self.num_preemptions += 1

    def update_computed(self, out: StepSchedule) -> None:
        """After the forward pass: advance num_computed_tokens and publish newly full blocks to the cache."""
        for seq, num_new, num_draft in zip(out.seqs, out.num_new_tokens, out.num_draft_tokens):
            seq.num_computed_tokens += num_new - num_draft  # drafts count once accepted (accept_drafts)
            self._cache_full_blocks(seq)

    def _cache_full_blocks(self, seq: Sequence) -> None:
        num_full = seq.num_computed_tokens // self.block_size
        if num_full > seq.num_cached_blocks:
            seq.last_block_hash = self.allocator.cache_full_blocks(
                seq.block_table, seq.token_ids, seq.num_cached_blocks, num_full, seq.last_block_hash
            )
            seq.num_cached_blocks = num_full

    def fork(self, parent: Sequence, seq_id: int, index: int) -> Sequence:
        """A new running sample sharing every block of `parent` (written later through copy-on-write)."""
        child = parent.fork(seq_id, index, self.allocator.fork(parent.block_table))
        bisect.insort(self.running, child, key=Sequence.sort_key)
        return child

    def finish(self, seq: Sequence, reason: str) -> None:
        """Stop a sequence and return its blocks (full ones stay in the prefix cache)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
