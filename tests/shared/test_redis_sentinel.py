"""REDIS_URL under Sentinel: the URL's form, and a client that follows a real failover (primary, replica and
three Sentinels on loopback): scripts, blocked reads and writes to a demoted master all go on at the new
master. And the idempotent writes a failover's repair relies on."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from gateway.serving.batch_queue import celery_url
from gpu_worker.outbox import Outbox
from shared.keys import Keys
from shared.records import APPEND_TOKENS
from shared.redis_client import connect, describe_url, parse_sentinel_url
from shared.reservations import RECOUNT_SCRIPT
from shared.settings import CommonSettings
from shared.streams import BLOCKS_FIELD
from tests.support.sentinel import SentinelRedis


def test_a_sentinel_url_names_its_sentinels_master_and_database() -> None:
    url = parse_sentinel_url("redis+sentinel://:s3cret@10.0.0.1:26379,[::1]:26380/pagedserve/2")
    assert url.sentinels == (("10.0.0.1", 26379), ("::1", 26380))
    assert (url.master, url.db, url.password) == ("pagedserve", 2, "s3cret")
    assert parse_sentinel_url("redis+sentinel://h:1/m").db == 0
    assert describe_url("redis+sentinel://:s3cret@h:1/m") == "redis+sentinel://:***@h:1/m"


@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel://host/m",
        "redis+sentinel://h:1/",
        "redis+sentinel://h:1/m/x",
        "redis+sentinel://h:x/m",
    ],
)
def test_a_malformed_sentinel_url_is_refused_at_start_up(url: str) -> None:
    with pytest.raises(ValueError, match=r"Sentinel|path"):
        CommonSettings(redis_url=url)


def test_celery_gets_the_sentinels_in_its_own_form() -> None:
    url, options = celery_url("redis+sentinel://:pw@a:1,b:2/pagedserve/3")
    assert url == "sentinel://:pw@a:1/3;sentinel://:pw@b:2/3"
    assert options == {"master_name": "pagedserve"}
    assert celery_url("redis://h:6379/0") == ("redis://h:6379/0", {})


@pytest.fixture
def sentinel(tmp_path: Path) -> Iterator[SentinelRedis]:
    redis_set = SentinelRedis(tmp_path).start()
    try:
        yield redis_set
    finally:
        redis_set.close()


def until(call, timeout: float = 15.0):  # type: ignore[no-untyped-def]
    """call's result once it stops raising Redis errors (a client retries so while the master moves)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_a_client_follows_a_killed_master_scripts_included(sentinel: SentinelRedis) -> None:
    client = connect(sentinel.url(1))
    incr = client.register_script("return redis.call('INCR', KEYS[1])")
    assert incr(keys=["n"]) == 1
    old = sentinel.master_port()
    sentinel.kill_master()
    sentinel.wait_for_new_master(old)
    # The promoted replica has the data but not the script cache: NOSCRIPT is answered by loading it again.
    assert until(lambda: incr(keys=["n"])) == 2
    assert client.connection_pool.get_master_address()[1] != old  # type: ignore[attr-defined]


def test_a_demoted_master_sends_readers_and_writers_to_the_new_one(sentinel: SentinelRedis) -> None:
    """The primary frozen past down-after: the Sentinels promote the replica; released, the old primary is
    made a replica. Blocked reads cut short (UNBLOCKED) and refused writes (READONLY) become connection
    errors, and the next attempt reaches the new master."""
    client = connect(sentinel.url(2))
    client.xgroup_create("s", "g", id="0", mkstream=True)
    errors: list[BaseException] = []

    def blocked_read() -> None:
        try:
            client.xreadgroup("g", "c", {"s": ">"}, block=20000)
        except redis.RedisError as e:
            errors.append(e)

    reader = threading.Thread(target=blocked_read)
    reader.start()
    old = sentinel.master_port()
    name = sentinel.name_of(old)
    sentinel.signal(name, signal.SIGSTOP)
    sentinel.wait_for_new_master(old)
    sentinel.signal(name, signal.SIGCONT)
    sentinel.wait_role(name, "slave")
    reader.join(timeout=30)
    assert errors and all(isinstance(e, redis.ConnectionError) for e in errors), errors
    assert until(lambda: client.set("after", "1"))
    assert client.connection_pool.get_master_address()[1] != old  # type: ignore[attr-defined]


