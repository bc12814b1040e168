"""Tests for gpu_worker.engine.step_scheduler.StepScheduler, driven with a BlockAllocator and a fake model."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gpu_worker.engine.block_allocator import BlockAllocator
from gpu_worker.engine.config import EngineConfig
from gpu_worker.engine.sampling_params import SamplingParams
from gpu_worker.engine.sequence import Sequence, SequenceStatus
from gpu_worker.engine.step_scheduler import StepSchedule, StepScheduler

BS = 8


def fake_token(seq: Sequence) -> int:
    """The token the fake model samples next for seq: unique per (sequence, output position)."""
    return 100_000 + 1000 * seq.seq_id + seq.num_output_tokens


def expected_output(seq: Sequence) -> list[int]:
    max_tokens = seq.params.max_tokens
    assert max_tokens is not None
    return [100_000 + 1000 * seq.seq_id + k for k in range(max_tokens)]


def distinct_prompt(tag: int, length: int) -> list[int]:
    """A prompt that shares no full block with any other tag's prompt."""
    return [tag * 1000 + i for i in range(length)]


@dataclass
class StepResult:
    out: StepSchedule
    sampled: list[Sequence]  # sequences that received a token this step (forks included)
    preempted: list[Sequence]  # preempted during the step, in order (some may be readmitted at once)
    admitted: list[Sequence]  # scheduled from the waiting list (readmitted victims included)


