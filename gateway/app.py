"""The Flask application: OpenAI's completions and chat completions, tokenization, health and metrics."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pydantic
import redis
from flask import Flask, Response, current_app, jsonify, request
from werkzeug.exceptions import UnsupportedMediaType

from gateway import metrics, openapi
from gateway.backpressure import check_backpressure
from gateway.errors import APIError, bad_request, from_validation_error, install_error_handlers
from gateway.generation import ClientDisconnected, Generation, Limits, Prepared, peer_closed
from gateway.prepare import check_model, prepare_chat, prepare_completion
from gateway.responses import ResponseFormat
from gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    conversation,
)
from gateway.settings import GatewaySettings
from gateway.sse import event_stream
from gateway.token_receiver import GenerationError
from gateway.tokenization import load_tokenizer
from gateway.worker_watch import WorkerWatch
from shared.errors import ErrorCode
from shared.redis_client import connect
from shared.registry import WorkerRegistry

logger = logging.getLogger(__name__)

# Probes and scrapers carry no API key.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
PUBLIC_PATHS = frozenset({"/health", "/ready", "/metrics", "/openapi.json"})

B = TypeVar("B", bound=pydantic.BaseModel)
_SURROGATE = re.compile("[\ud800-\udfff]")
# Past this much of a refused body, the connection is closed instead.
DISCARD_LIMIT_BYTES = 64 << 20


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def json_body() -> dict[str, Any]:
    """The request's JSON object: 415 when it is not JSON, 413 when too large, 400 when malformed."""
    if not request.is_json:
        raise UnsupportedMediaType()
    data = _parse_json(_read_body(current_app.config["MAX_BODY_BYTES"]))
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object", code=ErrorCode.INVALID_JSON)
    _check_text(data)
    return data


def _read_body(limit: int) -> bytes:
    """At most limit bytes of body, whether its length is declared or it comes in chunks."""
    declared = request.content_length
    raw = b"" if declared is not None and declared > limit else request.stream.read(limit + 1)
    if len(raw) > limit or (declared is not None and declared > limit):
        _discard(request.stream)
        raise APIError(ErrorCode.BODY_TOO_LARGE, f"the request body is larger than {limit} bytes")
    return raw


def _discard(stream: Any) -> None:
    """Read what is left of a refused body (up to a bound), so that a client still sending it gets the 413
    rather than a reset connection."""
    left = DISCARD_LIMIT_BYTES
    while left > 0 and (chunk := stream.read(min(left, 1 << 16))):
        left -= len(chunk)


def _parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw, parse_constant=_no_constants)
    except (ValueError, RecursionError) as e:
        raise bad_request(f"the body is not valid JSON: {e}", code=ErrorCode.INVALID_JSON) from e


