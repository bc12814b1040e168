"""/v1/completions as vLLM's server tests define it (tests/entrypoints/openai/completion/test_completion.py),
with a few of llama.cpp's server cases: the official openai client against a real stack serving the tiny
random model."""

from __future__ import annotations

import re
from typing import Any

import openai
import pytest

from tests.support.api_cluster import cluster_fixture, extra, post
from tests.support.cluster import MODEL_NAME, Cluster

TOKEN_IDS = [1000, 1001, 1002, 1003, 1004]
PROMPT = "Hello, my name is"
THE, CAT, DOG = 260, 2644, 2767  # " the", " cat", " dog" in the SmolLM2 vocabulary


# vLLM's test_guided_grammar asks for a small SQL query in GBNF.
SQL_GRAMMAR = """
root ::= select_statement
select_statement ::= "SELECT " column (", " column)? " FROM " table
column ::= "col_1" | "col_2"
table ::= "table_1" | "table_2"
"""

cluster = cluster_fixture("tiny_model_path")


def tokenize(cluster: Cluster, prompt: str) -> list[int]:
    response = post(
        cluster, "/tokenize", {"model": MODEL_NAME, "prompt": prompt, "add_special_tokens": False}
    )
    assert response.status_code == 200, response.text
    return list(response.json()["tokens"])


def detokenize(cluster: Cluster, tokens: list[int]) -> str:
    response = post(cluster, "/detokenize", {"model": MODEL_NAME, "tokens": tokens})
    assert response.status_code == 200, response.text
    return str(response.json()["prompt"])


def complete(client: openai.OpenAI, **kwargs: Any) -> Any:
    """A completion, or its stream when stream=True."""
    kwargs.setdefault("model", MODEL_NAME)
    kwargs.setdefault("max_tokens", 5)
    kwargs.setdefault("temperature", 0.0)
    return client.completions.create(**kwargs)


# -- single and batched prompts ---------------------------------------------------------------------------


def test_single_completion(client: openai.OpenAI, cluster: Cluster) -> None:
    completion = complete(client, prompt=PROMPT)
    assert completion.id
    assert len(completion.choices) == 1
    choice = completion.choices[0]
    assert choice.text
    assert choice.finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 5
    assert completion.usage.prompt_tokens == len(tokenize(cluster, PROMPT))
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 5
    assert completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens == 0

    by_ids = complete(client, prompt=TOKEN_IDS)
    assert by_ids.choices[0].text
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == len(TOKEN_IDS)
    assert extra(by_ids.choices[0], "prompt_logprobs") is None


def test_cached_tokens_of_a_repeated_prompt(client: openai.OpenAI) -> None:
    """usage.prompt_tokens_details.cached_tokens counts the prompt tokens found in the prefix cache."""
    prompt = list(range(2000, 2040))
    first = complete(client, prompt=prompt, max_tokens=2)
    second = complete(client, prompt=prompt, max_tokens=2)
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details is not None and second.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and 16 <= cached < len(prompt)
    assert second.choices[0].text == first.choices[0].text


def test_truncate_prompt_tokens_keeps_the_end(client: openai.OpenAI, cluster: Cluster) -> None:
    ids = list(range(1000, 1008))
    completion = complete(
        client, prompt=ids, max_tokens=1, echo=True, extra_body={"truncate_prompt_tokens": 4}
    )
    assert completion.usage is not None and completion.usage.prompt_tokens == 4
    assert completion.choices[0].text.startswith(detokenize(cluster, ids[-4:]))


def test_batch_completions(client: openai.OpenAI) -> None:
    for prompts in ([PROMPT] * 2, [TOKEN_IDS] * 2):
        batch = complete(client, prompt=prompts)
        assert [c.index for c in batch.choices] == [0, 1]
        assert batch.choices[0].text == batch.choices[1].text
        assert batch.usage is not None and batch.usage.completion_tokens == 10

        # Choices are indexed prompt * n + sample; a seed draws the same samples for the same prompt.
        batch = complete(client, prompt=prompts, n=2, temperature=1.0, seed=7)
        assert [c.index for c in batch.choices] == [0, 1, 2, 3]
        assert batch.choices[0].text != batch.choices[1].text
        assert batch.choices[0].text == batch.choices[2].text
        assert batch.choices[1].text == batch.choices[3].text

        texts = ["", ""]
        for chunk in complete(client, prompt=prompts, stream=True):
            assert len(chunk.choices) == 1
            texts[chunk.choices[0].index] += chunk.choices[0].text
        assert texts[0] == texts[1] and texts[0]


