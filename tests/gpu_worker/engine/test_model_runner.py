"""The model runner's step metadata: each new token's position, and the cache slot its K and V go to."""

from __future__ import annotations

import itertools

import torch

from gpu_worker import LLM
from gpu_worker.engine.sampling_params import SamplingParams
from gpu_worker.engine.sequence import Sequence
from gpu_worker.engine.step_scheduler import StepSchedule


def test_each_new_token_gets_its_position_and_a_slot_in_its_block(llm: LLM) -> None:
    """Chunks that start and end inside a block and cross several, beside one-token decodes: token p of a
    sequence goes to slot block_table[p // block_size] * block_size + p % block_size."""
    runner = llm.engine.runner
    size = runner.block_size
    # (cached tokens, new tokens, the sequence's blocks)
    rows = [
        (0, 3 * size + 5, [7, 3, 9, 4]),
        (size - 1, 1, [5]),
        (size + 3, 2 * size, [11, 2, 8, 6]),
        (2 * size, 1, [1, 0, 12]),
    ]
    schedule = StepSchedule()
    for i, (start, new, table) in enumerate(rows):
        seq = Sequence(i, f"metadata-{i}", list(range(start + new)), SamplingParams())
        seq.block_table = table
        schedule.seqs.append(seq)
        schedule.num_new_tokens.append(new)
        schedule.num_draft_tokens.append(0)
    starts = [start for start, _, _ in rows]
    ends = [start + new for start, new, _ in rows]
    query_start_loc = list(itertools.accumulate(schedule.num_new_tokens, initial=0))
    meta, positions = runner._metadata(schedule, starts, ends, query_start_loc)
    assert meta.query_start_loc.tolist() == query_start_loc
    assert positions.tolist() == [p for start, end in zip(starts, ends) for p in range(start, end)]
    assert meta.slot_mapping.tolist() == [
        table[p // size] * size + p % size
        for (_, _, table), start, end in zip(rows, starts, ends)
        for p in range(start, end)
    ]
    assert positions.dtype == meta.slot_mapping.dtype == torch.long
