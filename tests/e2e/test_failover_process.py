"""A real failover: the services run against a primary, a replica and three Sentinels (every pid tracked), and
the primary dies (kill -9) or freezes while greedy streams, seeded sampled streams and queued requests are in
flight. Every request is counted as recovered, lost or duplicated against its fault-free text; lost and
duplicated must be 0. A negative control shows that the count catches a write the failover really lost."""

from __future__ import annotations

import collections
import json
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import requests

from shared.backoff import SENTINEL_MAX_DELAY_S
from shared.redis_client import connect
from tests.support.cluster import MODEL_NAME, Cluster, free_port, running_cluster, service_env
from tests.support.sentinel import DOWN_AFTER_MS, SentinelRedis

PROMPTS = ["Paged attention stores the KV cache in blocks", "A scheduler admits requests against free blocks"]
MAX_TOKENS = 120
RUNNING_PER_WORKER = 2
WORKERS = ("w1", "w2")

# Once the Sentinels name the new master, the services follow within their reconnect backoff; then the
# request itself (a second here, two on a slow host) and a second for the test's own look at the Sentinels.
# How long the Sentinels take to get there is theirs: down-after, then timers of a second each, and a split
# vote among them waits twice the failover-timeout before the next election (a CI run saw 7.3 s in all).
FOLLOW_MARGIN_S = SENTINEL_MAX_DELAY_S + 2 + 1


@dataclass
class Failover:
    redis: SentinelRedis
    cluster: Cluster

    def assert_all_alive(self) -> None:
        dead = {name: p.returncode for name, p in self.cluster.processes.items() if p.poll() is not None}
        assert not dead, f"services exited: {dead}\n{self.cluster.logs_tail()}"


def _cluster(
    tiny_model_path: str, tmp: pytest.TempPathFactory, without_engine: dict[str, str], **env: str
) -> Iterator[Failover]:
    sentinel = SentinelRedis(tmp.mktemp("sentinel")).start()
    settings = service_env(
        sentinel.url(),
        f"pagedserve-failover-{uuid.uuid4().hex[:8]}",
        tiny_model_path,
        free_port(),
        GATEWAY_WORKERS="1",
        NUM_KV_BLOCKS="128",
        MAX_RUNNING_PER_WORKER=str(RUNNING_PER_WORKER),
        REDIS_OUTAGE_GRACE_S="30",
        **env,
    )
    try:
        with running_cluster(settings, tmp.mktemp("failover-logs"), WORKERS, without_engine) as cluster:
            cluster.start("batch", "gateway.batch", **without_engine)
            yield Failover(sentinel, cluster)
    finally:
        sentinel.close()


@pytest.fixture(scope="module")
def cluster_under_sentinel(
    tiny_model_path: str, tmp_path_factory: pytest.TempPathFactory, without_engine: dict[str, str]
) -> Iterator[Failover]:
    yield from _cluster(tiny_model_path, tmp_path_factory, without_engine)


@pytest.fixture
def failover(cluster_under_sentinel: Failover) -> Iterator[Failover]:
    """The module's cluster, given back with a primary and an in-sync replica after each test's fault."""
    yield cluster_under_sentinel
    sentinel = cluster_under_sentinel.redis
    for name, proc in sentinel.procs.items():
        if not name.startswith("sentinel") and proc.poll() is not None:
            sentinel.restore(name)
    cluster_under_sentinel.cluster.wait_ready(len(WORKERS), timeout=60)


@pytest.fixture
def failover_without_repair(
    tiny_model_path: str, tmp_path_factory: pytest.TempPathFactory, without_engine: dict[str, str]
) -> Iterator[Failover]:
    """Workers that do not resend their writes after a failover: the negative control."""
    yield from _cluster(tiny_model_path, tmp_path_factory, without_engine, RESEND_WINDOW_S="0")


@dataclass
class Stream:
    """One streamed completion read on a thread: its text, its errors, how many times it ended."""

    body: dict[str, Any]
    text: list[str] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    ends: int = 0  # finish_reason chunks
    done_markers: int = 0  # `data: [DONE]`
    request_id: str = ""
    recorded: int = -1  # tokens in its token record once it ended
    done: threading.Event = field(default_factory=threading.Event)

    def start(self, base_url: str) -> Stream:
        threading.Thread(target=self._read, args=(base_url,), daemon=True).start()
        return self

    def _read(self, base_url: str) -> None:
        try:
            with requests.post(f"{base_url}/v1/completions", json=self.body, stream=True, timeout=300) as r:
                for line in r.iter_lines():
                    if line == b"data: [DONE]":
                        self.done_markers += 1
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = json.loads(line[len(b"data: ") :])
                    self.request_id = chunk.get("id", self.request_id)
                    if "error" in chunk:
                        self.errors.append(chunk["error"])
                        continue
                    for choice in chunk["choices"]:
                        self.text.append(choice["text"])
                        self.ends += choice.get("finish_reason") is not None
        except requests.RequestException as e:
            self.errors.append({"code": "client", "message": str(e)})
        finally:
            self.done.set()


