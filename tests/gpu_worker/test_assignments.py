"""One definition of the sampling options (shared.sampling): the gateway's schema inherits it and builds the
wire's spec from it, and the engine's SamplingParams is that spec; the worker converts one into the other.

A field added to the definition reaches every shape; one given only to a body or the engine fails here.
"""

from __future__ import annotations

import pytest

from gateway.serving.prepare import prepare_chat, prepare_completion
from gateway.serving.schemas import ChatCompletionRequest, CompletionRequest, SamplingBody
from gateway.serving.tokenization import Tokenizer
from gpu_worker.assignments import engine_requests, read_assignment, salvage_request, sampling_params
from gpu_worker.engine.sampling_params import SamplingParams
from shared.errors import CodedError, ErrorCode, RequestRejected
from shared.protocol import Assignment, GenerateRequest, encode
from shared.sampling import SamplingOptions, SamplingSpec, StructuredSpec

# Options of the offline API that never travel: the gateway detokenizes itself.
ENGINE_ONLY = {"skip_special_tokens"}
# Computed by the gateway per endpoint (max_completion_tokens, top_logprobs) or from several fields (the
# structured output: response_format, structured_outputs, guided_*), not copied from the body.
PER_ENDPOINT = {"max_tokens", "logprobs", "structured"}

# A value other than the default for every field of the spec but use_beam_search (beam search refuses
# penalties, logit_bias and the rest; BEAM has its own fields).
NOT_BEAM = {
    "n": 3,
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 5,
    "min_p": 0.05,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "repetition_penalty": 1.2,
    "seed": 11,
    "max_tokens": 7,
    "min_tokens": 2,
    "stop_token_ids": [3, 4],
    "ignore_eos": True,
    "logprobs": 2,
    "prompt_logprobs": 1,
    "logit_bias": {5: 1.5, 9: -100.0},
    "allowed_token_ids": [3, 4, 5],
    "structured": StructuredSpec(kind="regex", value="[a-z]+"),
    "best_of": 3,
    "length_penalty": 0.5,
}
BEAM = {"n": 2, "use_beam_search": True, "best_of": 3, "length_penalty": 0.5, "max_tokens": 7}


def test_every_shape_derives_from_the_one_definition() -> None:
    assert issubclass(SamplingBody, SamplingOptions) and issubclass(SamplingParams, SamplingSpec)
    assert set(SamplingSpec.model_fields) == set(SamplingOptions.model_fields) | PER_ENDPOINT
    assert set(SamplingParams.model_fields) == set(SamplingSpec.model_fields) | ENGINE_ONLY
    assert set(NOT_BEAM) | set(BEAM) == set(SamplingSpec.model_fields)
    defaults = SamplingSpec()
    assert all(getattr(defaults, name) != value for name, value in {**NOT_BEAM, **BEAM}.items())


@pytest.mark.parametrize("fields", [NOT_BEAM, BEAM], ids=["sampling", "beam search"])
def test_every_spec_field_reaches_the_engine(fields: dict[str, object]) -> None:
    params = sampling_params(SamplingSpec(**fields))  # type: ignore[arg-type]
    assert {name: getattr(params, name) for name in fields} == fields
    assert sampling_params(SamplingSpec()).model_dump() == SamplingParams().model_dump()


def test_one_rule_refuses_a_combination_on_both_sides() -> None:
    with pytest.raises(ValueError, match="use_beam_search does not take logit_bias"):
        SamplingParams(use_beam_search=True, logit_bias={3: 1.0})
    with pytest.raises(ValueError, match="use_beam_search does not take logit_bias"):
        SamplingSpec(use_beam_search=True, logit_bias={3: 1.0})


def test_the_gateway_builds_the_spec_from_every_field_of_a_body(tok: Tokenizer) -> None:
    common: dict[str, object] = {k: v for k, v in NOT_BEAM.items() if k not in PER_ENDPOINT}
    common["guided_regex"] = "[a-z]+"
    completion = CompletionRequest.model_validate({"prompt": "hi", "max_tokens": 7, "logprobs": 2, **common})
    chat = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 7,
            "logprobs": True,
            "top_logprobs": 2,
            **common,
        }
    )
    for prepared in (prepare_completion(completion, tok), prepare_chat(chat, tok)):
        assert prepared.request.sampling == SamplingSpec(**NOT_BEAM)  # type: ignore[arg-type]


