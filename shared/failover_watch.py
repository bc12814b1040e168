"""A Sentinel client's watch on its master: the moment the Sentinels switch it, every connection goes.

A connection to a master that froze (a stopped process, a partition) just waits: the client's read timeout is
long, and when the old master wakes it still takes itself for the master until the Sentinels reconfigure it,
seconds later, so a service would go on writing to it, and everything it wrote there is thrown away when it
rejoins as a replica. Pub/sub is worse: a subscriber on the old master hears nothing of what is published on
the new one. So each Sentinel client subscribes to the Sentinels' `+switch-master` and, for its master, cuts
every connection of its pool: idle ones are closed, and a command waiting on one (a read, a blocking read, a
subscription) fails as a lost connection, which the caller's usual retry sends again, on a new connection to
the master the Sentinels name now. A Sentinel that is down or frozen is left for the next one; after a
resubscription the master's address is asked again, so a switch missed meanwhile is caught too.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import weakref
from typing import Any

import redis

logger = logging.getLogger(__name__)

SWITCH_CHANNEL = "+switch-master"
POLL_S = 1.0  # how often the watch looks for a message and whether its client still exists
SENTINEL_TIMEOUT_S = 3.0  # a Sentinel that answers no health check within this is given up for the next
RETRY_S = 0.5


def cut_connections(pool: redis.ConnectionPool) -> int:
    """Close the pool's idle connections and shut down the sockets of those in use (their owners see them
    closed and reconnect); how many were in use."""
    pool.disconnect(inuse_connections=False)
    # redis-py (8.1) keeps the connections it lent in `_in_use_connections`, or all in `_connections` for a
    # blocking pool. Shutting a socket down is safe across threads; closing it under its owner is not.
    lent: Any = getattr(pool, "_in_use_connections", None) or getattr(pool, "_connections", ())
    cut = 0
    for connection in list(lent):
        sock = getattr(connection, "_sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
                cut += 1
    return cut


class FailoverWatch:
    """The thread that follows the Sentinels' switches of one master for one connection pool."""

    def __init__(
        self,
        pool: redis.ConnectionPool,
        master: str,
        sentinels: tuple[tuple[str, int], ...],
        sentinel_kwargs: dict[str, Any],
    ) -> None:
        self._pool = weakref.ref(pool)
        self._master = master
        self._sentinels = sentinels
        self._kwargs = {
            **sentinel_kwargs,
            "socket_timeout": SENTINEL_TIMEOUT_S,
            "health_check_interval": SENTINEL_TIMEOUT_S / 2,
        }
        self._address: tuple[str, int] | None = None
        self.switches = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"failover-watch-{master}", daemon=True)

    def start(self) -> FailoverWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _alive(self) -> bool:
        return not self._stop.is_set() and self._pool() is not None

    def _run(self) -> None:
        n = 0
        while self._alive():
            host, port = self._sentinels[n % len(self._sentinels)]
            n += 1
            try:
                self._follow(redis.Redis(host=host, port=port, **self._kwargs))
            except (redis.RedisError, OSError) as e:
                logger.debug("Sentinel %s:%d: %s; watching through the next one", host, port, e)
            self._stop.wait(RETRY_S)

    def _follow(self, sentinel: redis.Redis) -> None:
        """Subscribe on one Sentinel and follow it until it fails or the client is gone."""
        pubsub = sentinel.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.subscribe(SWITCH_CHANNEL)
            address: Any = sentinel.sentinel_get_master_addr_by_name(self._master)
            self._master_at((str(address[0]), int(address[1])))
            while self._alive():
                message = pubsub.get_message(timeout=POLL_S)
                if message is None:
                    continue
                # "<name> <old ip> <old port> <new ip> <new port>"
                name, _, _, new_ip, new_port = str(message["data"]).split()
                if name == self._master:
                    self._master_at((new_ip, int(new_port)))
        finally:
            with contextlib.suppress(redis.RedisError, OSError):
                pubsub.close()
            sentinel.close()

    def _master_at(self, address: tuple[str, int]) -> None:
        previous, self._address = self._address, address
        pool = self._pool()
        if previous is None or previous == address or pool is None:
            return
        self.switches += 1
        cut = cut_connections(pool)
        logger.warning(
            "Redis master %s moved to %s:%d: its connections are cut (%d in use)", self._master, *address, cut
        )