def bodies() -> list[dict[str, Any]]:
    """Greedy and seeded sampled streams, more than the workers run at once (the rest wait queued)."""
    common = {"model": MODEL_NAME, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
    greedy = [{**common, "prompt": p, "temperature": 0} for p in PROMPTS * 2]
    seeded = [{**common, "prompt": p, "temperature": 1.0, "seed": 11 + n} for n, p in enumerate(PROMPTS * 2)]
    return greedy + seeded


def outcome(stream: Stream, expected: str) -> str:
    """recovered (exactly its fault-free text, ended once), duplicated (tokens or an end twice) or lost."""
    text = "".join(stream.text)
    if stream.errors or not stream.done.is_set():
        return "lost"
    if (
        stream.ends > 1
        or stream.done_markers > 1
        or (len(text) > len(expected) and text.startswith(expected))
    ):
        return "duplicated"
    return "recovered" if text == expected and stream.ends == 1 else "lost"


def fault_free(cluster: Cluster) -> list[str]:
    streams = [Stream(body).start(cluster.base_url) for body in bodies()]
    for s in streams:
        assert s.done.wait(300) and not s.errors, s.errors
    return ["".join(s.text) for s in streams]


def start_and_wait_running(cluster: Cluster) -> list[Stream]:
    streams = [Stream(body).start(cluster.base_url) for body in bodies()]
    running = len(WORKERS) * RUNNING_PER_WORKER
    deadline = time.monotonic() + 120
    while sum(len(s.text) >= 10 for s in streams) < running:
        assert time.monotonic() < deadline, f"streams did not start: {[s.errors for s in streams]}"
        time.sleep(0.02)
    assert sum(not s.text for s in streams) >= len(streams) - running  # the rest are queued
    return streams


def count(cluster: Cluster, streams: list[Stream], expected: list[str]) -> collections.Counter[str]:
    """Each stream's outcome; a stream whose token record lacks tokens its client had counts as lost too: a
    resume (its worker dying next, its client reconnecting) would read the record."""
    for s in streams:
        assert s.done.wait(300), "a stream hangs"
    # The records are read from the master the Sentinels name now: the cluster's own client has sat idle on
    # a connection to the old one, which (a replica still loading the new master's data) answers stale.
    master = connect(cluster.env["REDIS_URL"])
    counts: collections.Counter[str] = collections.Counter()
    for s, e in zip(streams, expected):
        got = outcome(s, e)
        s.recorded = master.llen(cluster.keys.tokens(s.request_id, 0))
        counts["lost" if got == "recovered" and s.recorded != MAX_TOKENS else got] += 1
    master.close()
    return counts


def report(streams: list[Stream], expected: list[str]) -> list[dict[str, Any]]:
    """What an assertion shows of each stream."""
    return [
        {"id": s.request_id, "errors": s.errors, "ends": s.ends, "same": "".join(s.text) == e}
        | {"recorded": s.recorded}
        for s, e in zip(streams, expected)
    ]


def first_success_after(cluster: Cluster, since: float, timeout: float = 30) -> float:
    """Seconds from `since` until a new request completes."""
    client = cluster.client().with_options(max_retries=0, timeout=10)
    while True:
        try:
            client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0)
            return time.monotonic() - since
        except Exception:
            assert time.monotonic() - since < timeout, "no request succeeded after the failover"
            time.sleep(0.05)


def test_the_primary_killed_mid_stream_loses_and_duplicates_nothing(failover: Failover) -> None:
    cluster, sentinel = failover.cluster, failover.redis
    expected = fault_free(cluster)
    streams = start_and_wait_running(cluster)
    old_port = sentinel.master_port()
    sentinel.kill_master()
    switch_s = sentinel.wait_for_new_master(old_port)
    counts = count(cluster, streams, expected)
    print(f"kill -9 of the primary: {dict(counts)}; switch {switch_s:.1f} s")
    assert counts == {"recovered": len(streams)}, report(streams, expected)
    failover.assert_all_alive()


