"""Structured outputs and beam search at the gateway: which fields ask for them, what reaches the sampling
spec, and the 400s for what cannot be served, through the Flask test client over a real Redis."""

from __future__ import annotations

import json
from typing import Any

import pytest

from shared.sampling import StructuredSpec
from tests.support.gateway_app import (
    CHAT,
    CMPL,
    USER,
    assert_openai_error,
    queued,
    sent,
)

SCHEMA = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
BODIES = ((CMPL, {"prompt": "hi"}), (CHAT, {"messages": USER}))


@pytest.mark.usefixtures("worker")
@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredSpec(kind="json_object")),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}},
            StructuredSpec(kind="json", value=json.dumps(SCHEMA)),
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}},
            StructuredSpec(kind="json_object"),
        ),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredSpec(kind="json", value=json.dumps(SCHEMA))),
        ({"structured_outputs": {"regex": "[0-9]{3}"}}, StructuredSpec(kind="regex", value="[0-9]{3}")),
        (
            {"structured_outputs": {"choice": ["yes", "no"]}},
            StructuredSpec(kind="choice", value='["yes", "no"]'),
        ),
        (
            {"structured_outputs": {"grammar": 'root ::= "a"'}},
            StructuredSpec(kind="grammar", value='root ::= "a"'),
        ),
        ({"structured_outputs": {"json_object": True}}, StructuredSpec(kind="json_object")),
        ({"guided_json": json.dumps(SCHEMA)}, StructuredSpec(kind="json", value=json.dumps(SCHEMA))),
        ({"guided_regex": "a+"}, StructuredSpec(kind="regex", value="a+")),
        ({"guided_choice": ["x"]}, StructuredSpec(kind="choice", value='["x"]')),
        ({"guided_grammar": 'start: "b"'}, StructuredSpec(kind="grammar", value='start: "b"')),
    ],
)
def test_every_way_of_asking_for_a_structured_output_reaches_the_spec(
    client, r, keys, fields: dict[str, Any], expected: StructuredSpec | None
) -> None:
    for path, body in BODIES:
        assert sent(client, r, keys, path, {**body, **fields}).sampling.structured == expected


@pytest.mark.usefixtures("worker")
@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "foo"}},
                }
            },
            "response_format.json_schema.schema",
            "foo",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type", None),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "regex"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", None),
        ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs.grammar", "nowhere"),
        ({"structured_outputs": {}}, "structured_outputs", "one of"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "not served"),
        ({"guided_json": "{not json"}, "guided_json", "cannot be read"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "not several"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "not several"),
    ],
)
def test_a_structured_output_that_cannot_be_served_is_a_400_naming_its_parameter(
    client, r, keys, fields: dict[str, Any], param: str, words: str | None
) -> None:
    for path, body in BODIES:
        error = assert_openai_error(client.post(path, json={**body, **fields}), 400)
        assert error["param"] == param, error
        assert words is None or words in error["message"], error
    assert queued(r, keys) == 0


@pytest.mark.usefixtures("worker")
def test_beam_search_fields_reach_the_spec(client, r, keys) -> None:
    body = {"prompt": "hi", "use_beam_search": True, "n": 2, "best_of": 4, "length_penalty": 0.5}
    spec = sent(client, r, keys, CMPL, body).sampling
    assert (spec.use_beam_search, spec.n, spec.best_of, spec.length_penalty) == (True, 2, 4, 0.5)
    chat = sent(client, r, keys, CHAT, {"messages": USER, "use_beam_search": True, "n": 3}).sampling
    assert chat.use_beam_search and chat.n == 3 and chat.best_of is None


@pytest.mark.usefixtures("worker")
@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"n": 3, "best_of": 2}, "n", "best_of"),
        ({"n": 17}, "n", "at most 16"),
        ({"best_of": 17}, "best_of", None),
        ({"logit_bias": {"5": 1}}, "use_beam_search", "logit_bias"),
        ({"allowed_token_ids": [5]}, "use_beam_search", "allowed_token_ids"),
        ({"repetition_penalty": 1.2}, "use_beam_search", "repetition_penalty"),
        ({"min_tokens": 2}, "use_beam_search", "min_tokens"),
        ({"guided_regex": "a+"}, "use_beam_search", "structured outputs"),
        ({"length_penalty": "1"}, "length_penalty", None),
    ],
)
def test_beam_search_refuses_what_it_cannot_serve(client, r, keys, fields, param, words) -> None:
    error = assert_openai_error(
        client.post(CMPL, json={"prompt": "hi", "use_beam_search": True, **fields}), 400
    )
    assert error["param"] == param, error
    assert words is None or words in error["message"], error
    assert queued(r, keys) == 0


@pytest.mark.usefixtures("worker")
def test_best_of_without_beam_search_must_equal_n(client, r, keys) -> None:
    error = assert_openai_error(client.post(CMPL, json={"prompt": "hi", "best_of": 3}), 400)
    assert error["param"] == "best_of" and "use_beam_search" in error["message"]
    assert sent(client, r, keys, CMPL, {"prompt": "hi", "n": 2, "best_of": 2}).sampling.best_of == 2
