"""What the engine checks of a request before it queues it: the one place a request that can never run is
refused (RequestRejected, with the code the client sees)."""

from __future__ import annotations

from dataclasses import dataclass

from gpu_worker.engine.beam_search import validate_beam_search
from gpu_worker.engine.sampling_params import SamplingParams
from shared.errors import ErrorCode, RequestRejected


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What bounds a request on one engine."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    max_num_seqs: int
    eos_token_ids: frozenset[int]


def check_request(prompt_token_ids: list[int], params: SamplingParams, limits: EngineLimits) -> None:
    """Raise RequestRejected for a request this engine can never run."""
    if not prompt_token_ids:
        raise RequestRejected(ErrorCode.INVALID_REQUEST, "the prompt is empty")
    vocab_size, max_model_len = limits.vocab_size, limits.max_model_len
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:
        raise RequestRejected(ErrorCode.INVALID_REQUEST, f"prompt token ids must be in [0, {vocab_size})")
    if len(prompt_token_ids) >= max_model_len:
        raise RequestRejected(
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            f"the prompt has {len(prompt_token_ids)} tokens; the model's context is {max_model_len}",
        )
    max_len = min(len(prompt_token_ids) + (params.max_tokens or max_model_len), max_model_len)
    if params.use_beam_search:
        validate_beam_search(params, max_len, limits.num_blocks, limits.block_size, limits.max_num_seqs)
    if -(-max_len // limits.block_size) > limits.num_blocks:
        raise RequestRejected(
            ErrorCode.KV_CAPACITY_EXCEEDED,
            f"{max_len} tokens do not fit in the KV pool of {limits.num_blocks} blocks",
        )
    named = [*params.logit_bias, *(params.allowed_token_ids or [])]
    if named and (min(named) < 0 or max(named) >= vocab_size):
        raise RequestRejected(
            ErrorCode.INVALID_REQUEST, f"logit_bias and allowed_token_ids take token ids in [0, {vocab_size})"
        )
    allowed, stops = params.allowed_token_ids, params.stop_ids(limits.eos_token_ids)
    if params.min_tokens and allowed is not None and stops.issuperset(allowed):
        raise RequestRejected(
            ErrorCode.INVALID_REQUEST, "min_tokens asks for tokens that allowed_token_ids only stops"
        )
