"""Structured outputs in the engine: the grammar cache, the token bitmask, outputs that follow grammars."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import torch

from gpu_worker import LLM, SamplingParams
from gpu_worker.engine.sampler import Sampler
from gpu_worker.engine.sequence import Sequence
from gpu_worker.engine.structured_output import (
    GrammarCache,
    TokenBitmask,
    apply_grammars,
    apply_token_bitmask,
)
from shared.errors import ErrorCode, RequestRejected
from shared.sampling import StructuredSpec

EOS = 2  # the default tokenizer's <|im_end|>
WORDS = r"[a-z]{1,6}( [a-z]{1,6}){6,10}\."
# A random model would fill flexible JSON whitespace forever: the tiny-model schemas ask for none.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"enum": ["Paris", "London", "Tokyo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
COMPACT_PERSON = {**PERSON, "x-guidance": {"whitespace_flexible": False}}


def regex(value: str) -> StructuredSpec:
    return StructuredSpec(kind="regex", value=value)


def choice(*values: str) -> StructuredSpec:
    return StructuredSpec(kind="choice", value=json.dumps(values))


def json_schema(schema: dict[str, Any]) -> StructuredSpec:
    return StructuredSpec(kind="json", value=json.dumps(schema))


@pytest.fixture(scope="module")
def cache(hf_tokenizer: Any) -> GrammarCache:
    return GrammarCache(hf_tokenizer, len(hf_tokenizer), {EOS})


def texts(outputs: list[Any]) -> list[str]:
    return [c.text for o in outputs for c in o.outputs]


def run(llm: LLM, requests: dict[str, tuple[list[int], SamplingParams, int]]) -> dict[str, Sequence]:
    """Requests (id: prompt, params, num_resumed_tokens) through the engine alone, in one batch (add_request
    takes num_resumed_tokens; LLM.generate does not)."""
    for request_id, (prompt, params, resumed) in requests.items():
        llm.engine.add_request(request_id, prompt, params, num_resumed_tokens=resumed)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    return {request_id: llm.engine.release(request_id)[0] for request_id in requests}


# -- the grammar cache -----------------------------------------------------------------------------------


def test_a_grammar_is_compiled_once(hf_tokenizer: Any) -> None:
    cache = GrammarCache(hf_tokenizer, len(hf_tokenizer), {EOS}, max_grammars=2)
    first = cache.matcher(regex("[0-9]+"))
    second = cache.matcher(regex("[0-9]+"))
    assert cache.num_compiles == 1 and first is not second
    assert first.consume_tokens(hf_tokenizer.encode("12")) and not second.is_error()  # copies, not shared
    cache.matcher(choice("a", "b"))
    cache.matcher(regex("[a-z]+"))  # a third grammar evicts the least recently used one
    assert cache.num_compiles == 3 and len(cache) == 2
    cache.matcher(regex("[a-z]+"))
    cache.matcher(regex("[0-9]+"))
    assert cache.num_compiles == 4


@pytest.mark.parametrize(
    "spec",
    [
        regex("(unclosed"),
        choice(),
        StructuredSpec(kind="json", value="{not json"),
        StructuredSpec(kind="grammar", value="start: undefined_rule"),
        StructuredSpec(kind="grammar", value="this is not a grammar"),
    ],
)
def test_invalid_grammars_are_rejected(cache: GrammarCache, spec: StructuredSpec) -> None:
    with pytest.raises(RequestRejected) as info:
        cache.matcher(spec)
    assert info.value.code is ErrorCode.INVALID_REQUEST


def test_resumed_tokens_are_consumed_or_rejected(cache: GrammarCache, hf_tokenizer: Any) -> None:
    streamed = hf_tokenizer.encode("12")  # output a sample streamed before its worker died
    prompt = hf_tokenizer.encode("Say a number:") + streamed
    matcher = cache.matcher(regex("[0-9]{4}"), prompt, len(streamed))
    assert matcher.consume_tokens(hf_tokenizer.encode("34")) and matcher.is_accepting()
    with pytest.raises(RequestRejected, match="resumed"):
        cache.matcher(regex("[a-z]+"), prompt, len(streamed))
    with pytest.raises(RequestRejected, match="num_resumed_tokens"):
        cache.matcher(regex("[a-z]+"), prompt, len(prompt))


# -- the bitmask -----------------------------------------------------------------------------------------


def test_bitmask_unpacks_every_bit() -> None:
    words = torch.randint(-(2**31), 2**31 - 1, (3, 5), dtype=torch.int32)
    want = torch.tensor([[(int(w) >> k) & 1 for w in row for k in range(32)] for row in words]).bool()
    bitmask = TokenBitmask()
    assert torch.equal(bitmask.allowed(words, 160, torch.device("cpu")), want)
    assert torch.equal(bitmask.allowed(words, 150, torch.device("cpu")), want[:, :150])
    wider = bitmask.allowed(words, 170, torch.device("cpu"))  # past the words: never allowed
    assert torch.equal(wider[:, :160], want) and not wider[:, 160:].any()
    logits = torch.randn(3, 160)
    masked = apply_token_bitmask(logits, want)
    assert torch.equal(masked[want], logits[want]) and torch.isneginf(masked[~want]).all()


def test_mask_allows_what_the_grammar_allows(cache: GrammarCache, hf_tokenizer: Any) -> None:
    vocab = len(hf_tokenizer)
    matcher = cache.matcher(choice("yes", "no"))
    bitmask = TokenBitmask()
    allowed = bitmask.allowed(bitmask.fill([matcher], vocab), vocab, torch.device("cpu"))[0]
    for token in allowed.nonzero().flatten().tolist():
        text = hf_tokenizer.decode([token])
        assert text and ("yes".startswith(text) or "no".startswith(text)), text
    for word in ("yes", "no"):
        assert allowed[hf_tokenizer.encode(word)[0]]
    assert not allowed[EOS] and not allowed[hf_tokenizer.encode(" maybe")[0]]
    assert matcher.consume_tokens(hf_tokenizer.encode("yes"))
    done = bitmask.allowed(bitmask.fill([matcher], vocab), vocab, torch.device("cpu"))[0]
    assert done.nonzero().flatten().tolist() == [EOS]


def test_tokens_past_the_tokenizer_are_masked(hf_tokenizer: Any) -> None:
    vocab = len(hf_tokenizer) + 100  # a model whose embedding is padded past its tokenizer
    cache = GrammarCache(hf_tokenizer, vocab, {EOS})
    bitmask = TokenBitmask()
    allowed = bitmask.allowed(
        bitmask.fill([cache.matcher(regex("[^\n]*"))], vocab), vocab, torch.device("cpu")
    )
    assert allowed.shape == (1, vocab)
    assert allowed[0, : len(hf_tokenizer)].sum() > 1000 and not allowed[0, len(hf_tokenizer) :].any()


def test_rows_without_a_grammar_are_untouched(cache: GrammarCache) -> None:
    logits = torch.randn(3, 49152)
    matcher = cache.matcher(choice("yes"))
    out = logits.clone()
    apply_grammars(TokenBitmask(), out, logits, [None, matcher, None])
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert torch.isfinite(out[1]).sum() >= 1 and torch.isneginf(out[1]).sum() > 49000
    every = logits.clone()
    apply_grammars(TokenBitmask(), every, logits, [matcher] * 3)
    assert torch.equal(every, out[1].expand(3, -1).where(torch.isneginf(out[1]), logits))


def test_the_grammar_wins_over_min_tokens_and_allowed_ids(cache: GrammarCache, hf_tokenizer: Any) -> None:
    yes = hf_tokenizer.encode("yes")
    sampler = Sampler({EOS})
    logits = torch.randn(2, len(hf_tokenizer))
    done = Sequence(0, "a", [5, 6], SamplingParams(temperature=0, min_tokens=4, max_tokens=8))
    done.matcher = cache.matcher(choice("yes"))
    assert done.matcher.consume_tokens(yes)  # only EOS is left, which min_tokens masks
    elsewhere = Sequence(1, "b", [5, 6], SamplingParams(temperature=1.0, seed=3, allowed_token_ids=[7, 8]))
    elsewhere.matcher = cache.matcher(choice("yes"))  # allowed_token_ids and the grammar share no token
    out = sampler(logits, [done, elsewhere])
    assert out.token_ids == [EOS, yes[0]]


# -- outputs on the tiny random model --------------------------------------------------------------------


PROMPTS: list[Any] = ["Hello there", "A longer prompt about the weather today,", [17, 18, 19, 20]]
GREEDY_AND_SAMPLED = [
    pytest.param({"temperature": 0.0}, id="greedy"),
    pytest.param({"temperature": 1.0, "seed": 7}, id="seeded"),
    pytest.param({"temperature": 0.8, "top_p": 0.9, "top_k": 50}, id="truncated"),
]


@pytest.mark.parametrize("options", GREEDY_AND_SAMPLED)
def test_regex_outputs_match(llm: LLM, options: dict[str, Any]) -> None:
    params = SamplingParams(max_tokens=100, structured=regex(WORDS), **options)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out in outputs:
        assert re.fullmatch(WORDS, out.outputs[0].text), out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("options", GREEDY_AND_SAMPLED)
def test_choice_outputs_are_a_choice(llm: LLM, options: dict[str, Any]) -> None:
    colours = ("red", "green", "blue", "dark magenta")
    params = SamplingParams(max_tokens=20, structured=choice(*colours), **options)
    for text in texts(llm.generate(PROMPTS, params, use_tqdm=False)):
        assert text in colours


@pytest.mark.parametrize("options", GREEDY_AND_SAMPLED)
def test_json_outputs_follow_the_schema(llm: LLM, options: dict[str, Any]) -> None:
    params = SamplingParams(max_tokens=120, structured=json_schema(COMPACT_PERSON), **options)
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), PERSON)


def test_forked_samples_each_follow_the_grammar(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=100, structured=regex(WORDS))
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    samples = texts(outputs)
    assert len(samples) == 9 and all(re.fullmatch(WORDS, t) for t in samples), samples
    assert len(set(samples)) > 3  # the samples went their own ways


def test_grammar_and_min_tokens(llm: LLM) -> None:
    # After "a" the grammar accepts; min_tokens masks EOS, so "b" follows, and then the grammar is complete.
    params = SamplingParams(temperature=0.0, min_tokens=3, max_tokens=10, structured=regex("ab?"))
    out = llm.generate([[17, 18]], params, use_tqdm=False)[0].outputs[0]
    assert out.text == "ab" and out.finish_reason == "stop"


def test_beam_search_takes_no_grammar(llm: LLM) -> None:
    with pytest.raises(ValueError, match="use_beam_search does not take structured outputs"):
        SamplingParams(temperature=0.0, use_beam_search=True, structured=regex("a+"))
    assert not llm.engine.has_unfinished_requests()


def test_invalid_grammar_is_rejected_by_the_engine(llm: LLM) -> None:
    with pytest.raises(RequestRejected, match="regex"):
        llm.generate([[17, 18]], SamplingParams(structured=regex("(")), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("options", GREEDY_AND_SAMPLED[:2])
def test_preemption_keeps_structured_output(tiny_model_path: str, llm: LLM, options: dict[str, Any]) -> None:
    prompts = [list(range(100 + 7 * i, 130 + 11 * i)) for i in range(6)]
    params = SamplingParams(n=2, max_tokens=100, structured=regex(WORDS), **options)
    want = llm.generate(prompts, params, use_tqdm=False)
    # Room for any one request, nowhere near all of them at once.
    small = LLM(tiny_model_path, dtype="float32", num_kv_blocks=20, block_size=16)
    got = small.generate(prompts, params, use_tqdm=False)
    assert small.stats.num_preemptions > 0
    assert [c.token_ids for o in got for c in o.outputs] == [c.token_ids for o in want for c in o.outputs]
    assert all(re.fullmatch(WORDS, t) for t in texts(got))
    assert small.stats.num_free_blocks == small.stats.num_total_blocks


@pytest.mark.parametrize("options", GREEDY_AND_SAMPLED[:2])
@pytest.mark.parametrize(
    "spec", [pytest.param(regex(WORDS), id="regex"), pytest.param(json_schema(COMPACT_PERSON), id="json")]
)
def test_resumed_sample_goes_on_as_uninterrupted(
    llm: LLM, hf_tokenizer: Any, options: dict[str, Any], spec: StructuredSpec
) -> None:
    prompt = hf_tokenizer.encode("Tell me about someone:")
    whole = run(llm, {"whole": (prompt, SamplingParams(max_tokens=120, structured=spec, **options), 0)})[
        "whole"
    ]
    output = whole.output_token_ids
    assert whole.finish_reason == "stop" and len(output) > 4
    cuts = (1, len(output) // 2, len(output) - 1)
    resumed = run(
        llm,
        {
            f"resumed-{k}": (
                prompt + output[:k],
                SamplingParams(max_tokens=120 - k, structured=spec, **options),
                k,
            )
            for k in cuts
        },
    )
    for k in cuts:
        assert resumed[f"resumed-{k}"].output_token_ids == output[k:], k
        assert resumed[f"resumed-{k}"].finish_reason == "stop"


def test_resumed_tokens_the_grammar_refuses_are_rejected(llm: LLM, hf_tokenizer: Any) -> None:
    prompt = hf_tokenizer.encode("Count: 123")
    with pytest.raises(RequestRejected, match="resumed") as info:
        llm.engine.add_request(
            "bad", prompt, SamplingParams(structured=regex("[a-z]+")), num_resumed_tokens=1
        )
    assert info.value.code is ErrorCode.INVALID_REQUEST and "bad" not in llm.engine.requests


# -- the default model -----------------------------------------------------------------------------------


QUESTIONS = [
    "Invent a person who lives in Paris and describe them as JSON.",
    "Give me a JSON record for a retired teacher from London.",
    "Describe a young software engineer in Tokyo as JSON.",
    "Make up a character for a novel set in London; answer in JSON.",
    "Who might be a typical chef in Paris? Reply with JSON.",
    "Create a JSON profile of a student living in Tokyo.",
    "Describe your favourite fictional detective as JSON.",
    "Invent a musician and give their name, age and city as JSON.",
    "Give a JSON description of an old sailor.",
    "Describe a child who likes trains, as JSON.",
    "Make up a famous painter from Paris and describe them in JSON.",
    "Return JSON for a doctor who works in London.",
    "Describe a baker in Tokyo as a JSON object.",
    "Invent a football player and describe them in JSON.",
    "Give me a JSON object describing a librarian.",
    "Create a person for a customer database, as JSON.",
    "Describe an astronaut who was born in London, in JSON.",
    "Make up a person who is 30 years old, answer with JSON.",
    "Who is a good neighbour? Describe one as JSON.",
    "Describe a gardener from Paris in JSON.",
]


def test_smollm2_chat_json_follows_the_schema(smollm2_path: str) -> None:
    llm = LLM(smollm2_path, dtype="float32", num_kv_blocks=512, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=80, structured=json_schema(PERSON))
    outputs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params, use_tqdm=False)
    assert len(outputs) == 20
    for out in outputs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), PERSON)
    assert len({c.text for c in (o.outputs[0] for o in outputs)}) > 5  # the questions gave varied answers