def test_values_the_engine_refuses_are_rejected_with_a_code() -> None:
    with pytest.raises(RequestRejected) as info:  # (a spec no gateway would build)
        sampling_params(SamplingSpec.model_construct(top_p=0.0))
    assert info.value.code is ErrorCode.INVALID_REQUEST and "top_p" in info.value.message


def make_request(**update: object) -> GenerateRequest:
    spec = SamplingSpec(n=2, seed=100, max_tokens=10, min_tokens=4)
    request = GenerateRequest(request_id="r", prompt_token_ids=[1, 2, 3], sampling=spec, arrival_time=1.0)
    return request.model_copy(update=update)


def test_a_fresh_request_is_one_engine_request() -> None:
    (plan,) = engine_requests(make_request())
    assert (plan.engine_id, plan.index, plan.start, plan.prompt_token_ids) == ("r", None, 0, [1, 2, 3])
    assert plan.params is not None and plan.params.n == 2 and plan.params.seed == 100


def test_resumed_samples_continue_with_their_own_seed_and_what_is_left() -> None:
    plans = engine_requests(make_request(samples=[1, 0], resume={0: [7] * 10, 1: [8, 9]}))
    assert [(p.engine_id, p.index, p.start) for p in plans] == [("r#1", 1, 2), ("r#0", 0, 10)]
    one, zero = plans
    assert one.prompt_token_ids == [1, 2, 3, 8, 9]
    assert one.params is not None
    assert (one.params.n, one.params.seed, one.params.max_tokens, one.params.min_tokens) == (1, 101, 8, 2)
    assert zero.params is None  # it had all its tokens already


def test_only_a_sample_resumed_from_its_start_asks_for_prompt_logprobs_again() -> None:
    request = make_request(samples=[0, 1], resume={0: [], 1: [8, 9]})
    spec = request.sampling.model_copy(update={"prompt_logprobs": 2, "allowed_token_ids": [8, 9]})
    fresh, resumed = engine_requests(request.model_copy(update={"sampling": spec}))
    assert fresh.params is not None and fresh.params.prompt_logprobs == 2 and fresh.start == 0
    # Its first event, which carried them, went out before its worker died; its "prompt" now ends in outputs.
    assert resumed.params is not None and resumed.params.prompt_logprobs is None and resumed.start == 2
    assert fresh.params.allowed_token_ids == resumed.params.allowed_token_ids == [8, 9]


def test_a_beam_search_resumed_after_a_failover_starts_again_from_its_prompt() -> None:
    beams = SamplingSpec(n=2, use_beam_search=True, best_of=3, max_tokens=10)
    (plan,) = engine_requests(make_request(sampling=beams, samples=[1], resume={1: []}))
    assert (plan.engine_id, plan.index, plan.start, plan.prompt_token_ids) == ("r", None, 0, [1, 2, 3])
    assert plan.params is not None and plan.params.use_beam_search and plan.params.max_tokens == 10


def test_a_resumed_structured_sample_keeps_its_grammar() -> None:
    spec = SamplingSpec(max_tokens=10, structured=StructuredSpec(kind="regex", value="[0-9]+"))
    (plan,) = engine_requests(make_request(sampling=spec, samples=[0], resume={0: [7, 7]}))
    # The prompt ends in the two tokens it streamed; the engine's matcher consumes them (start says how many).
    assert plan.start == 2 and plan.params is not None and plan.params.structured == spec.structured


def test_an_unreadable_assignment_is_a_protocol_error_and_its_request_is_salvaged() -> None:
    good = encode(Assignment(worker_id="w", request=make_request(), reserved_blocks=1))
    assert read_assignment(good).request == make_request()
    bad = good.replace('"reserved_blocks":1', '"reserved_blocks":1,"extra":true')
    with pytest.raises(CodedError) as info:
        read_assignment(bad)
    assert info.value.code is ErrorCode.PROTOCOL_ERROR and "extra" in info.value.message
    assert salvage_request(bad) == make_request()
    worse = good.replace('"top_k":0', '"top_k":"many"')
    salvaged = salvage_request(worse)
    assert salvaged is not None and (salvaged.request_id, salvaged.sample_indices()) == ("r", [0, 1])
    assert salvage_request('{"request": {}}') is None
    assert salvage_request("not json") is None
    with pytest.raises(CodedError):
        read_assignment(None)
