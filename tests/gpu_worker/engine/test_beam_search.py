"""Beam search: equal to transformers' beam search; beams share blocks; preemption, abort, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from gpu_worker import LLM, BeamSearchParams, EngineConfig, LLMEngine, SamplingParams
from shared.errors import RequestRejected
from shared.sampling import StructuredSpec
from tests.support.engine import QUESTIONS, assert_pool_drained

MAX_NEW_TOKENS = 24
EOS = 2  # SmolLM2-135M-Instruct's <|im_end|>: its eos and pad token
# A pool of 20 blocks of 16, at most 4 sequences at once.
SMALL_ENGINE = EngineConfig(num_kv_blocks=20, block_size=16, max_num_seqs=4)


def beam(width: int, n: int | None = None, **kwargs: Any) -> SamplingParams:
    return SamplingParams(n=n or width, best_of=width, use_beam_search=True, temperature=0.0, **kwargs)


def hf_beams(model: Any, ids: list[int], width: int, n: int, length_penalty: float) -> list[list[int]]:
    """transformers' beam search on one prompt, each beam cut after its first EOS (the rest is padding)."""
    input_ids = torch.tensor([ids])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        num_beams=width,
        num_return_sequences=n,
        do_sample=False,
        max_new_tokens=MAX_NEW_TOKENS,
        length_penalty=length_penalty,
    )
    beams = []
    for row in out[:, len(ids) :].tolist():
        beams.append(row[: row.index(EOS) + 1] if EOS in row else row)
    return beams


# -- the default model against transformers ------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_path: str) -> tuple[LLM, Any, list[list[int]]]:
    llm = LLM(smollm2_path, dtype="float32", num_kv_blocks=512, block_size=16)
    tokenizer = llm.get_tokenizer()
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        for q in QUESTIONS[:3]
    ]
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    return llm, model, prompts


@pytest.mark.slow
@pytest.mark.parametrize(
    ("width", "n", "length_penalty", "num_prompts"),
    [(2, 2, 1.0, 2), (4, 4, 1.0, 2), (4, 2, 0.5, 1), (3, 3, 2.0, 1)],
)
def test_smollm2_beams_match_transformers(
    smollm2: tuple[LLM, Any, list[list[int]]], width: int, n: int, length_penalty: float, num_prompts: int
) -> None:
    llm, model, prompts = smollm2
    prompts = prompts[:num_prompts]
    params = beam(width, n, max_tokens=MAX_NEW_TOKENS, length_penalty=length_penalty)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for ids, out in zip(prompts, outputs):
        assert [c.index for c in out.outputs] == list(range(n))
        assert [c.token_ids for c in out.outputs] == hf_beams(model, ids, width, n, length_penalty)
        for c in out.outputs:
            assert c.finish_reason == ("stop" if c.token_ids[-1] == EOS else "length")
    assert_pool_drained(llm)


# -- the tiny random model: sharing, preemption, abort, the offline API ---------------------------------


def tiny_prompts(count: int, length: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (length,), generator=g).tolist() for _ in range(count)]


def test_beams_share_blocks_and_copy_on_write(tiny_model_path: str) -> None:
    llm = LLM(tiny_model_path, dtype="float32", num_kv_blocks=256, block_size=16)
    engine = llm.engine
    engine.add_request("r", tiny_prompts(1, 40)[0], beam(4, max_tokens=40, ignore_eos=True))
    shared_steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        search = engine.beam_searches.get("r")
        if search is None or len(search.live) < 2:
            continue
        assert engine.requests["r"] == search.live
        distinct = engine.allocator.num_used_blocks
        unshared = sum(len(seq.block_table) for seq in search.live)
        assert distinct <= unshared
        shared_steps += distinct < unshared
        engine.allocator.check_invariants()
    assert shared_steps > 0
    assert engine.allocator.num_cow_copies > 0
    outputs = engine.release("r")
    assert [s.index for s in outputs] == [0, 1, 2, 3] and all(s.num_output_tokens == 40 for s in outputs)
    assert_pool_drained(llm)


