"""Helpers of the engine's tests: the golden questions, and the check that a pool is whole again."""

from __future__ import annotations

from typing import Any

import torch

from gpu_worker import LLM

MAX_NEW_TOKENS = 24

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain photosynthesis in one sentence.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
]


def assert_pool_drained(llm: LLM) -> None:
    stats = llm.stats
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_running == stats.num_waiting == 0
    llm.engine.allocator.check_invariants()


def hf_greedy(model: Any, prompts: list[list[int]], max_new_tokens: int = MAX_NEW_TOKENS) -> list[list[int]]:
    """transformers' generate(), one prompt at a time (no padding), greedy."""
    outputs = []
    for ids in prompts:
        input_ids = torch.tensor([ids])
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
        outputs.append(out[0, len(ids) :].tolist())
    return outputs