def test_batch_of_different_prompts_keeps_order(client: openai.OpenAI) -> None:
    prompts = ["The quick brown fox", "1, 2, 3, 4,", PROMPT]
    alone = [complete(client, prompt=p).choices[0].text for p in prompts]
    batch = complete(client, prompt=prompts)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == alone


# -- logprobs -----------------------------------------------------------------------------------------------


def test_no_logprobs(client: openai.OpenAI) -> None:
    assert complete(client, prompt=TOKEN_IDS, logprobs=None).choices[0].logprobs is None


@pytest.mark.parametrize("k", [0, 1, 5])
def test_logprobs_shapes(client: openai.OpenAI, k: int) -> None:
    """logprobs=k: the sampled token's logprob and the top k, plus the sampled token when it is not among
    them (so logprobs=0 still holds the sampled token)."""
    choice = complete(client, prompt=TOKEN_IDS, logprobs=k).choices[0]
    logprobs = choice.logprobs
    assert logprobs is not None
    assert logprobs.tokens is not None and len(logprobs.tokens) == 5
    assert logprobs.token_logprobs is not None and len(logprobs.token_logprobs) == 5
    assert logprobs.text_offset is not None and len(logprobs.text_offset) == 5
    assert logprobs.top_logprobs is not None and len(logprobs.top_logprobs) == 5
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert max(k, 1) <= len(top) <= k + 1
        assert token in top and top[token] == pytest.approx(logprob)
        assert logprob <= 0.0
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_too_many_logprobs(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        complete(client, prompt=TOKEN_IDS, logprobs=21)
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        for _ in complete(client, prompt=TOKEN_IDS, logprobs=30, stream=True):
            pass
    assert complete(client, prompt=TOKEN_IDS).choices[0].finish_reason is not None  # still serving


@pytest.mark.parametrize("prompt_logprobs", [-1, 0, 1, None])
def test_prompt_logprobs(client: openai.OpenAI, prompt_logprobs: int | None) -> None:
    prompts = ["A robot may not injure another robot", "My name is"]
    body = {} if prompt_logprobs is None else {"prompt_logprobs": prompt_logprobs}
    if prompt_logprobs is not None and prompt_logprobs < 0:
        with pytest.raises(openai.BadRequestError):
            complete(client, prompt=prompts, extra_body=body)
        return
    completion = complete(client, prompt=prompts, extra_body=body)
    for choice in completion.choices:
        entries = extra(choice, "prompt_logprobs")
        if prompt_logprobs is None:
            assert entries is None
            continue
        assert entries is not None and len(entries) > 1
        assert entries[0] is None  # the first token has nothing before it
        for entry in entries[1:]:
            assert max(prompt_logprobs, 1) <= len(entry) <= prompt_logprobs + 1
            for item in entry.values():
                assert item["logprob"] <= 0.0 and isinstance(item["decoded_token"], str)


@pytest.mark.parametrize("logprobs", [0, 1])
def test_echo_with_logprobs(client: openai.OpenAI, cluster: Cluster, logprobs: int) -> None:
    for prompt in (PROMPT, TOKEN_IDS):
        completion = complete(client, prompt=prompt, echo=True, logprobs=logprobs)
        prompt_text = detokenize(cluster, prompt) if isinstance(prompt, list) else prompt
        choice = completion.choices[0]
        assert re.match(re.escape(prompt_text), choice.text)
        lp = choice.logprobs
        assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
        assert lp.top_logprobs is not None and lp.text_offset is not None
        num_prompt = completion.usage.prompt_tokens if completion.usage else 0
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == num_prompt + 5
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for top in lp.top_logprobs[1:]:
            assert top is not None and max(logprobs, 1) <= len(top) <= logprobs + 1
        assert "".join(lp.tokens) == choice.text


def test_echo_without_logprobs(client: openai.OpenAI) -> None:
    plain = complete(client, prompt=PROMPT).choices[0].text
    echoed = complete(client, prompt=PROMPT, echo=True).choices[0]
    assert echoed.text == PROMPT + plain
    assert echoed.logprobs is None


# -- streaming ----------------------------------------------------------------------------------------------


def test_completion_streaming(client: openai.OpenAI) -> None:
    prompt = "What is an LLM?"
    single = complete(client, prompt=prompt).choices[0].text
    pieces, finishes = [], 0
    chunk = None
    for chunk in complete(client, prompt=prompt, stream=True):
        assert chunk.object == "text_completion"
        pieces.append(chunk.choices[0].text)
        finishes += chunk.choices[0].finish_reason is not None
    assert chunk is not None
    assert finishes == 1  # only on the last chunk
    assert chunk.choices[0].finish_reason == "length"
    assert chunk.choices[0].text  # the finish reason rides with the last token
    assert "".join(pieces) == single


def test_parallel_sampling(client: openai.OpenAI) -> None:
    n = 3
    completion = complete(
        client, prompt="What is an LLM?", n=n, max_tokens=16, temperature=1.0, logprobs=0, seed=42
    )
    assert [c.index for c in completion.choices] == list(range(n))
    for choice in completion.choices:
        assert choice.finish_reason is not None
        assert choice.logprobs is not None and choice.logprobs.tokens is not None
        assert 1 <= len(choice.logprobs.tokens) <= 16
    assert len({c.text for c in completion.choices}) == n


def test_parallel_sampling_streaming(client: openai.OpenAI) -> None:
    n, max_tokens = 3, 16
    chunks: list[list[str]] = [[] for _ in range(n)]
    finishes = 0
    for chunk in complete(
        client, prompt="What is an LLM?", n=n, max_tokens=max_tokens, temperature=1.0, seed=42, stream=True
    ):
        for choice in chunk.choices:
            chunks[choice.index].append(choice.text)
            finishes += choice.finish_reason is not None
    assert finishes == n
    assert all(1 <= len(c) <= max_tokens for c in chunks), [len(c) for c in chunks]
    assert len({"".join(c) for c in chunks}) == n


def test_stream_options(client: openai.OpenAI) -> None:
    prompt = "What is the capital of France?"

    def stream(options: dict[str, Any]) -> list[Any]:
        return list(complete(client, prompt=prompt, stream=True, stream_options=options))

    for options in ({"include_usage": False, "continuous_usage_stats": False}, {}):
        assert all(chunk.usage is None for chunk in stream(options))
    assert all(c.usage is None for c in stream({"include_usage": False, "continuous_usage_stats": True}))

    chunks = stream({"include_usage": True, "continuous_usage_stats": False})
    *body, last = chunks
    assert all(c.usage is None and c.choices for c in body)
    assert body[-1].choices[0].finish_reason is not None
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens > 0 and last.usage.completion_tokens == 5
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens

    chunks = stream({"include_usage": True, "continuous_usage_stats": True})
    for c in chunks:
        assert c.usage is not None and c.usage.prompt_tokens > 0 and c.usage.completion_tokens > 0
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts)

    bad: list[dict[str, Any]] = [
        {"include_usage": None},
        {"include_usage": True},
        {"continuous_usage_stats": None},
        {"continuous_usage_stats": True},
    ]
    for options in bad:
        with pytest.raises(openai.BadRequestError):
            complete(client, prompt=prompt, stream=False, stream_options=options)


