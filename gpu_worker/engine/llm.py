"""Offline API in the style of vLLM: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from gpu_worker.engine.beam_search import BeamSearchParams
from gpu_worker.engine.config import EngineConfig
from gpu_worker.engine.llm_engine import EngineStats, LLMEngine
from gpu_worker.engine.sampling_params import SamplingParams
from gpu_worker.engine.sequence import Sequence

Prompt = str | list[int]
Message = dict[str, str]


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None  # per token: the chosen id and the top-k alternatives
    cumulative_logprob: float | None = None


@dataclass(slots=True)
class RequestOutput:
    """The result for one prompt: its tokens and one CompletionOutput per sample."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    # Per prompt token (None for the first): its logprob and the top-k alternatives, when asked for.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam of `LLM.beam_search`: output tokens, text, cumulative logprob and length-penalized score."""

    tokens: list[int]
    text: str
    cum_logprob: float
    score: float
    finish_reason: str | None
    logprobs: list[float]


@dataclass(slots=True)
class BeamSearchOutput:
    """The beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


class LLM:
    """An engine in this process. `LLM()` serves the default model, SmolLM2-135M-Instruct."""

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        **engine_options: Any,
    ) -> None:
        """engine_options are EngineConfig fields: block_size, num_kv_blocks, kv_cache_memory_bytes, ..."""
        self.engine = LLMEngine(model, EngineConfig(**engine_options), dtype=dtype, device=device)
        self._request_ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats()

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete each prompt (a string, or a list of token ids) as it is; no chat template is applied."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompt_list)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompt_list):
            raise ValueError("give one SamplingParams, or one per prompt")
        tokenizer = self.engine.tokenizer
        requests: list[tuple[str, str | None, list[int]]] = []
        try:
            for prompt, p in zip(prompt_list, params):
                ids = (
                    tokenizer.encode(prompt, add_special_tokens=False)
                    if isinstance(prompt, str)
                    else list(prompt)
                )
                request_id = str(next(self._request_ids))
                self.engine.add_request(request_id, ids, p)
                requests.append((request_id, prompt if isinstance(prompt, str) else None, ids))
        except Exception:
            for request_id, _, _ in requests:
                self.engine.abort_request(request_id)
            raise
        self._run(len(requests), use_tqdm)
        return [self._output(*r) for r in requests]

    def beam_search(
        self, prompts: Prompt | Seq[Prompt], params: BeamSearchParams, *, use_tqdm: bool = True
    ) -> list[BeamSearchOutput]:
        """Beam search over each prompt as it is, like vLLM's LLM.beam_search: every beam, best first."""
        outputs = self.generate(prompts, params.sampling_params(), use_tqdm=use_tqdm)
        results = []
        for out in outputs:
            beams = []
            for c in out.outputs:
                cum = c.cumulative_logprob or 0.0
                score = cum / len(c.token_ids) ** params.length_penalty
                logprobs = [lp[t] for t, lp in zip(c.token_ids, c.logprobs or [])]
                beams.append(BeamSearchSequence(c.token_ids, c.text, cum, score, c.finish_reason, logprobs))
            results.append(BeamSearchOutput(beams))
        return results

    def chat(
        self,
        messages: str | list[Message] | list[list[Message]] | list[str],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the chat template to each conversation (a string is one user message), then generate."""
        items: list[Any] = (
            [messages] if isinstance(messages, str) or isinstance(messages[0], dict) else messages
        )
        tokenizer = self.engine.tokenizer
        prompts: list[Prompt] = []
        for item in items:
            conversation = [{"role": "user", "content": item}] if isinstance(item, str) else item
            encoded: Any = tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=True, return_dict=True
            )
            prompts.append(list(encoded["input_ids"]))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, num_requests: int, use_tqdm: bool) -> None:
        # The bar appears only when a call takes more than a moment.
        bar = tqdm(total=num_requests, desc="generate", unit="req", delay=1.0, disable=not use_tqdm)
        done = 0
        with bar:
            while self.engine.has_unfinished_requests():
                for seq in self.engine.step():
                    if seq.is_finished and seq.index == 0:
                        done += 1
                        bar.update(1)

    def _output(self, request_id: str, prompt: str | None, prompt_ids: list[int]) -> RequestOutput:
        seqs = sorted(self.engine.release(request_id), key=lambda s: s.index)
        first = seqs[0]
        prompt_logprobs: list[dict[int, float] | None] | None = None
        if first.params.prompt_logprobs is not None:
            prompt_logprobs = [None]
            for token, lp, top in zip(prompt_ids[1:], first.prompt_logprobs, first.prompt_top_logprobs):
                prompt_logprobs.append({token: lp, **top})
        return RequestOutput(
            request_id,
            prompt,
            prompt_ids,
            [self._completion(s) for s in seqs],
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=first.num_cached_tokens,
        )

    def _completion(self, seq: Sequence) -> CompletionOutput:
        ids = seq.output_token_ids
        text = str(self.engine.tokenizer.decode(ids, skip_special_tokens=seq.params.skip_special_tokens))
        logprobs = None
        cumulative = None
        if seq.params.logprobs is not None:
            logprobs = [{tok: lp, **top} for tok, lp, top in zip(ids, seq.logprobs, seq.top_logprobs)]
            cumulative = sum(seq.logprobs)
        return CompletionOutput(seq.index, text, ids, seq.finish_reason, logprobs, cumulative)
