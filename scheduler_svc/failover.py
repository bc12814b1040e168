"""Failover: a registered worker whose heartbeat expired is dead; its unfinished samples are re-queued."""

from __future__ import annotations

import logging
from collections.abc import Container, Mapping

import redis
from pydantic import ValidationError

from shared.keys import Keys
from shared.protocol import Assignment, GenerateRequest, decode
from shared.records import parse_ends, parse_tokens
from shared.redis_client import NamedPipeline
from shared.streams import Lease, queue_request

log = logging.getLogger(__name__)

# Long enough for one sweep (a few round trips), short enough that a scheduler dying mid-sweep delays little.
LOCK_TTL_S = 5.0


def resume_request(
    request: GenerateRequest, finished: Container[int], tokens: Mapping[int, list[int]]
) -> GenerateRequest | None:
    """The request for its unfinished samples, each resuming from its streamed tokens; None if all ended."""
    unfinished = [i for i in request.sample_indices() if i not in finished]
    if not unfinished:
        return None
    resume: dict[int, list[int]] = {}
    for i in unfinished:
        # The token record holds every token of the sample, those of earlier failovers included; the request's
        # own resume only matters if the record has expired meanwhile, so keep the longer.
        streamed = max(tokens.get(i, []), request.resume.get(i, []), key=len)
        if streamed:
            resume[i] = list(streamed)
    return request.model_copy(update={"samples": unfinished, "resume": resume})


class Failover:
    """Re-queues the work of dead workers through the requests stream and deletes their keys."""

    def __init__(self, client: redis.Redis, keys: Keys, owner: str) -> None:
        self._client = client
        self._keys = keys
        self._owner = owner

    def sweep(self, dead_worker_ids: list[str]) -> list[GenerateRequest] | None:
        """The re-queued requests; None when another scheduler holds the lock or a worker came back."""
        if not dead_worker_ids:
            return []
        lease = Lease(self._client, self._keys.scheduler_lock, LOCK_TTL_S, holder=self._owner)
        if not lease.acquire():
            return None
        try:
            return self._sweep(dead_worker_ids)
        except redis.WatchError:
            log.info("a worker presumed dead wrote to Redis during failover; retrying next round")
            return None
        finally:
            lease.release()

    def _sweep(self, dead_worker_ids: list[str]) -> list[GenerateRequest]:
        keys = self._keys
        with self._client.pipeline(transaction=True) as tx:
            # A worker that was only slow may heartbeat again or finish a request while we work: the
            # watch turns the final MULTI into a no-op then, and the next round looks again.
            tx.watch(*(k for wid in dead_worker_ids for k in (keys.worker(wid), keys.assigned(wid))))
            read = NamedPipeline(self._client)
            for wid in dead_worker_ids:
                read.named(("alive", wid)).exists(keys.worker(wid))
                read.named(("assigned", wid)).hgetall(keys.assigned(wid))
            replies = read.execute()
            dead: list[str] = []
            requests: list[GenerateRequest] = []
            for wid in dead_worker_ids:
                if replies[("alive", wid)]:
                    continue
                dead.append(wid)
                for rid, data in replies[("assigned", wid)].items():
                    try:
                        requests.append(decode(Assignment, data).request)
                    except ValidationError as exc:
                        log.error("dropping unreadable assignment %s of dead worker %s: %s", rid, wid, exc)
            requeue = self._resumed(requests)
            tx.multi()
            for request in requeue:
                queue_request(tx, keys.requests, request)
            for wid in dead:
                tx.delete(
                    keys.inbox(wid),
                    keys.assigned(wid),
                    keys.reserved(wid),
                    keys.kv_blocks(wid),
                    keys.kv_events(wid),
                    keys.kv_map(wid),
                )
                tx.srem(keys.workers, wid)
            tx.execute()
        for request in requeue:
            log.warning(
                "re-queued %s samples %s (resuming after %s tokens)",
                request.request_id,
                request.samples,
                {i: len(t) for i, t in request.resume.items()},
            )
        if dead:
            log.warning("removed dead workers %s", dead)
        return requeue

    def _resumed(self, requests: list[GenerateRequest]) -> list[GenerateRequest]:
        """One pipeline reads every request's abort flag, finished samples and streamed tokens."""
        keys = self._keys
        read = NamedPipeline(self._client)
        for request in requests:
            rid = request.request_id
            read.named(("aborted", rid)).exists(keys.abort_flag(rid))
            read.named(("finished", rid)).hgetall(keys.finished(rid))
            for i in request.sample_indices():
                read.named(("tokens", rid, i)).lrange(keys.tokens(rid, i), 0, -1)
        replies = read.execute()
        requeue: list[GenerateRequest] = []
        for request in requests:
            rid = request.request_id
            if replies[("aborted", rid)]:
                log.info("not re-queuing aborted request %s", rid)
                continue
            finished = parse_ends(replies[("finished", rid)])
            tokens = {i: parse_tokens(replies[("tokens", rid, i)]) for i in request.sample_indices()}
            resumed = resume_request(request, finished, tokens)
            if resumed is not None:
                requeue.append(resumed)
        return requeue
