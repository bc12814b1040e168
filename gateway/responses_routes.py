"""The Responses API's routes: POST /v1/responses (whole, streamed or in the background), GET and DELETE of a
stored response, its input items, and the cancel of a background one.

A response runs as a chat completion (gateway.serving.responses_api). Stored (`store`, the default), it is
kept in Redis (gateway.serving.response_store): whichever gateway process serves a GET answers it. A
background response is run by a thread of the process that queued it, which stores its end; if that process
goes, a GET reads how far its request got from the request's token record (as a resumed stream does) and
stores the end itself, so a response finishes whoever fetches it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import redis
from flask import Response, jsonify, request

from gateway.replies import streamed, waited
from gateway.request_body import parse_body, validate
from gateway.serving.errors import APIError, bad_request
from gateway.serving.generation import ClientDisconnected, Generation, abort_request
from gateway.serving.prepare import Prepared, prepare_chat
from gateway.serving.response_store import ResponseStore, StoredResponse
from gateway.serving.responses import ResponseFormat
from gateway.serving.responses_api import (
    FINAL,
    EventStream,
    ResponsesRequest,
    as_responses_error,
    chat_request,
    failed,
    finished,
    input_items,
    messages_of,
    new_id,
    output_messages,
    response_object,
)
from gateway.serving.resume import load_request
from gateway.serving.schemas import ChatCompletionRequest
from gateway.serving.token_receiver import GenerationError
from gateway.sse import KEEP_ALIVE
from shared.errors import ErrorCode

if TYPE_CHECKING:
    from gateway.app import Gateway

logger = logging.getLogger(__name__)

Json = dict[str, Any]
MAX_LISTED = 100  # input items in one page


def sse_event(event: Json) -> str:
    """A typed event, as the Responses API streams them (the event's name is its type)."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'), ensure_ascii=False)}\n\n"