# -- sampling controls --------------------------------------------------------------------------------------


def test_same_seed_same_text(client: openai.OpenAI) -> None:
    """llama.cpp's test_consistent_result_same_seed, and its converse."""
    texts = [
        complete(client, prompt=PROMPT, temperature=1.0, seed=s, max_tokens=8).choices[0].text for s in (3, 3)
    ]
    assert texts[0] == texts[1]
    others = {
        complete(client, prompt=PROMPT, temperature=1.0, seed=s, max_tokens=8).choices[0].text for s in (4, 5)
    }
    assert others != {texts[0]}


def test_logit_bias_forces_and_bans(client: openai.OpenAI, cluster: Cluster) -> None:
    forced = complete(client, prompt=PROMPT, max_tokens=4, logit_bias={str(CAT): 100})
    assert forced.choices[0].text == detokenize(cluster, [CAT] * 4)
    # Between two allowed tokens, -100 on one leaves only the other.
    for banned, kept in ((CAT, DOG), (DOG, CAT)):
        out = complete(
            client,
            prompt=PROMPT,
            max_tokens=4,
            logit_bias={str(banned): -100},
            extra_body={"allowed_token_ids": [CAT, DOG]},
        )
        assert out.choices[0].text == detokenize(cluster, [kept] * 4)


def test_allowed_token_ids(client: openai.OpenAI, cluster: Cluster) -> None:
    allowed = [THE, CAT, DOG]
    texts = {detokenize(cluster, [t]) for t in allowed}
    out = complete(
        client,
        prompt=PROMPT,
        max_tokens=8,
        temperature=1.0,
        seed=1,
        logprobs=0,
        extra_body={"allowed_token_ids": allowed},
    )
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and len(logprobs.tokens) == 8
    assert set(logprobs.tokens) <= texts
    for bad in ([], [10**7]):
        with pytest.raises(openai.BadRequestError):
            complete(client, prompt=PROMPT, extra_body={"allowed_token_ids": bad})


