"""Cross-origin requests: the headers a browser needs to call the API from a page on another origin.

Every response carries Access-Control-Allow-Origin for an allowed origin; a preflight (OPTIONS) is answered
here, before authentication, since a browser sends it without the API key.
"""

from __future__ import annotations

from flask import Response, request

from gateway.request_body import IGNORED_FIELDS_HEADER

# What a page's script may read of a response besides the basic headers.
EXPOSED_HEADERS = ("Retry-After", IGNORED_FIELDS_HEADER)
# Headers a page may send when its preflight does not name them.
ALLOWED_HEADERS = "Authorization, Content-Type, Last-Event-ID"
# How long a browser may reuse a preflight's answer.
MAX_AGE_S = 600


class Cors:
    """The origins a browser may call the API from (`*`: any) and the headers that say so."""

    def __init__(self, allowed_origins: str) -> None:
        origins = {o.strip().rstrip("/") for o in allowed_origins.split(",") if o.strip()}
        self.any_origin = "*" in origins
        self.origins = frozenset(origins - {"*"})

    def allowed_origin(self) -> str | None:
        """The Access-Control-Allow-Origin value for this request (None: the origin is not allowed)."""
        if self.any_origin:
            return "*"
        origin = request.headers.get("Origin")
        return origin if origin in self.origins else None

    def preflight(self) -> Response | None:
        """Answer OPTIONS on any route (with no API key): the methods it takes; the rest is add_headers's."""
        if request.method != "OPTIONS" or request.url_rule is None:
            return None
        methods = ", ".join(sorted(request.url_rule.methods or ()))
        response = Response(status=204)
        response.headers["Allow"] = methods
        if request.headers.get("Origin") is not None and self.allowed_origin() is not None:
            response.headers["Access-Control-Allow-Methods"] = methods
            response.headers["Access-Control-Allow-Headers"] = request.headers.get(
                "Access-Control-Request-Headers", ALLOWED_HEADERS
            )
            response.headers["Access-Control-Max-Age"] = str(MAX_AGE_S)
        return response

    def add_headers(self, response: Response) -> Response:
        """Every response: the origin allowed to read it, and which of its headers a script may read."""
        origin = self.allowed_origin()
        if not self.any_origin:
            response.vary.add("Origin")  # the answer depends on the origin: caches must keep them apart
        if origin is not None:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Expose-Headers"] = ", ".join(EXPOSED_HEADERS)
        return response
