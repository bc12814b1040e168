"""Who is reading which request, so that a request whose client dropped is aborted only if nobody resumes it.

Each client reading a request (its first stream, or one that resumed it on any gateway process) holds an
attachment: a member of the request's `attached` sorted set, scored by when its lease runs out, renewed while
it reads. When a client drops, its attachment goes, and after RESUME_GRACE_S the request is aborted unless
another attachment holds it by then.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable

import redis

from shared.keys import Keys

logger = logging.getLogger(__name__)


class Attachments:
    """Leases on requests in the `<p>:request:{<rid>}:attached` sorted sets (member: attachment id, score: the
    lease's end in seconds)."""

    def __init__(
        self, client: redis.Redis, keys: Keys, *, lease_s: float, grace_s: float, ttl_s: int
    ) -> None:
        self._client = client
        self._keys = keys
        self.lease_s = lease_s
        self.grace_s = grace_s
        self._ttl_s = ttl_s

    def attach(self, rid: str) -> str:
        """A new attachment to rid, leased for lease_s."""
        attachment = uuid.uuid4().hex
        self.renew(rid, attachment)
        return attachment

    def renew(self, rid: str, attachment: str) -> None:
        key = self._keys.attached(rid)
        pipe = self._client.pipeline(transaction=False)
        pipe.zadd(key, {attachment: time.time() + self.lease_s})
        pipe.expire(key, self._ttl_s)
        pipe.execute()

    def held(self, rid: str) -> bool:
        """Whether some attachment's lease on rid is still running."""
        return bool(self._client.zcount(self._keys.attached(rid), time.time(), "+inf"))

    def detach(self, rid: str, attachment: str) -> None:
        self._client.zrem(self._keys.attached(rid), attachment)

    def detach_and_abort_later(self, rid: str, attachment: str, abort: Callable[[], None]) -> None:
        """This attachment's client dropped: abort the request after the grace unless it is held then."""
        with contextlib.suppress(redis.RedisError):
            self.detach(rid, attachment)

        def abort_unless_resumed() -> None:
            try:
                if self.held(rid):
                    return
            except redis.RedisError as e:  # nothing can be decided; the request finishes on its own
                logger.warning("request %s: could not check its attachments: %s", rid, e)
                return
            abort()

        timer = threading.Timer(self.grace_s, abort_unless_resumed)
        timer.daemon = True
        timer.start()
