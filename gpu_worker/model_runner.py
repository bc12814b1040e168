"""Model runner: builds one step's flat batch and runs the model over the paged KV pool."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from gpu_worker.attention import AttentionMetadata
from gpu_worker.kv_cache import KVCache
from gpu_worker.packed_linear import pack_linears
from gpu_worker.step_scheduler import StepSchedule


class ModelRunner:
    """One forward per step over all scheduled tokens, no padding; logits only where a token is sampled
    (and at the prompt positions of sequences that asked for prompt logprobs)."""

    def __init__(self, model: PreTrainedModel, kv_cache: KVCache) -> None:
        pack_linears(model)
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = kv_cache.kv_cache.device

    @torch.inference_mode()
    def run(self, out: StepSchedule, sample_rows: list[int]) -> torch.Tensor:
        """Logits at the last new token of each sequence in sample_rows, then at every token of
        out.prompt_logit_spans in order: `[len(sample_rows) + span tokens, vocab_size]`."""
        self.kv_cache.copy_blocks(out.copy_pairs)
        input_ids: list[int] = []
        starts: list[int] = []
        seq_lens: list[int] = []
        for seq, num_new in zip(out.seqs, out.num_new_tokens):
            start = seq.num_computed_tokens
            input_ids += seq.token_ids[start : start + num_new]
            starts.append(start)
            seq_lens.append(start + num_new)
        meta, positions = self._metadata(out, starts, seq_lens)
        query_start_loc = meta.query_start_loc.tolist()
        keep = [query_start_loc[i + 1] - 1 for i in sample_rows]
        for i, first, count in out.prompt_logit_spans:
            keep += range(query_start_loc[i] + first, query_start_loc[i] + first + count)
        logits_indices = torch.tensor(keep, dtype=torch.long, device=self.device)
        result = self.model(
            input_ids=torch.tensor([input_ids], device=self.device),
            position_ids=positions.unsqueeze(0),
            use_cache=False,
            paged_metadata=meta,
            logits_to_keep=logits_indices,
        )
        return result.logits[0]

    def _metadata(
        self, out: StepSchedule, starts: list[int], seq_lens: list[int]
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        device = self.device
        num_new = torch.tensor(out.num_new_tokens, device=device)
        max_blocks = max(len(seq.block_table) for seq in out.seqs)
        block_table = torch.tensor(
            [seq.block_table + [-1] * (max_blocks - len(seq.block_table)) for seq in out.seqs],
            dtype=torch.int32,
            device=device,
        )
        query_start_loc = torch.zeros(len(out.seqs) + 1, dtype=torch.int32, device=device)
        torch.cumsum(num_new, dim=0, out=query_start_loc[1:])
        # Position of every token: its sequence's start plus its offset within the sequence's chunk.
        seq_index = torch.repeat_interleave(torch.arange(len(out.seqs), device=device), num_new)
        offsets = torch.arange(seq_index.numel(), device=device) - query_start_loc[seq_index].long()
        positions = torch.tensor(starts, device=device)[seq_index] + offsets
        blocks = block_table[seq_index, positions // self.block_size].long()
        slot_mapping = blocks * self.block_size + positions % self.block_size
        meta = AttentionMetadata(
            kv_caches=self.kv_cache.layers,
            slot_mapping=slot_mapping,
            block_table=block_table,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc=query_start_loc,
        )
        return meta, positions
