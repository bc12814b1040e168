"""Model runner: builds one step's flat batch and runs the model over the paged KV pool."""

from __future__ import annotations

import itertools
import logging
from typing import Any, Protocol

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

import kernels
from gpu_worker.engine.attention import AttentionMetadata
from gpu_worker.engine.config import EngineConfig
from gpu_worker.engine.kv_cache import KVCache
from gpu_worker.engine.llama_forward import LlamaForward, unsupported_reason
from gpu_worker.engine.model_loader import load_model, resolve_device, resolve_dtype
from gpu_worker.engine.packed_linear import pack_linears, weights_into_huge_pages
from gpu_worker.engine.step_scheduler import StepSchedule

logger = logging.getLogger(__name__)


class StepRunner(Protocol):
    """What runs an engine's steps: a ModelRunner, or the simulator's step-time model (gpu_worker.simulation).
    The engine sizes its block allocator, sampler and limits from it."""

    device: torch.device
    dtype: torch.dtype
    num_blocks: int  # KV blocks in the pool
    max_model_len: int
    vocab_size: int
    eos_token_ids: set[int]
    tokenizer: Any  # None when there is no model (structured outputs are then refused)

    def run(self, out: StepSchedule, sample_rows: list[int]) -> torch.Tensor:
        """Logits for the rows that sample (each: at its last token, then at each of its drafts), then for
        out.prompt_logit_spans."""
        ...


