"""The request fields that make a structured output: OpenAI's response_format, vLLM's structured_outputs and
its older guided_* fields (beam search's use_beam_search, best_of and length_penalty are sampling options,
shared.sampling)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field

from gateway.serving.body_model import Body
from shared.sampling import StructuredKind, StructuredSpec
from shared.structured import grammar_error


class JsonSchemaFormat(Body):
    """response_format.json_schema: a named JSON schema the output must follow."""

    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(
        None, alias="schema", description="the JSON schema; without one, any JSON object"
    )
    strict: bool | None = None


class ResponseFormatParam(Body):
    """The format of the output: text, any JSON object, or JSON that follows a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParam(Body):
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar and json_object."""

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = Field(None, description="a Lark or GBNF grammar")
    json_object: bool | None = None
    structural_tag: str | None = Field(None, description="not served: a 400")


class OutputControlBody(Body):
    """Structured outputs, on both completion endpoints."""

    response_format: ResponseFormatParam | None = None
    structured_outputs: StructuredOutputsParam | None = Field(
        None, description="the output follows a JSON schema, a regex, one of some choices or a grammar (vLLM)"
    )
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's older structured_outputs.json")
    guided_regex: str | None = Field(None, description="vLLM's older structured_outputs.regex")
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = Field(
        None, description="vLLM's older structured_outputs.choice"
    )
    guided_grammar: str | None = Field(None, description="vLLM's older structured_outputs.grammar")

    def structured(self) -> StructuredSpec | None:
        """The structured output asked for (None: free text).

        Raises ValueError (naming the parameter) for two of them at once, one that is not served, or a
        grammar that is not valid.
        """
        asked = self._asked()
        if not asked:
            return None
        if len(asked) > 1:
            named = ", ".join(param for _, param in asked)
            raise StructuredError(f"give one structured output, not several ({named})", asked[1][1])
        spec, param = asked[0]
        error = grammar_error(spec)
        if error is not None:
            raise StructuredError(f"{param}: {error}", param)
        return spec

    def _asked(self) -> list[tuple[StructuredSpec, str]]:
        asked: list[tuple[StructuredSpec, str]] = []

        def ask(kind: StructuredKind, value: Any, param: str) -> None:
            text = value if isinstance(value, str) else json.dumps(value)
            asked.append((StructuredSpec(kind=kind, value=text), param))

        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            ask("json_object", "", "response_format")
        elif fmt is not None and fmt.type == "json_schema":
            schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
            if fmt.json_schema is None:
                raise StructuredError(
                    "response_format of type 'json_schema' needs a json_schema", "response_format.json_schema"
                )
            if schema is None:
                ask("json_object", "", "response_format")
            else:
                ask("json", schema, "response_format.json_schema.schema")
        outputs = self.structured_outputs
        if outputs is not None:
            if outputs.structural_tag is not None:
                raise StructuredError(
                    "structured_outputs.structural_tag is not served", "structured_outputs.structural_tag"
                )
            for kind, value in (
                ("json", outputs.json_),
                ("regex", outputs.regex),
                ("choice", outputs.choice),
                ("grammar", outputs.grammar),
            ):
                if value is not None:
                    ask(kind, value, f"structured_outputs.{kind}")  # type: ignore[arg-type]
            if outputs.json_object:
                ask("json_object", "", "structured_outputs.json_object")
            if not any(param.startswith("structured_outputs") for _, param in asked):
                raise StructuredError(
                    "structured_outputs must set one of json, regex, choice, grammar and json_object",
                    "structured_outputs",
                )
        for kind, value, param in (
            ("json", self.guided_json, "guided_json"),
            ("regex", self.guided_regex, "guided_regex"),
            ("choice", self.guided_choice, "guided_choice"),
            ("grammar", self.guided_grammar, "guided_grammar"),
        ):
            if value is not None:
                ask(kind, value, param)  # type: ignore[arg-type]
        return asked


class StructuredError(ValueError):
    """A structured-output field that cannot be served, and the parameter it is in."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param
