"""The Flask application: OpenAI's completions and chat completions, tokenization, health and metrics (and
the Batch API's routes, from gateway.batch_api)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from flask import Flask, Response, jsonify, request

from gateway import dashboard, metrics, openapi
from gateway.backpressure import check_backpressure
from gateway.batch_api import BatchAPI
from gateway.cors import Cors
from gateway.errors import install_error_handlers
from gateway.replies import streamed, waited
from gateway.request_body import bearer_token, ignored_fields_header, json_body, parse_body, validate
from gateway.request_metrics import RequestMetrics
from gateway.responses_routes import ResponsesAPI
from gateway.serving.attachments import Attachments
from gateway.serving.batch_records import BatchStore
from gateway.serving.errors import APIError, bad_request
from gateway.serving.event_hub import EventHub
from gateway.serving.generation import Generation, Limits
from gateway.serving.models import ServedModel, ServedModels
from gateway.serving.prepare import Prepared, encode_conversation, prepare_chat
from gateway.serving.prompt_batch import PromptBatch, prepare_prompts
from gateway.serving.responses import ResponseFormat
from gateway.serving.resume import (
    REQUEST_ID_HEADER,
    check_cursor,
    load_request,
    parse_event_id,
    parse_request_id,
)
from gateway.serving.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from gateway.settings import GatewaySettings
from gateway.sse import batch_event_stream, event_stream
from shared.errors import ErrorCode
from shared.redis_client import connect
from shared.registry import WorkerRegistry

logger = logging.getLogger(__name__)

# Probes and scrapers carry no API key.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The dashboard too: a browser opening it sends no bearer token, and it shows what /metrics does, drawn.
PUBLIC_PATHS = frozenset(
    {"/health", "/ready", "/metrics", "/openapi.json", "/version", "/dashboard", "/dashboard/state"}
)
# What an SSE client sends back on reconnecting: the id of the last event it received.
RESUME_HEADER = "Last-Event-ID"


class Gateway:
    """One process's state (settings, the Redis connection pool, the tokenizer) and the routes."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.keys = settings.keys
        # One client, so one connection pool, per process; a request waits for a connection when all are busy.
        # Every request's subscription goes through the process's one pub/sub connection (the hub).
        self.redis = connect(
            settings.redis_url,
            max_connections=settings.redis_max_connections,
            client_name=f"{settings.redis_prefix}:gateway",  # CLIENT LIST tells its connections apart
        )
        self.hub = EventHub(self.redis)
        self.registry = WorkerRegistry(self.redis, self.keys)
        self.models = ServedModels(settings, self.registry)
        self.batches = BatchStore(self.redis, self.keys, settings.batch_retention_s)
        self.model_name = self.models.default.name
        for name in self.models.names():
            metrics.declare(name)
        self.api_keys = [k.encode() for k in sorted(settings.api_key_set())]
        self.created = int(time.time())
        # A reader renews its lease a few times per keep-alive tick, so a live stream never looks dropped.
        self.attachments = Attachments(
            self.redis,
            self.keys,
            lease_s=3 * settings.sse_heartbeat_s,
            grace_s=settings.resume_grace_s,
            ttl_s=settings.request_ttl_s,
        )
        self.limits = Limits.of(settings, tick_s=settings.sse_heartbeat_s)

    def authenticate(self) -> None:
        if not self.api_keys or request.path in PUBLIC_PATHS:
            return
        given = bearer_token()
        if given is None or not any(hmac.compare_digest(given, k) for k in self.api_keys):
            raise APIError(
                ErrorCode.INVALID_API_KEY, "a valid API key is required (Authorization: Bearer <key>)"
            )

    def owner(self) -> str:
        """Who a request belongs to: a digest of its API key (only that key may resume its stream)."""
        given = bearer_token() if self.api_keys else None
        return hashlib.sha256(given).hexdigest() if given else ""

    # -- generation ---------------------------------------------------------------------------------

    def completions(self) -> Response:
        arrived = time.monotonic()
        if RESUME_HEADER in request.headers:
            return self._resume(chat=False, event=request.headers[RESUME_HEADER], stream=True)
        body = parse_body(CompletionRequest)
        model = self.models.get(body.model)
        name = named_request()
        prepared = prepare_prompts(body, model.tokenizer, model.name)
        if len(prepared) == 1:
            return self._generate(prepared[0], arrived, name)
        return self._generate_batch(prepared, arrived, name)

    def chat_completions(self) -> Response:
        arrived = time.monotonic()
        if RESUME_HEADER in request.headers:
            return self._resume(chat=True, event=request.headers[RESUME_HEADER], stream=True)
        body = parse_body(ChatCompletionRequest)
        model = self.models.get(body.model)
        name = named_request()
        return self._generate(prepare_chat(body, model.tokenizer, model.name), arrived, name)

    def completion(self, request_id: str) -> Response:
        return self._retrieve(request_id, chat=False)

    def chat_completion(self, request_id: str) -> Response:
        return self._retrieve(request_id, chat=True)

    def _retrieve(self, request_id: str, *, chat: bool) -> Response:
        """GET a request's output: with stream=true its stream from `starting_after` (a cursor or an event id)
        on; else the whole response, once it has finished."""
        stream = request.args.get("stream", "false").lower() == "true"
        after = request.args.get("starting_after")
        event = after if after is None or ":" in after else f"{request_id}:{after}"
        return self._resume(chat=chat, event=event, stream=stream, request_id=request_id)

    def _resume(
        self, *, chat: bool, event: str | None, stream: bool, request_id: str | None = None
    ) -> Response:
        """Attach to a request already running (or finished, while its record lives)."""
        cursor = None
        if event is not None:
            param = RESUME_HEADER if request_id is None else "starting_after"
            named_id, cursor = parse_event_id(event, param)
            if request_id is not None and named_id != request_id:
                raise bad_request(f"starting_after names request '{named_id}', not '{request_id}'", param)
            request_id = named_id
        assert request_id is not None
        meta = load_request(self.redis, self.keys, request_id, self.owner(), chat=chat)
        if cursor is not None:
            check_cursor(meta, cursor)
        generation = self._generation(Prepared.from_meta(meta, stream=stream), time.monotonic())
        try:
            generation.replay(cursor)
        except BaseException:
            generation.close(reason=None)
            raise
        return self._respond(generation)

    def _generate(self, prepared: Prepared, arrived: float, name: str | None = None) -> Response:
        """Queue one request and answer it. Its client can resume it when it knows its id: a stream's is in
        every event, and a client that named its request (name, from X-Request-Id) knows it already; the
        request of a client that knows neither is aborted as soon as the client goes."""
        if name is not None:
            prepared.request.request_id = name
        attach = prepared.stream or name is not None
        return self._respond(self.submit(prepared, arrived, attach=attach, exclusive=name is not None))

    def submit(
        self,
        prepared: Prepared,
        arrived: float,
        *,
        attach: bool,
        exclusive: bool = False,
        detached: bool = False,
    ) -> Generation:
        """Queue one request, unless its model's queue is full (503): its generation, subscribed. attach,
        detached: as _generation; exclusive: as queue_requests."""
        settings = self.settings
        check_backpressure(
            self.registry, prepared.request.model, settings.max_queue_len, settings.heartbeat_ttl_s
        )
        generation = self._generation(prepared, arrived, attach=attach, detached=detached)
        try:
            generation.submit(self.owner(), exclusive=exclusive)
        except BaseException:
            generation.close(reason=None)
            raise
        return generation

    def _generate_batch(self, prepared: list[Prepared], arrived: float, name: str | None = None) -> Response:
        """Several prompts: each queued as a request of its own (serving.prompt_batch), answered as one; named
        (X-Request-Id), prompt i's request is `<name>-<i>`."""
        settings = self.settings
        check_backpressure(
            self.registry,
            prepared[0].request.model,
            settings.max_queue_len,
            settings.heartbeat_ttl_s,
            num_requests=len(prepared),
        )
        if name is not None:
            for i, one in enumerate(prepared):
                one.request.request_id = f"{name}-{i}"
        batch = PromptBatch(self.redis, prepared, tick_s=self.limits.tick_s)
        try:
            for one in prepared:
                # No attachment: nobody resumes a prompt of a batch, so a client that drops ends them at once.
                generation = self._generation(one, arrived, wakeup=batch.wakeup, attach=False)
                model = self.models.of(one.request)
                batch.add(generation, ResponseFormat(generation, model.tokenizer, model.name))
            batch.submit(self.owner(), exclusive=name is not None)
        except BaseException:
            batch.close(reason=None)
            raise
        return self._respond_batch(batch)

    def _generation(
        self,
        prepared: Prepared,
        arrived: float,
        *,
        wakeup: threading.Event | None = None,
        attach: bool = True,
        detached: bool = False,
    ) -> Generation:
        """detached: run on whether or not the client stays (a background response)."""
        model = self.models.of(prepared.request)
        return Generation(
            self.redis,
            self.keys,
            model.tokenizer,
            prepared,
            limits=self.limits,
            hub=self.hub,
            watch=model.watch,
            attachments=self.attachments if attach else None,
            arrived=arrived,
            is_disconnected=(lambda: False) if detached else peer_closed(request.environ),
            wakeup=wakeup,
            observer=RequestMetrics(model.name, arrived, prepared.request.sampling.n),
        )

    def _respond(self, generation: Generation) -> Response:
        model = self.models.of(generation.request)
        response_format = ResponseFormat(generation, model.tokenizer, model.name)
        if generation.prepared.stream:
            return streamed(event_stream(generation, response_format), generation.close)
        return waited(generation.updates(), generation.close) or jsonify(response_format.response())

    def _respond_batch(self, batch: PromptBatch) -> Response:
        if batch.stream:
            return streamed(batch_event_stream(batch), batch.close)
        return waited(batch.updates(), batch.close) or jsonify(batch.response())

    # -- models and tokens --------------------------------------------------------------------------

    def _model_card(self, model: ServedModel) -> dict[str, Any]:
        return {
            "id": model.name,
            "object": "model",
            "created": self.created,
            "owned_by": "pagedserve",
            "max_model_len": model.tokenizer.max_model_len,
        }

    def list_models(self) -> Response:
        """The first model, and every other one a live worker serves."""
        try:
            live = {beat.model for beat in self.registry.read().live.values()}
        except redis.RedisError:
            live = set()
        served = [m for m in self.models if m is self.models.default or m.name in live]
        return jsonify({"object": "list", "data": [self._model_card(m) for m in served]})

    def model(self, model_id: str) -> Response:
        return jsonify(self._model_card(self.models.get(model_id)))

    def tokenize(self) -> Response:
        data = json_body()
        body: TokenizeChatRequest | TokenizeCompletionRequest
        if "messages" in data:
            body = chat = validate(TokenizeChatRequest, data)
            tokenizer = self.models.get(chat.model).tokenizer
            tokens, _ = encode_conversation(chat, tokenizer, add_special_tokens=chat.add_special_tokens)
        else:
            body = plain = validate(TokenizeCompletionRequest, data)
            tokenizer = self.models.get(plain.model).tokenizer
            tokens = tokenizer.encode(plain.prompt, add_special_tokens=plain.add_special_tokens)
        return jsonify(
            {
                "tokens": tokens,
                "count": len(tokens),
                "max_model_len": tokenizer.max_model_len,
                "token_strs": tokenizer.token_strs(tokens) if body.return_token_strs else None,
            }
        )

    def detokenize(self) -> Response:
        body = parse_body(DetokenizeRequest)
        tokenizer = self.models.get(body.model).tokenizer
        tokenizer.check_ids(body.tokens, "tokens")
        return jsonify({"prompt": tokenizer.decode(body.tokens)})

    # -- operations ---------------------------------------------------------------------------------

    def health(self) -> Response:
        return jsonify({"status": "ok"})

    def ready(self) -> tuple[Response, int]:
        try:
            self.redis.ping()
            live = [beat.model for beat in self.registry.read().live.values()]
        except redis.RedisError as e:
            return jsonify({"status": "not ready", "reason": f"Redis unavailable: {e}"}), 503
        workers = {name: live.count(name) for name in self.models.names()}
        if not any(workers.values()):
            return jsonify({"status": "not ready", "reason": "no live worker of a model served here"}), 503
        return jsonify({"status": "ready", "workers": sum(workers.values()), "models": workers}), 200

    def metrics(self) -> Response:
        body, content_type = metrics.render(self.registry, self.model_name, self.batches)
        return Response(body, content_type=content_type)

    def dashboard(self) -> Response:
        response = Response(dashboard.PAGE.read_bytes(), content_type="text/html; charset=utf-8")
        response.headers["Cache-Control"] = "no-cache"
        return response

    def dashboard_state(self) -> Response:
        response = jsonify(dashboard.read_state(self.redis, self.keys, self.registry))
        response.headers["Cache-Control"] = "no-store"
        return response

    def openapi(self) -> Response:
        return jsonify(openapi.document(self.model_name))

    def version(self) -> Response:
        return jsonify({"version": openapi.VERSION})


