"""The one way services open Redis, and pipelines whose replies are read by name.

Every client decodes replies to `str` (keys, hash fields, stream ids and pub/sub payloads alike), so no code
juggles bytes and str.

`REDIS_URL` is a plain Redis (`redis://HOST:PORT/DB`, `rediss://`, `unix://`) or a master that Sentinels
manage: `redis+sentinel://[:PASSWORD@]HOST:PORT[,HOST:PORT...]/MASTER_NAME[/DB]` (the password is the
master's; `?sentinel_password=` gives the Sentinels' own). A Sentinel client asks the Sentinels for the
master whenever it opens a connection, so after a failover every new connection goes to the new master. A
connection that finds its server is no longer the master fails as a connection error (so the caller's usual
retry runs, on a new connection): READONLY (a demoted master refusing a write), UNBLOCKED (a blocking read
cut short by the demotion), NOREPLICAS and MASTERDOWN. And the client follows the Sentinels' switches of its
master (shared.failover_watch): when one is announced, every connection to the old master is cut, so nothing
goes on writing to a master that froze and woke.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import redis
import redis.sentinel

from shared.failover_watch import FailoverWatch

CONNECT_TIMEOUT_S = 5.0
# Longer than any blocking read a service issues (those wait well under a second), so it only fires when a
# connection is stuck.
READ_TIMEOUT_S = 30.0
HEALTH_CHECK_INTERVAL_S = 30


SENTINEL_SCHEME = "redis+sentinel"
SENTINEL_CONNECT_TIMEOUT_S = 1.0  # a Sentinel that is down costs this much before the next one is asked
# Errors that mean "this server is not the master any more": the master moved, the command must go again.
_MASTER_MOVED = ("UNBLOCKED", "NOREPLICAS", "MASTERDOWN")


@dataclass(frozen=True, slots=True)
class SentinelURL:
    """A `redis+sentinel://` URL, parsed."""

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None


def is_sentinel_url(url: str) -> bool:
    return url.startswith(f"{SENTINEL_SCHEME}://")


def parse_sentinel_url(url: str) -> SentinelURL:
    """The Sentinels, master name and database of a `redis+sentinel://` URL (ValueError: what is wrong)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != SENTINEL_SCHEME:
        raise ValueError(f"not a {SENTINEL_SCHEME}:// URL: {url!r}")
    credentials, _, hosts = parts.netloc.rpartition("@")
    sentinels = []
    for host_port in hosts.split(","):
        host, colon, port = host_port.strip().rpartition(":")
        if not colon or not host or not port.isdigit():
            raise ValueError(f"a Sentinel must be HOST:PORT, got {host_port!r} in {url!r}")
        sentinels.append((host.strip("[]"), int(port)))
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(f"the path must be /MASTER_NAME or /MASTER_NAME/DB, got {parts.path!r} in {url!r}")
    username, _, password = credentials.partition(":") if credentials else ("", "", "")
    query = urllib.parse.parse_qs(parts.query)
    return SentinelURL(
        sentinels=tuple(sentinels),
        master=urllib.parse.unquote(path[0]),
        db=int(path[1]) if len(path) == 2 else 0,
        username=urllib.parse.unquote(username) or None,
        password=urllib.parse.unquote(password) or None,
        sentinel_password=query.get("sentinel_password", [None])[0],
    )


def describe_url(url: str) -> str:
    """The URL with any password masked, for logs."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


class _MasterConnection(redis.sentinel.SentinelManagedConnection):
    """A connection to the Sentinels' master that takes every sign of a demoted master as a lost connection:
    it disconnects (so the next connect asks the Sentinels again) and raises ConnectionError."""

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)
        except redis.ResponseError as e:
            if not str(e).startswith(_MASTER_MOVED):
                raise
            self.disconnect()
            raise redis.ConnectionError(f"the master changed ({e})") from e


class _BlockingSentinelPool(redis.sentinel.SentinelConnectionPool, redis.BlockingConnectionPool):
    """The Sentinels' master, with the blocking pool's wait for a free connection."""


def _sentinel_client(url: str, max_connections: int | None, settings: dict[str, Any]) -> redis.Redis:
    parsed = parse_sentinel_url(url)
    sentinel_kwargs: dict[str, Any] = {
        "socket_connect_timeout": SENTINEL_CONNECT_TIMEOUT_S,
        "socket_timeout": SENTINEL_CONNECT_TIMEOUT_S,
        "decode_responses": True,
    }
    if parsed.sentinel_password:
        sentinel_kwargs["password"] = parsed.sentinel_password
    sentinel = redis.sentinel.Sentinel(list(parsed.sentinels), sentinel_kwargs=sentinel_kwargs)
    options: dict[str, Any] = {
        **settings,
        "db": parsed.db,
        "username": parsed.username,
        "password": parsed.password,
        "connection_class": _MasterConnection,
    }
    if max_connections is None:
        client = sentinel.master_for(parsed.master, **options)
    else:
        pool = {"connection_pool_class": _BlockingSentinelPool, "max_connections": max_connections}
        client = sentinel.master_for(parsed.master, **pool, **options, timeout=READ_TIMEOUT_S)
    client.failover_watch = FailoverWatch(  # type: ignore[attr-defined]
        client.connection_pool, parsed.master, parsed.sentinels, sentinel_kwargs
    ).start()
    return client


def connect(url: str, max_connections: int | None = None, **options: Any) -> redis.Redis:
    """A client (one connection pool) for url, replies decoded to str; options override the defaults.

    With max_connections, a command that finds every connection busy waits for one (up to the read timeout)
    instead of failing: what a process serving many requests at once needs. A `redis+sentinel://` url gives
    a client of the Sentinels' current master (see the module's docstring).
    """
    settings: dict[str, Any] = {
        "decode_responses": True,
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "socket_timeout": READ_TIMEOUT_S,
        "health_check_interval": HEALTH_CHECK_INTERVAL_S,
        **options,
    }
    if is_sentinel_url(url):
        return _sentinel_client(url, max_connections, settings)
    if max_connections is None:
        return redis.Redis.from_url(url, **settings)
    pool = redis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=READ_TIMEOUT_S, **settings
    )
    return redis.Redis(connection_pool=pool)


class NamedPipeline:
    """A pipeline whose replies are read back by the name each command was queued under, not by position.

    `pipe.named(("inbox", rid)).xadd(...)` queues one command; `execute()` maps every name to its reply.
    Commands queued on `pipe.pipe` directly run too, unnamed: adding one never shifts another's reply.
    """

    def __init__(self, client: redis.Redis, *, transaction: bool = False) -> None:
        self.pipe = client.pipeline(transaction=transaction)
        self._positions: dict[Hashable, int] = {}

    def named(self, name: Hashable) -> redis.client.Pipeline:
        """The pipeline, on which to queue the one command whose reply is read back as name."""
        assert name not in self._positions, f"two commands named {name!r}"
        self._positions[name] = len(self.pipe)
        return self.pipe

    def execute(self) -> dict[Hashable, Any]:
        replies = self.pipe.execute() if len(self.pipe) else []
        return {name: replies[position] for name, position in self._positions.items()}