def test_preemption_keeps_beams(tiny_model_path: str) -> None:
    prompts = tiny_prompts(3, 40, seed=5)
    params = beam(4, max_tokens=32, ignore_eos=True)
    reference = [
        [c.token_ids for c in o.outputs]
        for o in LLM(tiny_model_path, dtype="float32").generate(prompts, params)
    ]
    # 4 beams of 72 tokens take at most 20 blocks of 16: one request fits, three at once do not.
    llm = LLM(tiny_model_path, dtype="float32", num_kv_blocks=24, block_size=16)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    idle_steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        # A beam whose candidates came while a sibling recomputes waits without computing anything.
        idle_steps += any(s.num_computed_tokens == s.num_tokens for s in engine.step_scheduler.running)
    assert engine.step_scheduler.num_preemptions > 0 and idle_steps > 0
    got = [[s.output_token_ids for s in engine.release(str(i))] for i in range(len(prompts))]
    assert got == reference
    assert_pool_drained(llm)


def test_iteration_tokens_count_every_live_beam_row(tiny_model_path: str) -> None:
    """vllm:iteration_tokens_total: the prompt, then one token per live beam and step (2 beams, 5 tokens)."""
    engine = LLM(tiny_model_path, dtype="float32", num_kv_blocks=256, block_size=16).engine
    engine.add_request("r", tiny_prompts(1, 20)[0], beam(2, max_tokens=5, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.iteration_tokens.total == 20 + 1 + 2 * 4  # the root's first token, then 2 rows x 4 steps
    assert engine.iteration_tokens.cumulative()[-1] == 5  # one observation per step


def test_abort_frees_every_beam(tiny_model_path: str) -> None:
    llm = LLM(tiny_model_path, dtype="float32", num_kv_blocks=256, block_size=16)
    engine = llm.engine
    engine.add_request("r", tiny_prompts(1, 20)[0], beam(4, max_tokens=40, ignore_eos=True))
    for _ in range(6):
        assert engine.step() == []  # beams are internal until the search ends
    assert len(engine.beam_searches["r"].live) == 4
    engine.abort_request("r")
    assert not engine.beam_searches and not engine.requests
    assert not engine.has_unfinished_requests()
    assert_pool_drained(llm)


def test_offline_beam_search_api(tiny_model_path: str) -> None:
    llm = LLM(tiny_model_path, dtype="float32", num_kv_blocks=256, block_size=16)
    prompts = tiny_prompts(2, 12, seed=9)
    outputs = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=10), use_tqdm=False)
    again = llm.generate(prompts, beam(3, max_tokens=10), use_tqdm=False)
    assert len(outputs) == 2
    for out, ref in zip(outputs, again):
        assert [b.tokens for b in out.sequences] == [c.token_ids for c in ref.outputs]
        scores = [b.score for b in out.sequences]
        assert scores == sorted(scores, reverse=True)
        for b in out.sequences:
            assert b.cum_logprob == pytest.approx(sum(b.logprobs)) and b.cum_logprob < 0
            assert b.text == llm.get_tokenizer().decode(b.tokens, skip_special_tokens=True)
    assert_pool_drained(llm)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"logit_bias": {5: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [5, 6]}, "allowed_token_ids"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"min_tokens": 2}, "min_tokens"),
        ({"structured": StructuredSpec(kind="json_object")}, "structured outputs"),
    ],
)
def test_beam_search_refuses_what_reshapes_its_logprobs(options: dict[str, Any], words: str) -> None:
    """The rule the gateway answers with a 400 (shared.sampling): the parameters themselves refuse it."""
    with pytest.raises(ValueError, match=f"use_beam_search does not take {words}"):
        SamplingParams(**{"n": 2, "use_beam_search": True, "temperature": 0.0, **options})


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"n": 5, "best_of": 5}, "max_num_seqs"),
        ({"n": 4, "best_of": 4, "max_tokens": 100}, "KV pool"),
    ],
)
def test_beam_search_refuses_what_the_engine_cannot_hold(
    tiny_model_path: str, options: dict[str, Any], words: str
) -> None:
    engine = LLMEngine(tiny_model_path, SMALL_ENGINE, dtype="float32")
    params = SamplingParams(**{"n": 2, "use_beam_search": True, "temperature": 0.0, **options})
    with pytest.raises(RequestRejected, match=words):
        engine.add_request("r", [5, 6, 7], params)
    assert not engine.requests and not engine.beam_searches and not engine.has_unfinished_requests()


def test_beam_search_params_are_checked() -> None:
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2, use_beam_search=True)
    with pytest.raises(ValueError, match="length_penalty"):
        SamplingParams(use_beam_search=True, length_penalty=float("nan"))
