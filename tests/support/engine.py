"""Helpers of the engine's tests: the golden questions, and the check that a pool is whole again."""

from __future__ import annotations

from gpu_worker import LLM

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
