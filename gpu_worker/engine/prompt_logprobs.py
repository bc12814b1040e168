"""Prompt logprobs: which prompt positions of a step need logits, and what their logits say."""

from __future__ import annotations

import torch

from gpu_worker.engine.step_scheduler import StepSchedule


def prompt_logit_spans(out: StepSchedule) -> list[tuple[int, int, int]]:
    """(row, first token of the chunk, count) for each scheduled sequence whose chunk holds prompt positions
    still without a logprob. Position j gives the logprob of prompt token j + 1; the last prompt position
    predicts the first output token and is the sampling row, so it is never one of them."""
    spans: list[tuple[int, int, int]] = []
    for i, (seq, num_new) in enumerate(zip(out.seqs, out.num_new_tokens)):
        if not seq.needs_prompt_logprobs:
            continue
        start = seq.num_computed_tokens
        # A sequence recomputed after preemption goes over positions it already has.
        first = max(start, len(seq.prompt_logprobs))
        end = min(start + num_new, seq.num_prompt_tokens - 1)
        if end > first:
            spans.append((i, first - start, end - first))
    return spans


def record_prompt_logprobs(out: StepSchedule, logits: torch.Tensor) -> None:
    """Append to each sequence of out.prompt_logit_spans its prompt tokens' logprobs and top-k, from the
    logits at those positions (`[span tokens, vocab_size]`, in span order), in float32; before
    num_computed_tokens advances."""
    if not out.prompt_logit_spans:
        return
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets: list[int] = []
    for i, first, count in out.prompt_logit_spans:
        seq = out.seqs[i]
        position = seq.num_computed_tokens + first
        assert position == len(seq.prompt_logprobs), "prompt logprobs must be computed in order"
        targets += seq.token_ids[position + 1 : position + 1 + count]
    chosen = logprobs.gather(1, torch.tensor(targets, device=logits.device).unsqueeze(1)).squeeze(1).tolist()
    max_k = min(
        max(out.seqs[i].params.prompt_logprobs or 0 for i, _, _ in out.prompt_logit_spans), logits.shape[-1]
    )
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    if max_k > 0:
        values, ids = logprobs.topk(max_k, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    row = 0
    for i, _, count in out.prompt_logit_spans:
        seq = out.seqs[i]
        k = seq.params.prompt_logprobs or 0
        seq.prompt_logprobs += chosen[row : row + count]
        for r in range(row, row + count):
            seq.prompt_top_logprobs.append(dict(zip(top_ids[r][:k], top_values[r][:k])) if k else {})
        row += count