def _check_text(value: Any) -> None:
    """JSON may escape half of a UTF-16 surrogate pair (`"\\ud800"`): such a string is no text to tokenize."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str) and _SURROGATE.search(item):
            raise bad_request("the body holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text")


def _bearer_token() -> bytes | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip().encode() if scheme.lower() == "bearer" else None


def validate(model: type[B], data: dict[str, Any]) -> B:
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as e:
        raise from_validation_error(e) from e


def parse_body(model: type[B]) -> B:
    return validate(model, json_body())


class Gateway:
    """One process's state (settings, the Redis connection pool, the tokenizer) and the routes."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.keys = settings.keys
        self.model_name = settings.served_model_name
        # One client, so one connection pool, per process; each request's subscription borrows from it.
        self.redis = connect(settings.redis_url)
        self.registry = WorkerRegistry(self.redis, self.keys)
        self.tokenizer = load_tokenizer(settings.model, settings.max_model_len)
        self.api_keys = [k.encode() for k in sorted(settings.api_key_set())]
        self.created = int(time.time())
        self.watch = WorkerWatch(self.registry)
        self.limits = Limits(
            timeout_s=settings.request_timeout_s,
            tick_s=settings.sse_heartbeat_s,
            request_ttl_s=settings.request_ttl_s,
            no_worker_grace_s=settings.no_worker_grace_s,
            redis_outage_grace_s=settings.redis_outage_grace_s,
        )

    def authenticate(self) -> None:
        if not self.api_keys or request.path in PUBLIC_PATHS:
            return
        given = _bearer_token()
        if given is None or not any(hmac.compare_digest(given, k) for k in self.api_keys):
            raise APIError(
                ErrorCode.INVALID_API_KEY, "a valid API key is required (Authorization: Bearer <key>)"
            )

    def owner(self) -> str:
        """Who a request belongs to: a digest of its API key (only that key may resume its stream)."""
        given = _bearer_token() if self.api_keys else None
        return hashlib.sha256(given).hexdigest() if given else ""

    # -- generation ---------------------------------------------------------------------------------

    def completions(self) -> Response:
        arrived = time.monotonic()
        body = parse_body(CompletionRequest)
        check_model(body.model, self.model_name)
        return self._generate(prepare_completion(body, self.tokenizer), arrived)

    def chat_completions(self) -> Response:
        arrived = time.monotonic()
        body = parse_body(ChatCompletionRequest)
        check_model(body.model, self.model_name)
        return self._generate(prepare_chat(body, self.tokenizer), arrived)

    def _generate(self, prepared: Prepared, arrived: float) -> Response:
        settings = self.settings
        check_backpressure(self.registry, settings.max_queue_len, settings.heartbeat_ttl_s)
        generation = Generation(
            self.redis,
            self.keys,
            self.tokenizer,
            prepared,
            model_name=self.model_name,
            limits=self.limits,
            watch=self.watch,
            arrived=arrived,
            is_disconnected=peer_closed(request.environ),
        )
        try:
            generation.submit(self.owner())
        except BaseException:
            generation.close(reason=None)
            raise
        response_format = ResponseFormat(generation, self.tokenizer, self.model_name)
        if prepared.stream:
            response = Response(event_stream(generation, response_format), mimetype="text/event-stream")
            response.headers["Cache-Control"] = "no-cache"
            response.headers["X-Accel-Buffering"] = "no"  # a proxy in front must not buffer the stream
            response.call_on_close(generation.close)
            return response
        try:
            for _ in generation.updates():
                pass
        except GenerationError as e:
            raise APIError.of(e) from e
        except ClientDisconnected:
            return Response(status=499)  # nobody reads it; the request is aborted
        finally:
            generation.close()
        return jsonify(response_format.response())

    # -- models and tokens --------------------------------------------------------------------------

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "pagedserve",
            "max_model_len": self.tokenizer.max_model_len,
        }

    def models(self) -> Response:
        return jsonify({"object": "list", "data": [self._model_card()]})

    def model(self, model_id: str) -> Response:
        check_model(model_id, self.model_name)
        return jsonify(self._model_card())

    def tokenize(self) -> Response:
        data = json_body()
        if "messages" in data:
            chat = validate(TokenizeChatRequest, data)
            check_model(chat.model, self.model_name)
            tokens = self.tokenizer.encode_chat(conversation(chat.messages))
        else:
            plain = validate(TokenizeCompletionRequest, data)
            check_model(plain.model, self.model_name)
            tokens = self.tokenizer.encode(plain.prompt)
        max_model_len = self.tokenizer.max_model_len
        return jsonify({"tokens": tokens, "count": len(tokens), "max_model_len": max_model_len})

    def detokenize(self) -> Response:
        body = parse_body(DetokenizeRequest)
        check_model(body.model, self.model_name)
        self.tokenizer.check_ids(body.tokens, "tokens")
        return jsonify({"prompt": self.tokenizer.decode(body.tokens)})

    # -- operations ---------------------------------------------------------------------------------

    def health(self) -> Response:
        return jsonify({"status": "ok"})

    def ready(self) -> tuple[Response, int]:
        try:
            self.redis.ping()
            workers = self.registry.live_worker_ids()
        except redis.RedisError as e:
            return jsonify({"status": "not ready", "reason": f"Redis unavailable: {e}"}), 503
        if not workers:
            return jsonify({"status": "not ready", "reason": "no live worker"}), 503
        return jsonify({"status": "ready", "workers": len(workers)}), 200

    def metrics(self) -> Response:
        body, content_type = metrics.render(self.registry, self.model_name)
        return Response(body, content_type=content_type)

    def openapi(self) -> Response:
        return jsonify(openapi.document(self.model_name))


def create_app(settings: GatewaySettings | None = None) -> Flask:
    """The gateway; settings default to the environment (what gunicorn's workers use)."""
    settings = settings or GatewaySettings.model_validate({})
    if not logging.getLogger().handlers:
        logging.basicConfig(level=settings.log_level, format=LOG_FORMAT)
    app = Flask(__name__)
    # Read and limited by json_body (werkzeug's own limit truncates a chunked body silently).
    app.config["MAX_BODY_BYTES"] = settings.max_body_bytes
    app.json.sort_keys = False  # type: ignore[attr-defined]
    app.json.ensure_ascii = False  # type: ignore[attr-defined]
    gateway = Gateway(settings)
    app.extensions["pagedserve"] = gateway
    install_error_handlers(app)
    app.before_request(gateway.authenticate)
    routes: list[tuple[str, Callable[..., Any], list[str]]] = [
        ("/v1/completions", gateway.completions, ["POST"]),
        ("/v1/chat/completions", gateway.chat_completions, ["POST"]),
        ("/v1/models", gateway.models, ["GET"]),
        ("/v1/models/<path:model_id>", gateway.model, ["GET"]),
        ("/tokenize", gateway.tokenize, ["POST"]),
        ("/detokenize", gateway.detokenize, ["POST"]),
        ("/health", gateway.health, ["GET"]),
        ("/ready", gateway.ready, ["GET"]),
        ("/metrics", gateway.metrics, ["GET"]),
        ("/openapi.json", gateway.openapi, ["GET"]),
    ]
    for rule, view, methods in routes:
        app.add_url_rule(rule, view.__name__, view, methods=methods)
    return app