def test_min_tokens_holds_back_stop_tokens(client: openai.OpenAI) -> None:
    """A stop token forced by logit_bias ends the sample at once, unless min_tokens are not yet out."""
    common: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 10, "logit_bias": {str(CAT): 100}}
    first = complete(client, **common, extra_body={"stop_token_ids": [CAT]})
    assert first.usage is not None and first.usage.completion_tokens == 1
    assert first.choices[0].finish_reason == "stop"
    assert extra(first.choices[0], "stop_reason") == CAT
    later = complete(client, **common, extra_body={"stop_token_ids": [CAT], "min_tokens": 4})
    assert later.usage is not None and later.usage.completion_tokens == 5
    assert later.choices[0].finish_reason == "stop"


def test_unknown_fields_are_ignored(client: openai.OpenAI) -> None:
    raw = client.completions.with_raw_response.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=2, extra_body={"not_a_vllm_field": 1, "another_one": "x"}
    )
    assert raw.status_code == 200
    ignored = raw.headers.get("X-Ignored-Fields", "")
    assert "not_a_vllm_field" in ignored and "another_one" in ignored
    assert raw.parse().choices[0].text is not None


# -- beam search and structured outputs --------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_batch_completions_with_beam_search(client: openai.OpenAI, stream: bool) -> None:
    """vLLM's test_batch_completions with use_beam_search=True: n=2 beams differ, copies of a prompt agree."""
    beams = {"use_beam_search": True}
    if not stream:
        batch = complete(client, prompt=[PROMPT, PROMPT], n=2, extra_body=beams)
        texts = [c.text for c in sorted(batch.choices, key=lambda c: c.index)]
    else:
        texts = ["", "", "", ""]
        for chunk in complete(client, prompt=[PROMPT, PROMPT], n=2, stream=True, extra_body=beams):
            for c in chunk.choices:
                texts[c.index] += c.text
    assert len(texts) == 4
    assert texts[0] != texts[1]
    assert texts[:2] == texts[2:]


def test_beam_search_is_deterministic_and_best_of_widens_it(client: openai.OpenAI) -> None:
    one = complete(client, prompt=PROMPT, max_tokens=8, extra_body={"use_beam_search": True, "best_of": 4})
    two = complete(client, prompt=PROMPT, max_tokens=8, extra_body={"use_beam_search": True, "best_of": 4})
    assert one.choices[0].text == two.choices[0].text
    assert len(one.choices) == 1 and one.choices[0].finish_reason in {"stop", "length"}


def test_beams_that_do_not_fit_the_kv_pool_are_a_400(client: openai.OpenAI) -> None:
    """16 beams of 400 tokens, unshared, need more blocks than the worker's pool of 256 holds."""
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, prompt=PROMPT, n=16, max_tokens=400, extra_body={"use_beam_search": True})
    assert info.value.body is not None and info.value.body.get("code") == "kv_capacity_exceeded"


@pytest.mark.parametrize(
    "structured",
    [
        {"json": {"type": "object", "properties": {"a": {"type": "not-a-type"}}}},
        {"json": "{not json"},
        {"regex": "[a-"},
        {"grammar": "start: rule_that_does_not_exist"},
        {"choice": []},
        {"json": 42},
        {"regex": {"1": "Hi"}},
        {"choice": "Hi"},
    ],
    ids=["json_schema", "json_text", "regex", "grammar", "choice", "json_type", "regex_type", "choice_type"],
)
def test_invalid_structured_outputs(client: openai.OpenAI, structured: dict[str, Any]) -> None:
    """vLLM's test_invalid_json_schema, test_invalid_regex and test_invalid_grammar: each a 400."""
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, prompt=PROMPT, extra_body={"structured_outputs": structured})
    assert info.value.body is not None and "structured_outputs" in str(info.value.body)


@pytest.mark.parametrize(
    ("extra_body", "check"),
    [
        (
            {"structured_outputs": {"choice": ["red", "green", "blue"]}},
            lambda t: t in {"red", "green", "blue"},
        ),
        (
            {"structured_outputs": {"regex": "[0-9]{2}-[a-z]{3}"}},
            lambda t: re.fullmatch("[0-9]{2}-[a-z]{3}", t),
        ),
        ({"guided_choice": ["alpha", "beta"]}, lambda t: t in {"alpha", "beta"}),
        (
            {"structured_outputs": {"grammar": SQL_GRAMMAR}},
            lambda t: re.fullmatch(r"SELECT (col_1|col_2)(, (col_1|col_2))* FROM (table_1|table_2)", t),
        ),
    ],
)
def test_structured_outputs_hold_on_a_random_model(client: openai.OpenAI, extra_body, check) -> None:
    """Even a random model's output follows the grammar: the mask, not the model, makes it so."""
    for temperature in (0.0, 1.0):
        out = complete(
            client, prompt=PROMPT, max_tokens=20, n=2, temperature=temperature, extra_body=extra_body
        )
        for choice in out.choices:
            assert choice.finish_reason == "stop" and check(choice.text), choice