def named_request() -> str | None:
    """The id the client gave its request (X-Request-Id), or None."""
    value = request.headers.get(REQUEST_ID_HEADER)
    return None if value is None else parse_request_id(value)


def echo_request_id(response: Response) -> Response:
    """A request the client named answers with its name, as vLLM's server does."""
    value = request.headers.get(REQUEST_ID_HEADER)
    if value is not None:
        response.headers[REQUEST_ID_HEADER] = value
    return response


def peer_closed(environ: dict[str, Any]) -> Callable[[], bool]:
    """Whether the client has closed its connection: it is readable and reading would give end-of-file.

    gunicorn puts the client socket in the WSGI environ; elsewhere (the test client) there is none.
    """
    sock = environ.get("gunicorn.socket")
    if sock is None:
        return lambda: False

    def closed() -> bool:
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    return closed


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
    cors = Cors(settings.cors_allowed_origins)
    app.before_request(cors.preflight)  # first: a browser's preflight carries no API key
    app.before_request(gateway.authenticate)
    app.after_request(ignored_fields_header)
    app.after_request(echo_request_id)
    app.after_request(cors.add_headers)
    routes: list[tuple[str, Callable[..., Any], list[str]]] = [
        ("/v1/completions", gateway.completions, ["POST"]),
        ("/v1/chat/completions", gateway.chat_completions, ["POST"]),
        ("/v1/completions/<request_id>", gateway.completion, ["GET"]),
        ("/v1/chat/completions/<request_id>", gateway.chat_completion, ["GET"]),
        ("/v1/models", gateway.list_models, ["GET"]),
        ("/v1/models/<path:model_id>", gateway.model, ["GET"]),
        ("/tokenize", gateway.tokenize, ["POST"]),
        ("/detokenize", gateway.detokenize, ["POST"]),
        ("/health", gateway.health, ["GET"]),
        ("/ready", gateway.ready, ["GET"]),
        ("/metrics", gateway.metrics, ["GET"]),
        ("/dashboard", gateway.dashboard, ["GET"]),
        ("/dashboard/state", gateway.dashboard_state, ["GET"]),
        ("/openapi.json", gateway.openapi, ["GET"]),
        ("/version", gateway.version, ["GET"]),
        *BatchAPI(settings, gateway.redis).routes(),
        *ResponsesAPI(gateway).routes(),
    ]
    for rule, view, methods in routes:
        app.add_url_rule(rule, view.__name__, view, methods=methods)
    return app
