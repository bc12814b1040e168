"""A request body checked by its schema: the body as the schema reads it, and the fields it ignored.

Fields the schema does not know are ignored, as vLLM does: validate() names them (dotted paths such as
`foo, messages.0.bar`) for a warning, and the HTTP process also in the response's X-Ignored-Fields header.
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar
from urllib.parse import quote

import pydantic

from gateway.serving.errors import from_validation_error

logger = logging.getLogger(__name__)

B = TypeVar("B", bound=pydantic.BaseModel)
# A body may hold any number of unknown fields: a warning names the first ones (and says how many).
MAX_IGNORED_LISTED = 32


def validate(model: type[B], data: dict[str, Any], where: str = "-") -> tuple[B, list[str]]:
    """The body as the schema reads it (a 400 APIError when it does not), and the fields it ignored; where
    names the body's origin in the warning (a route, a batch line)."""
    try:
        body = model.model_validate(data)
    except pydantic.ValidationError as e:
        raise from_validation_error(e) from e
    ignored = ignored_fields(body)
    if ignored:
        listed = ", ".join(ignored[:MAX_IGNORED_LISTED])
        logger.warning("ignored %d unknown field(s) of a request to %s: %s", len(ignored), where, listed)
    return body, ignored


def ignored_fields(body: pydantic.BaseModel, path: str = "") -> list[str]:
    """The dotted paths of the fields a validated body holds but its schema does not know."""
    found = [path + _escape(name) for name in body.model_extra or {}]
    for name in type(body).model_fields:
        value = getattr(body, name)
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            if isinstance(item, pydantic.BaseModel):
                found += ignored_fields(item, f"{path}{name}." + ("" if i is None else f"{i}."))
    return found


def _escape(name: str) -> str:
    """A field name as a header can carry it: ASCII, and no separator (`,` or `.`) of its own."""
    return quote(name, safe="").replace(".", "%2E")
