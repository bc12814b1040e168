"""Where the Responses API keeps what `store: true` asks it to: in Redis, each response for RESPONSE_TTL_S,
at most RESPONSE_STORE_MAX of them.

A stored response is one record (`<p>:response:{<id>}`): the response object as last written, its input items,
the conversation a later request continues from (previous_response_id), the id of the request that runs it
and the owner (a digest of its API key: no other key sees it). The listing (`<p>:responses`, id → created)
bounds the store: past the most, the oldest records go. The two are on different slots, so they are written
one after the other, the listing first (shared.keys).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import redis
from pydantic import BaseModel, Field

from gateway.serving.errors import APIError
from shared.errors import ErrorCode
from shared.keys import Keys

Json = dict[str, Any]


class StoredResponse(BaseModel):
    """One stored response."""

    owner: str = ""
    request_id: str = Field(description="the request that runs it (its token record, its abort)")
    response: Json
    input_items: list[Json] = Field(default_factory=list)
    conversation: list[Json] = Field(
        default_factory=list,
        description="chat messages: this response's input after its previous, then its output",
    )

    @property
    def id(self) -> str:
        return str(self.response["id"])

    @property
    def status(self) -> str:
        return str(self.response.get("status", ""))


def response_not_found(response_id: str) -> APIError:
    return APIError(ErrorCode.RESPONSE_NOT_FOUND, f"no stored response '{response_id}'", param="response_id")


class ResponseStore:
    """Stored responses, by id, bounded in number and in time."""

    def __init__(self, client: redis.Redis, keys: Keys, *, ttl_s: int, max_stored: int) -> None:
        self._client = client
        self._keys = keys
        self.ttl_s = ttl_s
        self.max_stored = max_stored

    def save(self, stored: StoredResponse) -> None:
        """Write (or overwrite) the record, keeping its remaining lifetime when it exists already."""
        key = self._keys.response(stored.id)
        # Scored by when it was first stored, to the microsecond (created_at is in whole seconds).
        self._client.zadd(self._keys.responses, {stored.id: time.time()}, nx=True)
        ttl = self._client.ttl(key)
        self._client.set(key, stored.model_dump_json(), ex=ttl if ttl > 0 else self.ttl_s)
        self._prune()

    def update(
        self, response_id: str, owner: str, change: Callable[[StoredResponse], StoredResponse | None]
    ) -> StoredResponse:
        """Change a record as it is now, atomically (WATCHed: a cancel and a background run's end never
        overwrite each other): `change` returns the record to write, or None to leave it. The record as it
        stands after; 404 as load() does."""
        key = self._keys.response(response_id)
        with self._client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(key)
                    current = self._parse(response_id, owner, pipe.get(key))
                    changed = change(current)
                    if changed is None:
                        return current
                    pipe.multi()
                    pipe.set(key, changed.model_dump_json(), keepttl=True)
                    pipe.execute()
                    return changed
                except redis.WatchError:
                    continue

    def load(self, response_id: str, owner: str) -> StoredResponse:
        """The record; 404 response_not_found when there is none, or it is another key's."""
        return self._parse(response_id, owner, self._client.get(self._keys.response(response_id)))

    @staticmethod
    def _parse(response_id: str, owner: str, raw: Any) -> StoredResponse:
        if raw is None:
            raise response_not_found(response_id)
        stored = StoredResponse.model_validate(json.loads(raw))
        if stored.owner != owner:
            raise response_not_found(response_id)
        return stored

    def delete(self, response_id: str, owner: str) -> None:
        self.load(response_id, owner)
        self._client.delete(self._keys.response(response_id))
        self._client.zrem(self._keys.responses, response_id)

    def _prune(self) -> None:
        """Drop the members past their lifetime, then the oldest past the most stored."""
        listing = self._client
        listing.zremrangebyscore(self._keys.responses, "-inf", time.time() - self.ttl_s)
        over = listing.zcard(self._keys.responses) - self.max_stored
        if over <= 0:
            return
        oldest: list[tuple[str, float]] = listing.zpopmin(self._keys.responses, over)  # type: ignore[assignment]
        for member, _ in oldest:
            self._client.delete(self._keys.response(member))  # one slot per command
