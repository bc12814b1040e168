"""The event hub: one pub/sub connection per process, handing each message to its request."""

from __future__ import annotations

import threading

import pytest
import redis


def test_a_shared_wakeup_is_set_by_a_message_on_any_of_its_channels(hub, r, keys) -> None:
    wakeup = threading.Event()
    subscriptions = [hub.subscribe(keys.events(f"cmpl-{i}"), 5.0, wakeup) for i in range(3)]
    alone = hub.subscribe(keys.events("cmpl-alone"), 5.0)
    r.publish(keys.events("cmpl-alone"), "elsewhere")
    assert alone.messages.get(timeout=2) == "elsewhere"
    assert not wakeup.is_set()
    r.publish(keys.events("cmpl-2"), "news")
    assert wakeup.wait(2)
    assert subscriptions[2].messages.get_nowait() == "news"
    assert subscriptions[0].messages.empty() and subscriptions[1].messages.empty()


def test_subscriptions_asked_together_are_confirmed_together(hub, r, keys) -> None:
    """A batch's prompts ask for their subscriptions first and wait once they are all asked for; a
    subscription dropped before its confirmation is refused."""
    channels = [keys.events(f"cmpl-{i}") for i in range(8)]
    subscriptions = [hub.subscribe(c, 5.0, wait=False) for c in channels]
    for subscription in subscriptions:
        hub.confirm(subscription, 5.0)
    assert r.pubsub_numsub(*channels) == [(c, 1) for c in channels]
    r.publish(channels[5], "news")
    assert subscriptions[5].messages.get(timeout=2) == "news"
    hub.unsubscribe(subscriptions[0])
    with pytest.raises(redis.TimeoutError):
        hub.confirm(subscriptions[0], 0.5)