class ResponsesAPI:
    """The routes, over the gateway's models and Redis."""

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway
        settings = gateway.settings
        self.store = ResponseStore(
            gateway.redis, gateway.keys, ttl_s=settings.response_ttl_s, max_stored=settings.response_store_max
        )

    def routes(self) -> list[tuple[str, Callable[..., Any], list[str]]]:
        return [
            ("/v1/responses", self.create_response, ["POST"]),
            ("/v1/responses/<response_id>", self.get_response, ["GET"]),
            ("/v1/responses/<response_id>", self.delete_response, ["DELETE"]),
            ("/v1/responses/<response_id>/cancel", self.cancel_response, ["POST"]),
            ("/v1/responses/<response_id>/input_items", self.list_input_items, ["GET"]),
        ]

    # -- create -------------------------------------------------------------------------------------

    def create_response(self) -> Response:
        arrived = time.monotonic()
        gateway = self._gateway
        body = parse_body(ResponsesRequest)
        owner = gateway.owner()
        if body.background and not body.store:
            raise bad_request("a background response must be stored: set store to true", param="background")
        if body.background and body.stream:
            raise bad_request(
                "a background response is not streamed here: create it, then poll GET /v1/responses/{id}",
                param="stream",
            )
        conversation = self._previous(body, owner)
        items = input_items(body)
        conversation = conversation + messages_of(items)
        try:
            chat = validate(ChatCompletionRequest, chat_request(body, conversation))
            model = gateway.models.get(chat.model)
            prepared = prepare_chat(chat, model.tokenizer, model.name)
        except APIError as e:
            raise as_responses_error(e) from e
        response_id = new_id("resp")
        prepared.request.request_id = response_id
        response = response_object(
            body, response_id, model.name, "queued" if body.background else "in_progress"
        )
        stored = None
        if body.store:
            stored = StoredResponse(
                owner=owner,
                request_id=response_id,
                response=response,
                input_items=items,
                conversation=conversation,
            )
        generation = gateway.submit(prepared, arrived, attach=False, detached=body.background)
        response_format = ResponseFormat(generation, model.tokenizer, model.name)
        if body.background:
            assert stored is not None
            return self._background(generation, response_format, stored)
        if body.stream:
            return streamed(self._events(generation, response_format, response, stored), generation.close)
        left = waited(generation.updates(), generation.close)
        if left is not None:
            return left
        final = finished(response, response_format.response())
        self._save(stored, final)
        return jsonify(final)

    def _previous(self, body: ResponsesRequest, owner: str) -> list[Json]:
        """The conversation the request continues (previous_response_id), or none."""
        if body.previous_response_id is None:
            return []
        try:
            previous = self.store.load(body.previous_response_id, owner)
        except APIError as e:
            raise APIError(e.code, e.message, param="previous_response_id") from e
        if previous.status not in FINAL:
            raise bad_request(
                f"response '{previous.id}' has not finished: continue it once it has",
                param="previous_response_id",
            )
        return previous.conversation

    def _save(self, stored: StoredResponse | None, final: Json) -> None:
        """Store a response as it ended, with its output in the conversation a later turn continues."""
        if stored is None:
            return
        stored.response = final
        stored.conversation = stored.conversation + output_messages(final)
        self.store.save(stored)

    def _events(
        self,
        generation: Generation,
        response_format: ResponseFormat,
        response: Json,
        stored: StoredResponse | None,
    ) -> Iterator[str]:
        events = EventStream(response)
        for event in events.opening():
            yield sse_event(event)
        try:
            for changed in generation.updates():
                if not changed:
                    yield KEEP_ALIVE
                for sample in changed:
                    for chunk, _ in response_format.sample_chunks(sample):
                        for event in events.chunk(chunk):
                            yield sse_event(event)
            final = finished(response, response_format.response())
        except ClientDisconnected:
            return
        except GenerationError as e:
            final = failed(response, APIError.of(e))
        except redis.RedisError as e:
            logger.warning("response %s: Redis failed mid-stream: %s", response["id"], e)
            final = failed(
                response, APIError(ErrorCode.QUEUE_UNAVAILABLE, "the request queue became unavailable")
            )
        try:
            self._save(stored, final)
        except redis.RedisError as e:
            logger.warning("response %s: could not be stored: %s", response["id"], e)
        for event in events.end(final):
            yield sse_event(event)

    # -- background ---------------------------------------------------------------------------------

    def _background(
        self, generation: Generation, response_format: ResponseFormat, stored: StoredResponse
    ) -> Response:
        try:
            self.store.save(stored)
        except BaseException:
            generation.close(reason="error")
            raise
        thread = threading.Thread(
            target=self._run,
            args=(generation, response_format, stored),
            name=f"response {stored.id}",
            daemon=True,
        )
        thread.start()
        return jsonify(stored.response)

    def _run(self, generation: Generation, response_format: ResponseFormat, stored: StoredResponse) -> None:
        """A background response to its end, then stored (unless it was cancelled meanwhile: it stays so)."""
        response = stored.response
        try:
            started = False
            for changed in generation.updates():
                if changed and not started:
                    started = True
                    self._mark(stored, "in_progress")
            final = finished(response, response_format.response())
        except GenerationError as e:
            final = failed(response, APIError.of(e))
        except Exception:
            logger.exception("background response %s failed", stored.id)
            final = failed(response, APIError(ErrorCode.INTERNAL_ERROR, "internal server error"))
        finally:
            generation.close(reason="error")  # (nothing to abort once it has finished)
        try:
            self._end(stored, final)
        except redis.RedisError as e:  # a GET stores it from the token record
            logger.warning("background response %s: could not store its end: %s", stored.id, e)

    def _mark(self, stored: StoredResponse, status: str) -> None:
        def change(current: StoredResponse) -> StoredResponse | None:
            if current.status in FINAL:
                return None
            current.response = {**current.response, "status": status}
            return current

        try:
            self.store.update(stored.id, stored.owner, change)
        except (APIError, redis.RedisError):
            return

    def _end(self, stored: StoredResponse, final: Json) -> None:
        """Store the end of a response, unless it has one already; one that was cancelled stays so, with
        the output it had."""

        def change(current: StoredResponse) -> StoredResponse | None:
            ended = final
            if current.status == "cancelled" and not current.response["output"]:
                ended = {**final, "status": "cancelled", "incomplete_details": None}
            elif current.status in FINAL:
                return None
            current.response = ended
            current.conversation = current.conversation + output_messages(ended)
            return current

        try:
            self.store.update(stored.id, stored.owner, change)
        except APIError:  # deleted meanwhile
            return

    def _refresh(self, stored: StoredResponse) -> StoredResponse:
        """A response still running, as its request's token record shows it: finished (then stored), or the
        output so far."""
        gateway = self._gateway
        response = stored.response
        try:
            meta = load_request(gateway.redis, gateway.keys, stored.request_id, stored.owner, chat=True)
        except APIError:
            self._end(stored, failed(response, APIError(ErrorCode.ABORTED, "its request expired unfinished")))
            return self.store.load(stored.id, stored.owner)
        generation = gateway._generation(
            Prepared.from_meta(meta, stream=False), time.monotonic(), attach=False
        )
        model = gateway.models.of(generation.request)
        try:
            generation.replay(None)
            answer = finished(response, ResponseFormat(generation, model.tokenizer, model.name).response())
        except GenerationError as e:
            answer = failed(response, APIError.of(e))
        finally:
            generation.close(reason=None)
        if generation.done or answer["status"] == "failed":
            self._end(stored, answer)
            return self.store.load(stored.id, stored.owner)
        status = response["status"] if response["status"] == "cancelled" else "in_progress"
        stored.response = {**answer, "status": status, "incomplete_details": None}
        return stored

    # -- a stored response --------------------------------------------------------------------------

    def _load(self, response_id: str) -> StoredResponse:
        return self.store.load(response_id, self._gateway.owner())

    def get_response(self, response_id: str) -> Response:
        if request.args.get("stream", "false").lower() == "true":
            raise bad_request("a stored response is fetched whole here (stream=false)", param="stream")
        stored = self._load(response_id)
        if stored.status not in FINAL or (stored.status == "cancelled" and not stored.response["output"]):
            stored = self._refresh(stored)
        return jsonify(stored.response)

    def delete_response(self, response_id: str) -> Response:
        stored = self._load(response_id)
        if stored.status not in FINAL:
            self._abort(stored)
        self.store.delete(response_id, stored.owner)
        return jsonify({"id": response_id, "object": "response", "deleted": True})

    def cancel_response(self, response_id: str) -> Response:
        cancelled_now = False

        def change(current: StoredResponse) -> StoredResponse | None:
            nonlocal cancelled_now
            cancelled_now = False
            if not current.response.get("background"):
                raise bad_request("only a background response can be cancelled", param="response_id")
            if current.status == "cancelled":
                return None
            if current.status in FINAL:
                raise bad_request(
                    f"response '{response_id}' has ended ({current.status})", param="response_id"
                )
            cancelled_now = True
            current.response = {**current.response, "status": "cancelled"}
            return current

        stored = self.store.update(response_id, self._gateway.owner(), change)
        if cancelled_now:
            self._abort(stored)
        return jsonify(stored.response)

    def _abort(self, stored: StoredResponse) -> None:
        keys, ttl = self._gateway.keys, self._gateway.settings.request_ttl_s
        abort_request(self._gateway.redis, keys, stored.request_id, "cancelled", ttl)

    def list_input_items(self, response_id: str) -> Response:
        stored = self._load(response_id)
        args = request.args
        order = args.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request("order must be asc or desc", param="order")
        try:
            limit = int(args.get("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= MAX_LISTED:
            raise bad_request(f"limit must be an integer from 1 to {MAX_LISTED}", param="limit")
        items = stored.input_items if order == "asc" else stored.input_items[::-1]
        after = args.get("after")
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise bad_request(f"after names no input item of response '{response_id}'", param="after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return jsonify(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(items) > limit,
            }
        )