def test_token_records_take_each_token_once_at_its_position(r: redis.Redis, keys: Keys) -> None:
    key = keys.tokens("rid", 0)
    append = r.register_script(APPEND_TOKENS)
    assert append(keys=[key], args=[0, 60, 1, 2, 3]) == 0
    assert append(keys=[key], args=[0, 60, 1, 2, 3]) == 0  # sent again: nothing changes
    assert append(keys=[key], args=[2, 60, 3, 4]) == 0  # overlapping: only the new token goes in
    assert append(keys=[key], args=[6, 60, 7]) == 2  # a hole before it: refused, the hole named
    assert [int(t) for t in r.lrange(key, 0, -1)] == [1, 2, 3, 4]
    many = list(range(5, 2600))  # past one RPUSH's worth of arguments
    assert append(keys=[key], args=[4, 60, *many]) == 0
    assert [int(t) for t in r.lrange(key, 0, -1)] == [1, 2, 3, 4, *many]


def test_the_outbox_resends_what_it_sent_within_its_window(r: redis.Redis, keys: Keys) -> None:
    outbox = Outbox(resend_window_s=60)
    outbox.eval(APPEND_TOKENS, 1, keys.tokens("a", 0), 0, 60, 7, 8)
    outbox.hset(keys.finished("a"), "0", "end")
    outbox.flush(r)
    r.delete(keys.tokens("a", 0), keys.finished("a"))  # what a failover to a lagging replica loses
    assert outbox.resend(r) == 2
    outbox.resend(r)  # again: idempotent
    assert r.lrange(keys.tokens("a", 0), 0, -1) == ["7", "8"] and r.hget(keys.finished("a"), "0") == "end"
    assert Outbox(resend_window_s=0).resend(r) == 0


def test_a_recount_sets_the_counter_to_the_entries_not_taken_in(r: redis.Redis, keys: Keys) -> None:
    inbox, counter = keys.inbox("w"), keys.reserved("w")
    taken = r.xadd(inbox, {"data": "{}", BLOCKS_FIELD: 3})
    r.xadd(inbox, {"data": "{}", BLOCKS_FIELD: 4})
    r.xadd(inbox, {"data": "{}", BLOCKS_FIELD: 5})
    r.set(counter, 99)  # drifted: a give-back or a reservation lost in a failover
    recount = r.register_script(RECOUNT_SCRIPT)
    assert recount(keys=[inbox, counter], args=[taken]) == 9
    assert recount(keys=[inbox, counter], args=["0-0"]) == 12 and r.get(counter) == "12"


def _read_cut_while_frozen(sentinel: SentinelRedis, watched: bool) -> list[BaseException]:
    """A client with a read waiting on the master; the master frozen until the Sentinels switch, and 1 s
    more: what the read raised while the old master was still frozen."""
    client = connect(sentinel.url(3), max_connections=4)
    if not watched:
        client.failover_watch.stop()  # type: ignore[attr-defined]
    client.xgroup_create("s", "g", id="0", mkstream=True)
    errors: list[BaseException] = []

    def waiting_read() -> None:
        try:
            client.xreadgroup("g", "c", {"s": ">"}, block=1000)  # answered in 1 s, by a live master
        except redis.RedisError as e:
            errors.append(e)

    old = sentinel.master_port()
    name = sentinel.name_of(old)
    sentinel.signal(name, signal.SIGSTOP)
    reader = threading.Thread(target=waiting_read, daemon=True)
    reader.start()
    try:
        sentinel.wait_for_new_master(old)
        reader.join(timeout=3)  # the announcement reaches the watch
        return list(errors)
    finally:
        sentinel.signal(name, signal.SIGCONT)
        sentinel.wait_role(name, "slave")


def test_a_switch_announced_cuts_the_connections_to_a_frozen_master(sentinel: SentinelRedis) -> None:
    """Nothing waits on a master that froze once the Sentinels have switched: the read waiting on it fails
    as a lost connection (the caller's retry goes to the new master)."""
    cut = _read_cut_while_frozen(sentinel, watched=True)
    assert cut and all(isinstance(e, redis.ConnectionError) for e in cut), cut


def test_without_the_watch_a_client_waits_on_the_frozen_master(sentinel: SentinelRedis) -> None:
    """The negative control: unwatched, the read still waits on the old master."""
    assert not _read_cut_while_frozen(sentinel, watched=False)