class ModelRunner:
    """One forward per step over all scheduled tokens, no padding; logits only where a token is sampled
    (and at the prompt positions of sequences that asked for prompt logprobs)."""

    def __init__(
        self,
        model: PreTrainedModel,
        kv_cache: KVCache,
        tokenizer: PreTrainedTokenizerBase | None = None,
        max_model_len: int | None = None,
        model_impl: str = "auto",
    ) -> None:
        self.model: nn.Module = _forward_of(model, model_impl)
        self.kv_cache = kv_cache
        self.tokenizer = tokenizer
        self.block_size = kv_cache.block_size
        self.num_blocks = kv_cache.num_blocks
        self.device = kv_cache.kv_cache.device
        self.dtype = kv_cache.kv_cache.dtype
        mc = model.config
        self.vocab_size: int = mc.vocab_size
        self.max_model_len: int = min(max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.eos_token_ids = _eos_token_ids(model, tokenizer)

    @classmethod
    def load(
        cls,
        model: str | None,
        config: EngineConfig,
        *,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
    ) -> ModelRunner:
        """model (default: SmolLM2-135M-Instruct) in dtype on device, over a KV pool sized by config."""
        torch_device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, torch_device)
        hf_model, tokenizer = load_model(model, torch_dtype, torch_device)
        # A first build of the kernels takes a while; done here, it never stalls a step (or a heartbeat).
        kernels.load(torch_device, torch_dtype)
        mc = hf_model.config
        num_kv_heads = mc.num_key_value_heads
        head_size = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
        bs = config.block_size
        block_bytes = KVCache.bytes_per_block(mc.num_hidden_layers, bs, num_kv_heads, head_size, torch_dtype)
        num_blocks = KVCache.num_blocks_for(config, block_bytes, torch_device)
        kv_cache = KVCache(
            mc.num_hidden_layers, num_blocks, bs, num_kv_heads, head_size, torch_dtype, torch_device
        )
        return cls(hf_model, kv_cache, tokenizer, config.max_model_len, config.model_impl)

    @torch.inference_mode()
    def run(self, out: StepSchedule, sample_rows: list[int]) -> torch.Tensor:
        """Logits at the last token of each sequence in sample_rows and at each of its drafts (what the
        tokens after them should be), then at every token of out.prompt_logit_spans in order:
        `[len(sample_rows) + their drafts + span tokens, vocab_size]`."""
        self.kv_cache.copy_blocks(out.copy_pairs)
        input_ids: list[int] = []
        starts: list[int] = []
        seq_lens: list[int] = []
        for seq, num_new, num_draft in zip(out.seqs, out.num_new_tokens, out.num_draft_tokens):
            start = seq.num_computed_tokens
            input_ids += seq.token_ids[start : start + num_new - num_draft]
            if num_draft:
                input_ids += seq.draft_token_ids
            starts.append(start)
            seq_lens.append(start + num_new)
        query_start_loc = list(itertools.accumulate(out.num_new_tokens, initial=0))
        meta, positions = self._metadata(out, starts, seq_lens, query_start_loc)
        keep: list[int] = []
        for i in sample_rows:
            end = query_start_loc[i + 1]
            keep += range(end - 1 - out.num_draft_tokens[i], end)
        for i, first, count in out.prompt_logit_spans:
            keep += range(query_start_loc[i] + first, query_start_loc[i] + first + count)
        logits_indices = torch.tensor(keep, dtype=torch.long, device=self.device)
        ids = torch.tensor(input_ids, device=self.device)
        if isinstance(self.model, LlamaForward):
            return self.model(ids, positions, meta, logits_indices)
        result = self.model(
            input_ids=ids.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            use_cache=False,
            paged_metadata=meta,
            logits_to_keep=logits_indices,
        )
        return result.logits[0]

    def _metadata(
        self, out: StepSchedule, starts: list[int], seq_lens: list[int], query_start_loc: list[int]
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        device, size = self.device, self.block_size
        tables = [seq.block_table for seq in out.seqs]
        max_blocks = max(len(table) for table in tables)
        block_table = torch.tensor(
            [table + [-1] * (max_blocks - len(table)) for table in tables], dtype=torch.int32, device=device
        )
        query_start_loc_t = torch.tensor(query_start_loc, dtype=torch.int32, device=device)
        # Every token's position (its sequence's start plus its offset in the chunk) and the cache slot its K
        # and V go to, in runs of consecutive numbers, one a block: in plain Python a decode step's few tokens
        # cost less than half of what a dozen small tensor ops did (which woke the op threads).
        positions: list[int] = []
        slots: list[int] = []
        for table, start, end in zip(tables, starts, seq_lens):
            positions += range(start, end)
            position = start
            while position < end:
                block, offset = divmod(position, size)
                run = min(size - offset, end - position)
                slot = table[block] * size + offset
                slots += range(slot, slot + run)
                position += run
        positions_t = torch.tensor(positions, dtype=torch.long, device=device)
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        if any(1 < n <= MAX_TOKENS_AS_DECODES for n in out.num_new_tokens):
            block_table, seq_lens_t, query_start_loc_t = _short_chunks_as_decodes(
                out.num_new_tokens, starts, block_table
            )
        meta = AttentionMetadata(
            kv_caches=self.kv_cache.layers,
            slot_mapping=slot_mapping,
            block_table=block_table,
            seq_lens=seq_lens_t,
            query_start_loc=query_start_loc_t,
        )
        return meta, positions_t


# A chunk of at most this many tokens (drafts to verify, a short prompt) attends as that many one-token rows.
MAX_TOKENS_AS_DECODES = 16


def _short_chunks_as_decodes(
    num_new_tokens: list[int], starts: list[int], block_table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention rows of a step whose short chunks are split into one row per token: token j of a chunk
    that starts at position s is a decode over the sequence's blocks with s + j + 1 tokens of context (its
    K/V and those of the chunk before it are written first, so this is the causal mask). The decode kernel
    runs them, where the chunk would go through the pure-torch prefill. Returns the rows' block tables,
    context lengths and query starts, in the step's token order."""
    row_seq: list[int] = []
    row_len: list[int] = []
    row_tokens: list[int] = []
    for i, (n, start) in enumerate(zip(num_new_tokens, starts)):
        if 1 < n <= MAX_TOKENS_AS_DECODES:
            row_seq += [i] * n
            row_len += range(start + 1, start + n + 1)
            row_tokens += [1] * n
        else:
            row_seq.append(i)
            row_len.append(start + n)
            row_tokens.append(n)
    device = block_table.device
    query_start_loc = torch.tensor(list(itertools.accumulate(row_tokens, initial=0)), dtype=torch.int32)
    return (
        block_table[torch.tensor(row_seq, device=device)],
        torch.tensor(row_len, dtype=torch.int32, device=device),
        query_start_loc.to(device),
    )


def _forward_of(model: PreTrainedModel, model_impl: str) -> nn.Module:
    """What runs the steps: pagedserve's Llama forward where it applies (model_impl auto or pagedserve), else
    transformers' model with the paged attention; on the CPU, either with its linear layers packed."""
    reason = unsupported_reason(model)
    if model_impl == "pagedserve" and reason is not None:
        raise ValueError(f"model_impl=pagedserve cannot run this model: {reason}")
    if model_impl != "transformers" and reason is None:
        forward: nn.Module = LlamaForward(model)
    else:
        if model_impl == "auto":
            logger.info("the model runs through transformers: %s", reason)
        pack_linears(model)
        forward = model
    weights_into_huge_pages(forward)
    return forward


def _eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])