@dataclass
class Sim:
    """The engine's step loop with fake_token for the model: schedule -> update -> fork/sample -> finish.

    Every step it checks the scheduler's output and state (budget, sequence bound, ordering, block tables
    against refcounts, allocator invariants).
    """

    num_blocks: int
    max_num_batched_tokens: int = 64
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    config: EngineConfig = field(init=False)
    allocator: BlockAllocator = field(init=False)
    step_scheduler: StepScheduler = field(init=False)
    seqs: list[Sequence] = field(default_factory=list)
    num_steps: int = 0
    forked: bool = False
    max_running_seen: int = 0
    max_batched_seen: int = 0
    # Each sequence's block table as of its latest step, captured before it can finish.
    tables: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.config = EngineConfig(
            block_size=BS,
            num_kv_blocks=self.num_blocks,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_prefix_caching=self.enable_prefix_caching,
        )
        self.allocator = BlockAllocator(self.num_blocks, BS, self.enable_prefix_caching)
        self.step_scheduler = StepScheduler(self.config, self.allocator)
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._victims: list[Sequence] = []
        preempt = self.step_scheduler._preempt

        def record_preempt(seq: Sequence) -> None:
            self._victims.append(seq)
            preempt(seq)

        self.step_scheduler._preempt = record_preempt  # type: ignore[method-assign]

    def add(self, prompt: Seq[int], max_tokens: int, *, priority: int = 0, n: int = 1) -> Sequence:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n)
        seq = Sequence(
            next(self._ids),
            f"req-{len(self.seqs)}",
            list(prompt),
            params,
            priority=priority,
            arrival=next(self._arrivals),
        )
        self.seqs.append(seq)
        self.step_scheduler.add(seq)
        self.check_state()
        return seq

    def step(self) -> StepResult:
        sched = self.step_scheduler
        running_before = list(sched.running)
        waiting_before = list(sched.waiting)
        preemptions_before = sched.num_preemptions
        self._victims.clear()
        out = sched.schedule()
        self.num_steps += 1
        preempted = list(self._victims)
        assert sched.num_preemptions - preemptions_before == len(preempted)
        self.check_output(out)
        admitted = self.check_order(out, running_before, waiting_before, preempted)
        sampling = [
            seq
            for seq, n in zip(out.seqs, out.num_new_tokens, strict=True)
            if seq.num_computed_tokens + n == seq.num_tokens
        ]
        sched.update_computed(out)
        for seq in out.seqs:
            self.tables[seq.seq_id] = list(seq.block_table)
        sampled: list[Sequence] = []
        for seq in sampling:
            sampled.append(seq)
            for index in range(1, seq.num_pending_forks + 1):
                sampled.append(sched.fork(seq, next(self._ids), index))
                self.forked = True
            seq.num_pending_forks = 0
        for seq in sampled:
            seq.token_ids.append(fake_token(seq))
            max_tokens = seq.params.max_tokens
            assert max_tokens is not None
            if seq.num_output_tokens >= max_tokens:
                sched.finish(seq, "length")
        self.seqs.extend(s for s in sampled if s not in self.seqs)
        self.check_state()
        return StepResult(out, sampled, preempted, admitted)

    def run(self, max_steps: int = 2000) -> None:
        while self.step_scheduler.has_unfinished():
            self.step()
            assert self.num_steps <= max_steps, "no progress"

    # -- checks ------------------------------------------------------------------------------------------

    def check_output(self, out: StepSchedule) -> None:
        """Right after schedule(): the batch respects the budget and every table covers its new tokens."""
        assert len(out.seqs) == len(out.num_new_tokens)
        assert len(set(map(id, out.seqs))) == len(out.seqs), "a sequence scheduled twice"
        assert out.num_batched_tokens <= self.config.max_num_batched_tokens
        self.max_batched_seen = max(self.max_batched_seen, out.num_batched_tokens)
        for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
            assert n > 0
            assert seq.status is SequenceStatus.RUNNING and seq in self.step_scheduler.running
            assert seq.num_computed_tokens + n <= seq.num_tokens
            assert len(seq.block_table) * BS >= seq.num_computed_tokens + n
        for src, dst in out.copy_pairs:
            assert src != dst and self.allocator.ref_count(dst) == 1 and self.allocator.ref_count(src) >= 1

    def shares_prefix_in_flight(self, seq: Sequence) -> bool:
        """A running sequence still prefilling holds the same first full block as seq."""
        if not self.step_scheduler.allocator.enable_prefix_caching or (seq.num_tokens - 1) // BS < 1:
            return False
        return any(r.token_ids[:BS] == seq.token_ids[:BS] for r in self.step_scheduler.running)

    def check_order(
        self,
        out: StepSchedule,
        running_before: list[Sequence],
        waiting_before: list[Sequence],
        preempted: list[Sequence],
    ) -> list[Sequence]:
        """After schedule(): running first, waiting in order, victims from the tail; returns the admitted."""
        assert all(v in running_before for v in preempted)
        still_running = [s for s in running_before if s not in preempted]
        num_running_part = sum(s in out.seqs for s in still_running)
        # Running sequences first, in their order; then sequences from the waiting list.
        assert out.seqs[:num_running_part] == [s for s in still_running if s in out.seqs]
        admitted = out.seqs[num_running_part:]
        assert all(s in waiting_before or s in preempted for s in admitted)
        if admitted:
            assert all(s in out.seqs for s in still_running), "waiting admitted before running scheduled"
        # Waiting order: those admitted came before every sequence still waiting, except one held back because
        # a running sequence is computing the same prefix block (it will hit the cache instead).
        for seq in admitted:
            for w in self.step_scheduler.waiting:
                assert seq.sort_key() < w.sort_key() or self.shares_prefix_in_flight(w)
        # Preemption takes the lowest-priority, latest-arrival running sequences and drops their KV cache.
        for victim in preempted:
            assert all(s.sort_key() < victim.sort_key() for s in still_running)
            if victim not in admitted:
                assert victim.status is SequenceStatus.WAITING and victim in self.step_scheduler.waiting
        return admitted

    def check_state(self) -> None:
        """Between steps: lists sorted, tables exactly account for every refcount, allocator consistent."""
        sched, alloc = self.step_scheduler, self.allocator
        alloc.check_invariants()
        assert sched.running == sorted(sched.running, key=Sequence.sort_key)
        assert sched.waiting == sorted(sched.waiting, key=Sequence.sort_key)
        if not self.forked:
            assert len(sched.running) <= self.config.max_num_seqs
        self.max_running_seen = max(self.max_running_seen, len(sched.running))
        refs: Counter[int] = Counter()
        for seq in sched.running:
            assert seq.status is SequenceStatus.RUNNING
            assert seq.num_computed_tokens < seq.num_tokens
            assert len(seq.block_table) == -(-seq.num_computed_tokens // BS)
            if self.enable_prefix_caching:
                assert seq.num_cached_blocks == seq.num_computed_tokens // BS
            refs.update(seq.block_table)
        for seq in sched.waiting:
            assert seq.status is SequenceStatus.WAITING
            assert seq.block_table == [] and seq.num_computed_tokens == 0
        for seq in self.seqs:
            if seq.is_finished:
                assert seq.block_table == [] and seq not in sched.running and seq not in sched.waiting
        assert {b: alloc.ref_count(b) for b in range(alloc.num_blocks) if alloc.ref_count(b)} == dict(refs)
        assert alloc.num_used_blocks == len(refs)

    def check_drained(self) -> None:
        assert not self.step_scheduler.has_unfinished()
        for seq in self.seqs:
            assert seq.is_finished and seq.finish_reason == "length"
            assert seq.output_token_ids == expected_output(seq), f"seq {seq.seq_id}"
        assert self.allocator.num_free_blocks == self.allocator.num_blocks
        assert self.allocator.num_used_blocks == 0
        self.allocator.check_invariants()


# -- budget, bounds and order ----------------------------------------------------------------------------


def test_token_budget_and_max_num_seqs() -> None:
    sim = Sim(num_blocks=64, max_num_batched_tokens=16, max_num_seqs=3)
    for i, (length, max_tokens) in enumerate([(5, 9), (30, 3), (2, 12), (17, 6), (9, 1), (40, 4), (3, 7)]):
        sim.add(distinct_prompt(i, length), max_tokens)
    sim.run()
    sim.check_drained()
    # Both bounds were reached, so the checks in every step were tight.
    assert sim.max_running_seen == 3
    assert sim.max_batched_seen == 16


def test_running_scheduled_before_waiting() -> None:
    sim = Sim(num_blocks=64, max_num_batched_tokens=16)
    a = sim.add(distinct_prompt(0, 3), 10)
    b = sim.add(distinct_prompt(1, 5), 10)
    sim.step()
    assert a.num_output_tokens == b.num_output_tokens == 1
    # A high-priority long prompt still waits for the running decodes; it gets what is left of the budget.
    c = sim.add(distinct_prompt(2, 40), 2, priority=-5)
    res = sim.step()
    assert res.out.seqs == [a, b, c] and res.out.num_new_tokens == [1, 1, 14]
    assert c.num_computed_tokens == 14 and c.num_output_tokens == 0
    sim.run()
    sim.check_drained()


def test_running_decodes_go_before_later_prefill_chunks() -> None:
    sim = Sim(num_blocks=64, max_num_batched_tokens=10)
    a = sim.add(distinct_prompt(0, 4), 8)
    sim.step()
    c = sim.add(distinct_prompt(1, 40), 2)
    for _ in range(3):
        res = sim.step()
        assert res.out.seqs == [a, c] and res.out.num_new_tokens == [1, 9]
    sim.run()
    sim.check_drained()


def test_chunked_prefill() -> None:
    sim = Sim(num_blocks=64, max_num_batched_tokens=8)
    seq = sim.add(distinct_prompt(0, 21), 3)
    computed, outputs = [], []
    for _ in range(3):
        res = sim.step()
        assert res.out.seqs == [seq]
        computed.append(seq.num_computed_tokens)
        outputs.append(seq.num_output_tokens)
    assert computed == [8, 16, 21] and outputs == [0, 0, 1]
    res = sim.step()
    assert res.out.num_new_tokens == [1] and seq.num_output_tokens == 2
    sim.run()
    sim.check_drained()


def test_chunked_prefill_samples_once_with_others_decoding() -> None:
    sim = Sim(num_blocks=64, max_num_batched_tokens=12)
    d = sim.add(distinct_prompt(0, 3), 20)
    sim.step()
    p = sim.add(distinct_prompt(1, 50), 2)
    chunks = []
    while p.num_output_tokens == 0:
        res = sim.step()
        assert res.out.seqs[0] is d and d in res.sampled
        chunks.append(res.out.num_new_tokens[1])
        assert (p in res.sampled) == (p.num_computed_tokens == 50)
    assert chunks == [11, 11, 11, 11, 6]
    sim.run()
    sim.check_drained()


def test_waiting_order_priority_then_arrival() -> None:
    sim = Sim(num_blocks=64, max_num_seqs=1)
    specs = [(1, "low"), (0, "mid-a"), (0, "mid-b"), (-1, "high"), (1, "low-b")]
    names: dict[int, str] = {}
    for i, (priority, name) in enumerate(specs):
        names[sim.add(distinct_prompt(i, 3), 2, priority=priority).seq_id] = name
    order: list[str] = []
    while sim.step_scheduler.has_unfinished():
        res = sim.step()
        order += [names[s.seq_id] for s in res.admitted]
        if len(order) == 2 and "urgent" not in names.values():
            # A late arrival with the top priority jumps the queue.
            names[sim.add(distinct_prompt(9, 3), 2, priority=-2).seq_id] = "urgent"
    assert order == ["high", "mid-a", "urgent", "mid-b", "low", "low-b"]
    sim.check_drained()


# -- preemption ------------------------------------------------------------------------------------------


def test_preemption_of_lowest_priority_latest_arrival() -> None:
    # Three sequences of 1 prompt block growing to 3 blocks each, in a pool of 6.
    sim = Sim(num_blocks=6, max_num_batched_tokens=64)
    y = sim.add(distinct_prompt(0, BS), 2 * BS, priority=1)
    z = sim.add(distinct_prompt(1, BS), 2 * BS, priority=1)
    x = sim.add(distinct_prompt(2, BS), 2 * BS, priority=0)  # latest arrival, but the highest priority
    first: StepResult | None = None
    while first is None:
        tables = {s.seq_id: list(s.block_table) for s in (x, y, z)}
        res = sim.step()
        if res.preempted:
            first = res
    assert first.preempted == [z] and sim.step_scheduler.num_preemptions == 1
    assert z.status is SequenceStatus.WAITING and z in sim.step_scheduler.waiting
    assert z.block_table == [] and z.num_computed_tokens == 0 and z.num_cached_blocks == 0
    assert z.num_output_tokens == BS + 1  # its tokens are kept for recompute
    # Its blocks went back to the pool (some may already be reused by the survivors).
    survivors = set(x.block_table) | set(y.block_table)
    assert all(sim.allocator.ref_count(b) == int(b in survivors) for b in tables[z.seq_id])
    sim.run()
    sim.check_drained()
    assert sim.step_scheduler.num_preemptions >= 1


def test_preempted_sequence_recomputes_before_sampling_again() -> None:
    sim = Sim(num_blocks=5, max_num_batched_tokens=64, enable_prefix_caching=False)
    a = sim.add(distinct_prompt(0, BS), 2 * BS)
    b = sim.add(distinct_prompt(1, BS), 2 * BS)
    while not sim.step().preempted:
        pass
    assert b.status is SequenceStatus.WAITING
    tokens_at_preemption = list(b.token_ids)
    while b.status is SequenceStatus.WAITING:
        sim.step()
    # Readmitted: the whole history (prompt + output so far) is recomputed in one go, then one token follows.
    assert b.token_ids == [*tokens_at_preemption, fake_token_at(b, len(tokens_at_preemption) - BS)]
    assert b.num_computed_tokens == len(tokens_at_preemption)
    sim.run()
    sim.check_drained()
    assert a.output_token_ids == expected_output(a)


def fake_token_at(seq: Sequence, output_index: int) -> int:
    return 100_000 + 1000 * seq.seq_id + output_index


def test_preempted_sequence_is_not_readmitted_in_the_same_step() -> None:
    # A decodes in 2 blocks; B (lower priority) is mid-prefill with 8 of 20 prompt tokens in 1 block; pool 4.
    sim = Sim(num_blocks=4, max_num_batched_tokens=16, enable_prefix_caching=False)
    sim.add(distinct_prompt(0, BS), BS)
    b = sim.add(distinct_prompt(1, 20), 1, priority=1)
    sim.step()
    assert b.num_computed_tokens == BS
    thrash: list[int] = []  # steps where B was preempted and then scheduled again at once
    recomputed = 0
    while sim.step_scheduler.has_unfinished():
        computed_before = b.num_computed_tokens
        res = sim.step()
        if b in res.preempted and b in res.out.seqs:
            thrash.append(sim.num_steps)
            recomputed += computed_before
    sim.check_drained()
    # Today: B's next chunk (12 tokens, 2 blocks) never fits next to A, so every step B preempts itself
    # (1 free block), is readmitted with a 15-token recompute chunk (2 blocks) and computes nothing new:
    # 7 preemptions and 8 + 6 x 15 = 98 dropped tokens recomputed while A decodes.
    assert thrash == [], f"B preempted and readmitted at steps {thrash}, {recomputed} tokens recomputed"


def test_everyone_completes_under_pressure() -> None:
    sim = Sim(num_blocks=7, max_num_batched_tokens=24, max_num_seqs=8)
    for i in range(8):
        sim.add(distinct_prompt(i, 3 + 5 * i % 13), 4 + 7 * i % 19, priority=i % 3)
    sim.run()
    sim.check_drained()
    assert sim.step_scheduler.num_preemptions > 0


# -- prefix cache ----------------------------------------------------------------------------------------


def _run_one(sim: Sim, prompt: list[int], max_tokens: int) -> tuple[Sequence, list[int]]:
    """Run one sequence to completion alone; return it and its last block table."""
    seq = sim.add(prompt, max_tokens)
    while not seq.is_finished:
        sim.step()
    return seq, sim.tables[seq.seq_id]


def test_prefix_cache_hit_shares_blocks() -> None:
    sim = Sim(num_blocks=32)
    base = distinct_prompt(0, 3 * BS + 2)
    _, table = _run_one(sim, base, 1)
    second = sim.add(base[: 3 * BS] + distinct_prompt(1, 3), 2)
    res = sim.step()
    assert res.out.seqs == [second] and res.out.num_new_tokens == [3]
    assert second.block_table[:3] == table[:3]
    assert second.num_computed_tokens == 3 * BS + 3 and second.num_output_tokens == 1
    assert sim.allocator.num_prefix_hits == 3
    sim.run()
    sim.check_drained()


def test_prefix_cache_hit_visible_at_schedule_time() -> None:
    sim = Sim(num_blocks=32)
    base = distinct_prompt(0, 3 * BS + 2)
    _run_one(sim, base, 1)
    second = sim.add([*base[: 3 * BS], 7], 1)
    out = sim.step_scheduler.schedule()
    assert second.num_computed_tokens == 3 * BS and out.num_new_tokens == [1]
    sim.step_scheduler.update_computed(out)
    sim.step_scheduler.finish(second, "length")
    sim.allocator.check_invariants()
    assert sim.allocator.num_free_blocks == sim.allocator.num_blocks


def test_prefix_hit_while_owner_is_running() -> None:
    sim = Sim(num_blocks=32)
    base = distinct_prompt(0, 2 * BS + 5)
    first = sim.add(base, 6)
    sim.step()
    second = sim.add([*base[: 2 * BS], 1, 2], 3)
    res = sim.step()
    assert res.out.num_new_tokens == [1, 2]
    assert second.block_table[:2] == first.block_table[:2]
    assert [sim.allocator.ref_count(b) for b in first.block_table[:2]] == [2, 2]
    sim.run()
    sim.check_drained()


def test_shared_prefix_arriving_together_is_computed_once() -> None:
    sim = Sim(num_blocks=64)
    prefix = distinct_prompt(0, 4 * BS)
    first = sim.add([*prefix, 1, 2, 3], 10)
    second = sim.add([*prefix, 4, 5], 2)
    other = sim.add(distinct_prompt(9, 2 * BS), 2)
    res = sim.step()
    # The second waits while the first computes the shared blocks; a later arrival with nothing in common
    # goes ahead of it.
    assert res.out.seqs == [first, other] and second in sim.step_scheduler.waiting
    res = sim.step()
    assert second in res.admitted and second.block_table[:4] == first.block_table[:4]
    assert sim.allocator.num_prefix_hits >= 4
    sim.run()
    sim.check_drained()


def test_prefix_cache_counters_count_each_new_sequence_once() -> None:
    sim = Sim(num_blocks=64)
    prefix = distinct_prompt(0, 4 * BS)
    first = sim.add([*prefix, 1, 2, 3], 10)
    second = sim.add([*prefix, 4, 5], 2)
    other = sim.add(distinct_prompt(9, 2 * BS), 2)
    sim.step()
    assert second in sim.step_scheduler.waiting and second.num_cached_tokens is None
    sim.run()
    sim.check_drained()
    # The second looked its prefix up twice (the first time it stayed waiting) but counts once.
    assert (first.num_cached_tokens, second.num_cached_tokens, other.num_cached_tokens) == (0, 4 * BS, 0)
    assert sim.step_scheduler.num_prefix_cache_queries == (4 * BS + 3) + (4 * BS + 2) + 2 * BS
    assert sim.step_scheduler.num_prefix_cache_hits == 4 * BS
    assert all(s.first_scheduled_time is not None for s in (first, second, other))


def test_a_sequence_that_needs_prompt_logprobs_takes_no_cached_prefix() -> None:
    sim = Sim(num_blocks=32)
    prompt = distinct_prompt(0, 2 * BS + 3)
    _run_one(sim, prompt, 1)
    queries = sim.step_scheduler.num_prefix_cache_queries
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    seq = Sequence(99, "pl", prompt, params, arrival=99)
    sched = sim.step_scheduler
    sched.add(seq)
    out = sched.schedule()
    assert out.seqs == [seq] and out.num_new_tokens == [len(prompt)] and seq.num_cached_tokens == 0
    assert sched.num_prefix_cache_queries == queries  # nothing was looked up
    sched.update_computed(out)
    sched.finish(seq, "length")
    sim.allocator.check_invariants()
    assert sim.allocator.num_free_blocks == sim.allocator.num_blocks


@pytest.mark.parametrize("num_blocks_in_prompt", [1, 3])
def test_block_aligned_prompt_still_computes_its_last_token(num_blocks_in_prompt: int) -> None:
    sim = Sim(num_blocks=32)
    prompt = distinct_prompt(0, num_blocks_in_prompt * BS)
    _, table = _run_one(sim, [*prompt, 5, 6], 1)
    again = sim.add(prompt, 2)
    res = sim.step()
    # All full blocks are cached, but the last one is recomputed so that its logits exist.
    assert res.out.num_new_tokens == [BS]
    assert again.block_table[: num_blocks_in_prompt - 1] == table[: num_blocks_in_prompt - 1]
    assert again.num_output_tokens == 1
    sim.run()
    sim.check_drained()


def test_same_prompt_repeated_hits_all_but_last_token() -> None:
    sim = Sim(num_blocks=32)
    prompt = distinct_prompt(0, 2 * BS + 3)
    _run_one(sim, prompt, 1)
    again = sim.add(prompt, 1)
    res = sim.step()
    assert res.out.num_new_tokens == [3] and again.is_finished
    sim.check_drained()


def test_prefix_cache_disabled_computes_everything() -> None:
    sim = Sim(num_blocks=32, enable_prefix_caching=False)
    prompt = distinct_prompt(0, 3 * BS + 2)
    _run_one(sim, prompt, 1)
    sim.add(prompt, 1)
    assert sim.step().out.num_new_tokens == [3 * BS + 2]
    sim.check_drained()


# -- fork and copy-on-write ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4])
def test_fork_shares_blocks_and_cow_copies_partial_block(n: int) -> None:
    sim = Sim(num_blocks=64)
    parent = sim.add(distinct_prompt(0, BS + 3), 5, n=n)
    res = sim.step()
    children = res.sampled[1:]
    assert res.sampled[0] is parent and len(children) == n - 1
    assert all(c.block_table == parent.block_table for c in children)
    assert [sim.allocator.ref_count(b) for b in parent.block_table] == [n, n]
    assert all(c.num_computed_tokens == parent.num_computed_tokens == BS + 3 for c in children)
    full, partial = parent.block_table
    res = sim.step()
    # Every writer of the shared partial block but the last gets its own copy.
    assert len(res.out.copy_pairs) == n - 1
    assert all(src == partial for src, _ in res.out.copy_pairs)
    dsts = [dst for _, dst in res.out.copy_pairs]
    assert len(set(dsts)) == n - 1 and partial not in dsts
    tails = [s.block_table[1] for s in res.sampled]
    assert sorted(tails) == sorted([*dsts, partial])
    assert sim.allocator.ref_count(partial) == 1 and sim.allocator.ref_count(full) == n
    assert sim.step().out.copy_pairs == []
    sim.run()
    sim.check_drained()


def test_fork_at_block_boundary_needs_no_copy() -> None:
    sim = Sim(num_blocks=64)
    parent = sim.add(distinct_prompt(0, 2 * BS), 3, n=3)
    sim.step()
    res = sim.step()
    assert res.out.copy_pairs == []
    shared = parent.block_table[:2]
    assert [sim.allocator.ref_count(b) for b in shared] == [3, 3]
    assert len({s.block_table[2] for s in res.out.seqs}) == 3
    sim.run()
    sim.check_drained()


# -- random workloads ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arrival:
    gap: int  # steps run before this request arrives
    prompt: list[int]
    max_tokens: int
    priority: int
    n: int


@dataclass(frozen=True)
class Workload:
    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    enable_prefix_caching: bool
    arrivals: list[Arrival]


@st.composite
def workloads(draw: st.DrawFn, max_n: int = 1) -> Workload:
    """Random requests (many sharing prompt prefixes) against a pool that fits the longest one alone."""
    base = distinct_prompt(99, 48)
    arrivals: list[Arrival] = []
    longest = 0
    for i in range(draw(st.integers(1, 10))):
        length = draw(st.integers(1, 40))
        shared = draw(st.sampled_from([0, 0, BS, 2 * BS, 3 * BS, length]))
        prompt = base[: min(shared, length)] + distinct_prompt(i, length - min(shared, length))
        max_tokens = draw(st.integers(1, 24))
        gap, priority, n = draw(st.integers(0, 4)), draw(st.integers(0, 2)), draw(st.integers(1, max_n))
        arrivals.append(Arrival(gap, prompt, max_tokens, priority, n))
        longest = max(longest, length + max_tokens)
    min_blocks = -(-longest // BS)
    return Workload(
        num_blocks=draw(st.integers(min_blocks, min_blocks + 12)),
        max_num_batched_tokens=draw(st.integers(1, 48)),
        max_num_seqs=draw(st.integers(1, 6)),
        enable_prefix_caching=draw(st.booleans()),
        arrivals=arrivals,
    )


def run_workload(w: Workload) -> Sim:
    sim = Sim(w.num_blocks, w.max_num_batched_tokens, w.max_num_seqs, w.enable_prefix_caching)
    for a in w.arrivals:
        for _ in range(a.gap):
            if sim.step_scheduler.has_unfinished():
                sim.step()
        sim.add(a.prompt, a.max_tokens, priority=a.priority, n=a.n)
    sim.run(max_steps=3000)
    sim.check_drained()
    event(f"preempted: {sim.step_scheduler.num_preemptions > 0}")
    event(f"prefix hits: {sim.allocator.num_prefix_hits > 0}")
    event(f"copy-on-write: {sim.allocator.num_cow_copies > 0}")
    return sim


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_complete_and_drain(workload: Workload) -> None:
    sim = run_workload(workload)
    assert len(sim.seqs) == len(workload.arrivals)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(max_n=3))
def test_random_workloads_with_parallel_samples(workload: Workload) -> None:
    sim = run_workload(workload)
    assert len(sim.seqs) == sum(a.n for a in workload.arrivals)