def test_after_the_primary_dies_a_new_request_succeeds_soon_after_the_sentinels_name_another(
    failover: Failover,
) -> None:
    cluster, sentinel = failover.cluster, failover.redis
    old_port = sentinel.master_port()
    killed_at = time.monotonic()
    sentinel.kill_master()
    switched_at: list[float] = []

    def watch_switch() -> None:
        sentinel.wait_for_new_master(old_port)
        switched_at.append(time.monotonic())

    watch = threading.Thread(target=watch_switch)
    watch.start()
    # Sent right away, and again until one succeeds: the first success comes once every service follows.
    served_s = first_success_after(cluster, killed_at)
    watch.join(30)
    assert switched_at, "the Sentinels named no new master"
    switch_s = switched_at[0] - killed_at  # both from the kill
    print(f"kill -9 of the primary: switch {switch_s:.1f} s, first new request served {served_s:.1f} s after")
    assert switch_s >= DOWN_AFTER_MS / 1000  # the primary was down before it was replaced
    assert served_s - switch_s <= FOLLOW_MARGIN_S
    failover.assert_all_alive()


def test_a_frozen_primary_returns_as_a_replica_and_no_write_it_took_is_lost(failover: Failover) -> None:
    cluster, sentinel = failover.cluster, failover.redis
    expected = fault_free(cluster)
    streams = start_and_wait_running(cluster)
    old_port = sentinel.master_port()
    old = sentinel.name_of(old_port)
    frozen_at = time.monotonic()
    sentinel.signal(old, signal.SIGSTOP)
    switch_s = sentinel.wait_for_new_master(old_port)
    time.sleep(max(0.0, 5 - (time.monotonic() - frozen_at)))
    sentinel.signal(old, signal.SIGCONT)  # it still takes itself for the master until the Sentinels say
    sentinel.wait_role(old, "slave")
    counts = count(cluster, streams, expected)
    print(f"primary frozen 5 s: {dict(counts)}; switch {switch_s:.1f} s; {report(streams, expected)}")
    assert counts == {"recovered": len(streams)}, report(streams, expected)
    first_success_after(cluster, time.monotonic())
    failover.assert_all_alive()


def lose_the_last_writes(
    sentinel: SentinelRedis, hold_s: float, cluster: Cluster, running: list[Stream]
) -> list[Stream]:
    """Make the failover lose writes for real: the replica is pointed away from the primary (so no write of
    that time reaches it) for hold_s and until a running stream has had tokens meanwhile (tokens its client
    saw, so written), then the primary dies and that replica is promoted. Streams sent meanwhile are
    returned: their requests are among the writes lost."""
    replica = next(n for n in ("primary", "replica") if sentinel.ports[n] != sentinel.master_port())
    seen = [len(s.text) for s in running]
    away_at = time.monotonic()
    sentinel.client(replica).replicaof("127.0.0.1", str(free_port()))
    sent = [Stream(body).start(cluster.base_url) for body in bodies()[:: len(PROMPTS) * 2]]

    def written_meanwhile() -> bool:
        return any(len(s.text) >= n + 3 for s, n in zip(running, seen))

    while time.monotonic() - away_at < hold_s or not written_meanwhile():
        assert time.monotonic() - away_at < 30, "no stream had tokens while the replica was away"
        time.sleep(0.02)
    sentinel.kill_master()
    return sent


def test_writes_the_failover_lost_are_resent(failover: Failover) -> None:
    cluster, sentinel = failover.cluster, failover.redis
    expected = fault_free(cluster)
    streams = start_and_wait_running(cluster)
    sent = lose_the_last_writes(sentinel, hold_s=0.5, cluster=cluster, running=streams)
    streams, expected = streams + sent, expected + expected[:: len(PROMPTS) * 2]
    counts = count(cluster, streams, expected)
    print(f"the last 0.5 s of writes lost: {dict(counts)}")
    assert counts == {"recovered": len(streams)}, report(streams, expected)
    failover.assert_all_alive()


def test_negative_control_without_resending_the_count_shows_the_loss(
    failover_without_repair: Failover,
) -> None:
    cluster, sentinel = failover_without_repair.cluster, failover_without_repair.redis
    expected = fault_free(cluster)
    streams = start_and_wait_running(cluster)
    lose_the_last_writes(sentinel, hold_s=0.5, cluster=cluster, running=streams)
    counts = count(cluster, streams, expected)
    print(f"negative control (workers resend nothing): {dict(counts)}")
    assert counts["lost"] + counts["duplicated"] > 0, counts


def test_the_count_tells_lost_from_duplicated() -> None:
    done = threading.Event()
    done.set()

    def stream(text: list[str], ends: int = 1, errors: list[dict[str, Any]] | None = None) -> Stream:
        return Stream({}, text=text, ends=ends, errors=errors or [], done_markers=1, done=done)

    assert outcome(stream(["a", "b"]), "ab") == "recovered"
    assert outcome(stream(["a"]), "ab") == "lost"
    assert outcome(stream(["a", "b", "b"]), "ab") == "duplicated"
    assert outcome(stream(["a", "b"], ends=2), "ab") == "duplicated"
    assert outcome(stream(["a", "b"], errors=[{"code": "tokens_lost"}]), "ab") == "lost"
