"""Stop strings and stop token ids as vLLM's tests/detokenizer/test_stop_strings.py defines them, over the
REST API serving the default model: greedy text is generated once, and each stop is chosen from its tokens
(a whole token, several tokens, part of one, one split across two), so the expected text is known exactly."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import openai
import pytest

from tests.support.api_cluster import cluster_fixture, extra, post
from tests.support.cluster import MODEL_NAME, Cluster

pytestmark = pytest.mark.slow

PROMPT = "A story about vLLM:\n"
MAX_TOKENS = 40


@dataclass
class Reference:
    """The unstopped greedy output and its tokens' texts."""

    text: str
    tokens: list[str]

    def offset(self, i: int) -> int:
        return len("".join(self.tokens[:i]))

    def pick(self, make: Callable[[int], str | None]) -> tuple[str, int]:
        """The first stop string make(i) (i from 2 on) whose first match in the text starts in token i;
        returns it and where it starts."""
        for i in range(2, len(self.tokens) - 3):
            stop = make(i)
            if not stop or not stop.isascii():
                continue
            start = self.text.find(stop)
            if self.offset(i) <= start < self.offset(i + 1):
                return stop, start
        raise AssertionError(f"no such stop string in {self.text!r}")


cluster = cluster_fixture("smollm2_path")


def complete(client: openai.OpenAI, **kwargs: Any) -> Any:
    """A completion, or its stream when stream=True."""
    return client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, **kwargs
    )


@pytest.fixture(scope="module")
def reference(client: openai.OpenAI) -> Reference:
    choice = complete(client, logprobs=1).choices[0]
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    assert choice.finish_reason == "length", "the reference must not end early"
    assert "".join(choice.logprobs.tokens) == choice.text
    return Reference(choice.text, list(choice.logprobs.tokens))


def check_stop(
    client: openai.OpenAI, expected: str, reason: Any, stream: bool = False, **kwargs: Any
) -> None:
    if stream:
        pieces, finish = [], None
        for chunk in complete(client, stream=True, **kwargs):
            for choice in chunk.choices:
                pieces.append(choice.text)
                finish = choice.finish_reason or finish
        assert "".join(pieces) == expected
        assert finish == "stop"
        return
    choice = complete(client, **kwargs).choices[0]
    assert choice.text == expected
    assert choice.finish_reason == "stop"
    assert extra(choice, "stop_reason") == reason


@pytest.mark.parametrize("include", [False, True])
def test_stop_whole_token(client: openai.OpenAI, reference: Reference, include: bool) -> None:
    stop, start = reference.pick(
        lambda i: reference.tokens[i] if len(reference.tokens[i].strip()) >= 3 else None
    )
    expected = reference.text[: start + len(stop) * include]
    check_stop(client, expected, stop, stop=[stop], extra_body={"include_stop_str_in_output": include})


@pytest.mark.parametrize("include", [False, True])
def test_stop_over_several_tokens(client: openai.OpenAI, reference: Reference, include: bool) -> None:
    stop, start = reference.pick(lambda i: "".join(reference.tokens[i : i + 3]).rstrip() or None)
    expected = reference.text[: start + len(stop) * include]
    check_stop(
        client,
        expected,
        stop,
        stop=[stop, "never appears here"],
        extra_body={"include_stop_str_in_output": include},
    )


@pytest.mark.parametrize("include", [False, True])
def test_stop_inside_a_token(client: openai.OpenAI, reference: Reference, include: bool) -> None:
    """vLLM's "gani" in " organization": the text is cut in the middle of a token."""
    stop, start = reference.pick(
        lambda i: reference.tokens[i][2:4] if len(reference.tokens[i]) >= 5 else None
    )
    expected = reference.text[: start + len(stop) * include]
    check_stop(client, expected, stop, stop=[stop], extra_body={"include_stop_str_in_output": include})


@pytest.mark.parametrize("stream", [False, True])
def test_stop_split_across_tokens(client: openai.OpenAI, reference: Reference, stream: bool) -> None:
    """The end of one token and the start of the next, found only once both have arrived."""

    def split(i: int) -> str | None:
        this, after = reference.tokens[i], reference.tokens[i + 1]
        return this[-2:] + after[:2] if len(this) >= 2 and len(after) >= 2 else None

    stop, start = reference.pick(split)
    check_stop(client, reference.text[:start], stop, stream=stream, stop=stop)


def test_earliest_stop_string_wins(client: openai.OpenAI, reference: Reference) -> None:
    early, early_start = reference.pick(
        lambda i: reference.tokens[i] if reference.tokens[i].strip() else None
    )
    late = reference.text[-6:]
    assert reference.text.find(late) > early_start
    check_stop(client, reference.text[:early_start], early, stop=[late, early])


def test_absent_stop_string_changes_nothing(client: openai.OpenAI, reference: Reference) -> None:
    choice = complete(client, stop=["\u2603 not in the text"]).choices[0]
    assert choice.text == reference.text
    assert choice.finish_reason == "length"
    assert extra(choice, "stop_reason") is None


def stop_token(cluster: Cluster, reference: Reference) -> tuple[int, int]:
    """A generated token's id (a byte-level token's text encodes back to its one id) and where it first
    appears in the output."""
    for text in reference.tokens[2:]:
        if not text.strip() or not text.isascii():
            continue
        ids = post(cluster, "/tokenize", {"model": MODEL_NAME, "prompt": text, "add_special_tokens": False})
        assert ids.status_code == 200, ids.text
        if len(ids.json()["tokens"]) == 1:
            return ids.json()["tokens"][0], reference.tokens.index(text)
    raise AssertionError(f"no single-token word in {reference.tokens}")


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_ids(client: openai.OpenAI, cluster: Cluster, reference: Reference, include: bool) -> None:
    token_id, position = stop_token(cluster, reference)
    expected = "".join(reference.tokens[: position + include])
    check_stop(
        client,
        expected,
        token_id,
        extra_body={"stop_token_ids": [token_id], "include_stop_str_in_output": include},
    )
    usage = complete(client, extra_body={"stop_token_ids": [token_id]}).usage
    assert usage is not None and usage.completion_tokens == position + 1  # the stop token was generated


def test_stop_token_ids_streaming(client: openai.OpenAI, cluster: Cluster, reference: Reference) -> None:
    token_id, position = stop_token(cluster, reference)
    check_stop(
        client,
        "".join(reference.tokens[:position]),
        token_id,
        stream=True,
        extra_body={"stop_token_ids": [token_id]},
    )


def test_end_of_sequence_has_no_stop_reason(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=20,
        temperature=0.0,
    )
    assert out.choices[0].message.content == "The capital of France is Paris."  # the design's golden answer
    assert out.choices[0].finish_reason == "stop"
    assert extra(out.choices[0], "stop_reason") is None
