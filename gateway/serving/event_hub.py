"""One pub/sub connection per gateway process, shared by every request it holds in flight.

A thread (a greenlet, under gunicorn's gevent workers) owns the connection: it alone sends SUBSCRIBE and
UNSUBSCRIBE, reads every message, and hands each to the queue of its channel. A request subscribes through
it and waits for the confirmation, so that the subscription is in place before the request is queued.
When Redis goes away the thread connects again with backoff and subscribes every channel again; `epoch`
counts those connections, so that a receiver knows it may have missed events and catches up from the record.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from shared.backoff import Backoff

logger = logging.getLogger(__name__)

# How long the thread waits for a message before it looks at new (un)subscriptions: the most a subscription
# waits to be sent.
READ_TIMEOUT_S = 0.02
# Every stream of the process waits on this connection: try again often.
MAX_RECONNECT_DELAY_S = 1.0


@dataclass(slots=True, eq=False)
class Subscription:
    """One reader's copy of a channel's messages (payloads, in order)."""

    channel: str
    # NOTE: queue.Queue, not SimpleQueue: it waits on threading's primitives, which gevent makes cooperative.
    messages: queue.Queue[str] = field(default_factory=queue.Queue)
    # Set after each message: one reader of several subscriptions waits on it once for all of them.
    wakeup: threading.Event | None = None


@dataclass(slots=True)
class Channel:
    """A subscribed channel: its readers (a request's stream, and any that resume it), and whether Redis
    has confirmed the subscription."""

    readers: list[Subscription] = field(default_factory=list)
    confirmed: threading.Event = field(default_factory=threading.Event)


class EventHub:
    """The process's pub/sub connection and the subscriptions of its requests."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._channels: dict[str, Channel] = {}
        self._to_subscribe: list[str] = []
        self._to_unsubscribe: list[str] = []
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self.epoch = 0  # connections made so far; a change means messages may have been missed
        self.down_since: float | None = None  # while the connection is lost
        self.back_at: float | None = None  # when it last came back after a loss

    def subscribe(
        self, channel: str, timeout: float, wakeup: threading.Event | None = None, *, wait: bool = True
    ) -> Subscription:
        """Subscribe and wait for Redis to confirm it (wait=False: confirm() waits later, so that several
        subscriptions are confirmed together); raises redis.TimeoutError when it does not in time."""
        subscription = Subscription(channel, wakeup=wakeup)
        with self._lock:
            known = self._channels.get(channel)
            if known is None:
                known = self._channels[channel] = Channel()
                self._to_subscribe.append(channel)
            known.readers.append(subscription)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="event-hub", daemon=True)
                self._thread.start()
        if wait:
            self.confirm(subscription, timeout)
        return subscription

    def confirm(self, subscription: Subscription, timeout: float) -> None:
        """Wait for Redis to confirm a subscription; raises redis.TimeoutError (and unsubscribes) when it does
        not in time."""
        with self._lock:
            known = self._channels.get(subscription.channel)
        if known is None or not known.confirmed.wait(timeout):
            self.unsubscribe(subscription)
            raise redis.TimeoutError(f"no confirmation of the subscription to {subscription.channel}")

    def unsubscribe(self, subscription: Subscription) -> None:
        with self._lock:
            known = self._channels.get(subscription.channel)
            if known is None or subscription not in known.readers:
                return
            known.readers.remove(subscription)
            if not known.readers:
                del self._channels[subscription.channel]
                self._to_unsubscribe.append(subscription.channel)

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # -- the thread ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        backoff = Backoff(max_s=MAX_RECONNECT_DELAY_S)
        while not self._stopped.is_set():
            pubsub = self._client.pubsub()
            try:
                self._serve(pubsub)
            except redis.RedisError as e:
                if self.down_since is None:
                    self.down_since = time.monotonic()
                    logger.warning("event hub: lost Redis (%s); connecting again", e)
                self._stopped.wait(backoff.next_delay())
            else:
                backoff.reset()
            finally:
                with contextlib.suppress(redis.RedisError):
                    pubsub.close()

    def _serve(self, pubsub: Any) -> None:
        """Subscribe everything current on this connection, then read until stopped (or Redis fails)."""
        with self._lock:
            channels = list(self._channels)
            self._to_subscribe.clear()
            self._to_unsubscribe.clear()
        if channels:
            pubsub.subscribe(*channels)
        else:
            pubsub.ping()  # fail here, not later, while Redis is away
        if self.epoch:
            self.back_at = time.monotonic()
        self.epoch += 1
        self.down_since = None
        while not self._stopped.is_set():
            with self._lock:
                subscribe, self._to_subscribe = self._to_subscribe, []
                unsubscribe, self._to_unsubscribe = self._to_unsubscribe, []
            if unsubscribe:  # first: a channel left and joined again meanwhile ends up subscribed
                pubsub.unsubscribe(*unsubscribe)
            if subscribe:
                pubsub.subscribe(*subscribe)
            message = pubsub.get_message(timeout=READ_TIMEOUT_S)
            while message is not None:
                self._dispatch(message)
                message = pubsub.get_message(timeout=0)

    def _dispatch(self, message: dict[str, Any]) -> None:
        with self._lock:
            known = self._channels.get(message["channel"])
            readers = list(known.readers) if known is not None else []
        if known is None:  # unsubscribed meanwhile
            return
        if message["type"] == "message":
            for reader in readers:
                reader.messages.put(message["data"])
                if reader.wakeup is not None:  # after the put: a reader woken finds the message
                    reader.wakeup.set()
        elif message["type"] == "subscribe":
            known.confirmed.set()
