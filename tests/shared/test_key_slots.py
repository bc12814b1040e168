"""Ready for Redis Cluster: every multi-key script, MULTI/EXEC and multi-key command touches keys of one hash
slot (DESIGN.md, "Redis, the rules"; the names and their hash tags are shared.keys').

- The slot function, against the Cluster specification's examples and a cluster-mode redis-server.
- SITES: every place the services open a transaction or call a script (found in their source), with the
  keys one call combines, built with Keys as the code builds them: one slot each, but for ALLOWED.
- A workload of the real services in this process (the gateway's app, the scheduler, simulated workers, a
  batch run, a failover), recorded by MONITOR: every transaction (with its WATCH), script call (its KEYS and
  the keys its commands touched) and command is on one slot, but for ALLOWED's; every key under the prefix
  is one that Keys builds; and every site of SITES shows in the recording, but for UNEXERCISED's.
"""

from __future__ import annotations

import ast
import io
import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from flask.testing import FlaskClient

from gateway.app import create_app
from gateway.batch.settings import BatchSettings
from gateway.batch.worker import build_runner
from gateway.settings import GatewaySettings
from gpu_worker.service import WorkerService
from gpu_worker.settings import engine_config
from gpu_worker.simulation import simulated_engine
from scheduler_svc.service import SchedulerService
from shared.keys import Keys
from shared.protocol import Assignment, GenerateRequest, Heartbeat, encode
from shared.redis_client import connect
from shared.sampling import SamplingSpec
from shared.settings import DEFAULT_MODEL_NAME
from tests.support.cluster import start_redis_on_a_free_port
from tests.support.key_slots import (
    SCRIPT_CALLS,
    Group,
    KeyKinds,
    Monitor,
    crc16,
    fill_keys,
    groups_of,
    hashed_part,
    key_slot,
    parse_line,
)
from tests.support.scheduler_stage import make_settings
from tests.support.simulated import FAST, worker_settings

ROOT = Path(__file__).resolve().parents[2]
W, W2, R, R2, B = "w1", "w2", "cmpl-1", "cmpl-2", "batch_1"
REQUEST_KINDS = frozenset({"abort_flag", "request_meta", "attached", "events", "tokens", "finished"})


@dataclass(frozen=True)
class Site:
    """A place that opens a transaction or calls a script: what one call of it combines, and the kinds of key
    (Keys' method names) that tell its calls apart in a recording."""

    kind: str  # "multi" or "script"
    calls: Callable[[Keys], list[list[str]]]  # the keys of each sort of call, as the code builds them
    marks: frozenset[str]


def multi(calls: Callable[[Keys], list[list[str]]], *marks: str) -> Site:
    return Site("multi", calls, frozenset(marks))


def script(calls: Callable[[Keys], list[list[str]]], *marks: str) -> Site:
    return Site("script", calls, frozenset(marks))


def worker_keys(k: Keys, wid: str) -> list[str]:
    return [k.inbox(wid), k.assigned(wid), k.reserved(wid), k.kv_blocks(wid), k.kv_events(wid), k.kv_map(wid)]


# Found by transaction_and_script_sites(); a site that is new, renamed or gone fails the inventory test.
SITES: dict[str, Site | None] = {
    "gateway/serving/batch_records.py:BatchStore.__init__": script(  # _RECORD_LINE, run by record()
        lambda k: [[k.batch_done(B), k.batch(B)]], "batch_done", "batch"
    ),
    "gateway/serving/batch_records.py:BatchStore.claim": multi(
        lambda k: [[k.batch_claims(B)]], "batch_claims"
    ),
    "gateway/serving/batch_records.py:BatchStore.move": multi(lambda k: [[k.batch(B)]], "batch"),
    "gateway/serving/generation.py:Generation._resend": multi(
        lambda k: [[k.request_meta(R), k.tokens(R, 0), k.tokens(R, 1), k.requests]], "request_meta", "tokens"
    ),
    "gateway/serving/generation.py:abort_request": multi(lambda k: [[k.abort_flag(R)]], "abort_flag"),
    "gateway/serving/generation.py:queue_requests": multi(  # one request or a prompt batch, WATCHed if named
        lambda k: [[k.request_meta(R), k.requests], [k.request_meta(R), k.request_meta(R2), k.requests]],
        "request_meta",
        "requests",
    ),
    "gateway/serving/response_store.py:ResponseStore.update": multi(lambda k: [[k.response(R)]], "response"),
    "gpu_worker/kv_publisher.py:KVPublisher.publish": multi(
        lambda k: [[k.kv_blocks(W), k.kv_events(W)]], "kv_events"
    ),
    "gpu_worker/kv_publisher.py:KVPublisher.rewrite": multi(
        lambda k: [[k.kv_blocks(W), k.kv_events(W)]], "kv_blocks", "kv_events"
    ),
    "gpu_worker/service.py:WorkerService.__init__": script(  # RECOUNT_SCRIPT, run by _repair()
        lambda k: [[k.inbox(W), k.reserved(W)]], "inbox", "reserved"
    ),
    "gpu_worker/service.py:WorkerService.heartbeat": multi(
        lambda k: [[k.worker(W), k.kv_map(W), k.workers, k.reserved(W), k.inbox(W)]], "worker", "workers"
    ),
    "scheduler_svc/failover.py:Failover._sweep": multi(
        lambda k: [
            [k.worker(W), k.assigned(W), k.worker(W2), k.assigned(W2)]  # WATCHed
            + [k.requests, *worker_keys(k, W), *worker_keys(k, W2), k.workers]
        ],
        "assigned",
        "workers",
    ),
    "scheduler_svc/prefix_index.py:KVEventReader._resync": multi(
        lambda k: [[k.kv_blocks(W), k.kv_events(W), k.kv_blocks(W2), k.kv_events(W2)]],
        "kv_blocks",
        "kv_events",
    ),
    "scheduler_svc/reserve.py:Reserver.__init__": script(  # ADMIT_SCRIPT, run by admit()
        lambda k: [[k.worker(W), k.reserved(W), k.inbox(W), k.assigned(W), k.requests]], "inbox", "requests"
    ),
    "shared/records.py:push_event": script(lambda k: [[k.tokens(R, 0)]], "tokens"),  # APPEND_TOKENS
    "shared/streams.py:Lease.__init__": script(  # the lease script, run by renew() and release()
        lambda k: [[k.scheduler_lock], [k.batch_lease(B)]], "scheduler_lock"
    ),
    "shared/registry.py:WorkerRegistry.read": multi(  # with_maps: each heartbeat with its map (dashboard)
        lambda k: [[k.worker(W), k.assigned(W), k.reserved(W), k.kv_map(W)] + [k.worker(W2), k.kv_map(W2)]],
        "kv_map",
        "assigned",
    ),
    # Its caller's: NamedPipeline(client, transaction=True) is a site of its own.
    "shared/redis_client.py:NamedPipeline.__init__": None,
}

# Sites that still cross slots, each waiting for the change that will make its writes a plain pipeline of
# idempotent writes (their files' owner is on it): remove an entry once its site is fixed (the inventory test
# says when). Nothing else may cross.
ALLOWED: dict[str, str] = {
    "gateway/serving/generation.py:queue_requests": "each request's record and stream entry, all or none",
    "gateway/serving/generation.py:Generation._resend": "the request's record, tokens and entry again",
}

# Sites the workload cannot reach, and why (each is covered by the inventory's slot check alone).
UNEXERCISED: dict[str, str] = {
    "gateway/serving/generation.py:Generation._resend": "only once Redis came back without the request",
    "gpu_worker/service.py:WorkerService.__init__": "its recount runs only when a worker rejoins a Redis",
    "shared/redis_client.py:NamedPipeline.__init__": "its callers' transactions are sites of their own",
}


# -- the slot function -------------------------------------------------------------------------------------


def test_the_slot_function_follows_the_cluster_specification() -> None:
    assert crc16(b"123456789") == 0x31C3  # the specification's check value of its CRC16
    assert key_slot("{user1000}.following") == key_slot("{user1000}.followers") == key_slot("user1000")
    assert hashed_part("foo{}{bar}") == b"foo{}{bar}"  # an empty tag: the whole key is hashed
    assert hashed_part("foo{{bar}}zap") == b"{bar"  # from the first { to the first } after it
    assert hashed_part("foo{bar}{zap}") == b"bar"  # the first tag only
    assert key_slot("no tag at all") != key_slot("no tag at all!")


@pytest.fixture(scope="module")
def cluster_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[redis.Redis]:
    """A redis-server in cluster mode holding every slot (CLUSTER KEYSLOT answers there alone)."""
    folder = tmp_path_factory.mktemp("cluster-node")
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    cluster = ("--cluster-enabled", "yes", "--cluster-config-file", str(folder / "nodes.conf"))
    proc, port = start_redis_on_a_free_port(folder, extra=cluster)
    client = redis.Redis(port=port, decode_responses=True, socket_timeout=5, socket_connect_timeout=2)
    try:
        client.execute_command("CLUSTER ADDSLOTSRANGE", 0, 16383)
        yield client
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=10)


def every_kind_of_key(k: Keys) -> list[str]:
    """One key of every kind Keys builds (and a few odd ids)."""
    return sorted(
        {key for site in SITES.values() if site for call in site.calls(k) for key in call}
        | {k.attached(R), k.events(R), k.finished(R), k.files, k.file("file-1"), k.batches, k.aborts}
        | {k.scheduler_stats, k.routing_log, k.tokens("chatcmpl-ü{x", 3), k.celery_prefix + "unacked"}
    )


def test_the_slot_function_agrees_with_a_cluster_node(cluster_node: redis.Redis) -> None:
    keys = [*every_kind_of_key(Keys()), "123456789", "foo{}{bar}", "foo{{bar}}zap", "{user1000}.following"]
    pipe = cluster_node.pipeline(transaction=False)
    for key in keys:
        pipe.execute_command("CLUSTER KEYSLOT", key)
    assert dict(zip(keys, pipe.execute())) == {key: key_slot(key) for key in keys}


def test_monitor_lines_are_read_back_as_sent() -> None:
    line = rb'1700000000.000001 [0 127.0.0.1:5000] "SET" "a \"b\" \\ \x00\xc3\xbc\n" "{x}"'
    assert parse_line(line) == ("127.0.0.1:5000", [b"SET", b'a "b" \\ \x00\xc3\xbc\n', b"{x}"])
    assert parse_line(b'1700000000.000002 [0 lua] "GET" "k"') == ("lua", [b"GET", b"k"])
    lines = [
        b'1.0 [0 1.1.1.1:1] "WATCH" "{a}1"',
        b'1.1 [0 2.2.2.2:2] "GET" "x"',
        b'1.2 [0 1.1.1.1:1] "MULTI"',
        b'1.3 [0 1.1.1.1:1] "EVALSHA" "f00" "1" "{a}2"',
        b'1.4 [0 lua] "GET" "{b}3"',
        b'1.5 [0 1.1.1.1:1] "EXEC"',
    ]
    get, evalsha, watch_multi = groups_of(lines)  # a transaction counts once it has run
    assert (watch_multi.what, [c[0] for c in watch_multi.commands]) == ("MULTI", [b"WATCH", b"EVALSHA"])
    assert watch_multi.inner == evalsha.inner == [[b"GET", b"{b}3"]] and get.what == "GET"


# -- the sites, from the source ----------------------------------------------------------------------------

FOLDERS = ("gateway", "scheduler_svc", "gpu_worker", "shared")
SCRIPT_METHODS = frozenset({"register_script", "eval", "evalsha", "fcall", "script_load"})
TRANSACTION_METHODS = frozenset({"multi", "watch", "transaction"})


def opens_a_site(call: ast.Call) -> bool:
    """A script call or registration, a transaction, or a pipeline that is one (redis-py's default)."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if name in SCRIPT_METHODS:
        return bool(call.args) or name != "eval"  # (a torch module's eval() takes none)
    if name in TRANSACTION_METHODS:
        return isinstance(func, ast.Attribute)
    if name in ("pipeline", "NamedPipeline"):
        transaction = next((kw.value for kw in call.keywords if kw.arg == "transaction"), None)
        if transaction is None:
            return name == "pipeline"
        return not (isinstance(transaction, ast.Constant) and transaction.value is False)
    return False


def transaction_and_script_sites() -> set[str]:
    """`path:Class.function` of every function in the services' source that opens a site."""
    found = set()

    def visit(node: ast.AST, scope: list[str], path: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                visit(child, [*scope, child.name], path)
                continue
            if isinstance(child, ast.Call) and opens_a_site(child):
                found.add(f"{path}:{'.'.join(scope)}")
            visit(child, scope, path)

    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            visit(ast.parse(path.read_text(), str(path)), [], str(path.relative_to(ROOT)))
    return found


def test_every_transaction_and_script_of_the_services_is_a_known_site() -> None:
    found = transaction_and_script_sites()
    assert not found - set(SITES), (
        f"new sites: add them to SITES with the keys they combine: {found - set(SITES)}"
    )
    assert not set(SITES) - found, f"sites that are gone: remove them from SITES: {set(SITES) - found}"
    assert set(ALLOWED) <= set(SITES) and set(UNEXERCISED) <= set(SITES)


def test_each_site_combines_keys_of_one_slot() -> None:
    keys = Keys()
    crossing = {
        name: call
        for name, site in SITES.items()
        if site
        for call in site.calls(keys)
        if len({key_slot(key) for key in call}) > 1
    }
    unexpected = {name: call for name, call in crossing.items() if name not in ALLOWED}
    assert not unexpected, "sites whose keys cross slots:\n" + "\n".join(
        f"{n}: {c}" for n, c in unexpected.items()
    )
    fixed = set(ALLOWED) - set(crossing)
    assert not fixed, f"these no longer cross slots: remove them from ALLOWED: {fixed}"


# -- a workload, recorded ----------------------------------------------------------------------------------

MODEL = DEFAULT_MODEL_NAME
CMPL = "/v1/completions"


class Recording:
    """What the workload sent, as groups, with each key's kind."""

    def __init__(self, groups: list[Group], keys: Keys) -> None:
        self.groups = groups
        self.kinds = KeyKinds(keys)

    def kinds_of(self, group: Group) -> set[str | None]:
        return {self.kinds.kind(key) for key in group.keys}

    def num_requests(self, keys: set[str] | list[str]) -> int:
        """How many requests' keys are among keys."""
        return len({hashed_part(k) for k in keys if self.kinds.kind(k) in REQUEST_KINDS})

    def matches(self, group: Group, site: Site, keys: Keys) -> bool:
        """Whether the group is a call of the site: of its sort, with its marks and no kind it never uses,
        over one request or several as the site's calls are."""
        sort = "script" if group.what.encode() in SCRIPT_CALLS else "multi" if group.what == "MULTI" else ""
        if sort != site.kind:
            return False
        kinds = self.kinds_of(group)
        several = self.num_requests(group.keys) > 1
        fits = any(
            kinds <= {self.kinds.kind(key) for key in call} and (self.num_requests(call) > 1) == several
            for call in site.calls(keys)
        )
        return fits and site.marks <= kinds


def test_a_workload_of_the_services_keeps_every_group_of_keys_on_one_slot(
    redis_url: str, keys: Keys, r: redis.Redis, tiny_model_path: str, hf_tokenizer: Any, tmp_path: Path
) -> None:
    with Monitor(redis_url) as monitor:
        run_workload(redis_url, keys, r, tiny_model_path, len(hf_tokenizer), tmp_path)
    client = redis.Redis.from_url(redis_url)
    groups = fill_keys(client, groups_of(monitor.lines), f"{keys.prefix}:".encode())
    client.close()
    recording = Recording(groups, keys)

    unnamed = sorted({k for g in groups for k in g.keys if recording.kinds.kind(k) is None})
    assert not unnamed, f"keys under the prefix that shared.keys does not name: {unnamed}"

    allowed_sites = {name: site for name, site in SITES.items() if name in ALLOWED and site is not None}
    violations, allowed, celery = [], dict[str, int](), 0
    for group in groups:
        if len(group.slots()) <= 1 and not group.undeclared():
            continue
        if recording.kinds_of(group) == {"celery"}:
            celery += 1  # Celery's own transactions over its own keys (its Redis transport is no Cluster's)
            continue
        site = next(
            (name for name, known in allowed_sites.items() if recording.matches(group, known, keys)), None
        )
        if site is None:
            undeclared = f" (undeclared: {sorted(group.undeclared())})" if group.undeclared() else ""
            violations.append(group.describe() + undeclared)
        else:
            allowed[site] = allowed.get(site, 0) + 1
    print(f"{len(groups)} groups recorded; crossing slots, allowed: {allowed}; Celery's own: {celery}")
    assert not violations, "\n".join([f"{len(violations)} groups cross slots:", *sorted(violations)])
    scripts = [g for g in groups if g.what.encode() in SCRIPT_CALLS]
    assert any(g.inner for g in scripts), "MONITOR showed no script's own commands: the recording is broken"

    seen = {
        name
        for name, site in SITES.items()
        if site and any(recording.matches(group, site, keys) for group in groups)
    }
    assert set(SITES) - seen == set(UNEXERCISED), f"sites the workload never reached: {set(SITES) - seen}"


def run_workload(
    redis_url: str, keys: Keys, r: redis.Redis, model_path: str, vocab_size: int, tmp_path: Path
) -> None:
    """The services in this process, serving what a client does: completions (one, streamed with n=2, a list
    of prompts, chat), a stream dropped (aborted), a batch (upload, create, run, list, delete) and a dead
    worker's request (failover)."""
    common = {
        "redis_url": redis_url,
        "redis_prefix": keys.prefix,
        "model": model_path,
        "batch_storage_dir": str(tmp_path / "files"),
        "request_timeout_s": 60.0,
    }
    scheduler = SchedulerService(
        make_settings(redis_url, keys.prefix),
        client=connect(redis_url, client_name=f"{keys.prefix}:scheduler"),
    )
    settings = worker_settings(redis_url, keys.prefix)
    workers = [
        WorkerService(
            settings.model_copy(update={"worker_id": f"sim-{i}"}),
            # Every token id of the gateway's tokenizer is one the simulated model takes.
            engine=simulated_engine(engine_config(settings), FAST, vocab_size=vocab_size),
        )
        for i in range(2)
    ]
    threads = [threading.Thread(target=s, daemon=True) for s in (scheduler.run, *(w.serve for w in workers))]
    for thread in threads:
        thread.start()
    ghost_rid = stage_a_dead_worker(r, keys)
    app = create_app(
        GatewaySettings.model_validate({**common, "sse_heartbeat_s": 0.05, "resume_grace_s": 0.2})
    )
    try:
        client = app.test_client()
        wait_until(lambda: client.get("/ready").status_code == 200)
        complete(client, {"prompt": "Once upon a time", "max_tokens": 4})
        complete(client, {"prompt": "Once", "max_tokens": 4, "n": 2, "stream": True})
        complete(client, {"prompt": ["one", "two", "three"], "max_tokens": 3})
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        assert client.post("/v1/chat/completions", json=chat).status_code == 200
        drop_a_stream(client, r, keys)
        run_a_background_response(client)
        run_a_batch(client, common)
        assert client.get("/metrics").status_code == client.get("/dashboard/state").status_code == 200
        wait_until(lambda: r.hlen(keys.finished(ghost_rid)) == 1, timeout=30)
    finally:
        for worker in workers:
            worker.stop()
        scheduler.stop()
        for thread in threads:
            thread.join(timeout=10)
        app.extensions["pagedserve"].hub.stop()


def complete(client: FlaskClient, body: dict[str, Any]) -> None:
    response = client.post(CMPL, json={"model": MODEL, **body})
    text = response.get_data(as_text=True)
    assert response.status_code == 200 and ("[DONE]" in text if body.get("stream") else "choices" in text), (
        text
    )


def drop_a_stream(client: FlaskClient, r: redis.Redis, keys: Keys) -> None:
    """A stream whose client goes away: aborted after the resume grace."""
    body = {"model": MODEL, "prompt": "Long", "max_tokens": 1500, "stream": True}
    response = client.post(CMPL, json=body, buffered=False)
    next(iter(response.response))
    response.close()
    wait_until(lambda: any(r.scan_iter(match=keys.abort_flag("*"))))


def run_a_background_response(client: FlaskClient) -> None:
    """A stored response run in the background, polled to its end."""
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 3, "background": True}
    response_id = client.post("/v1/responses", json=body).get_json()["id"]
    wait_until(lambda: client.get(f"/v1/responses/{response_id}").get_json()["status"] == "incomplete")


def run_a_batch(client: FlaskClient, common: dict[str, Any]) -> None:
    """Upload a file, create a batch of it, run it here (the batch worker's runner), list, delete."""
    lines = [
        {"custom_id": f"line-{i}", "method": "POST", "url": CMPL, "body": {"model": MODEL, "prompt": f"p{i}"}}
        for i in range(3)
    ]
    data = "".join(json.dumps({**line, "body": {**line["body"], "max_tokens": 2}}) + "\n" for line in lines)
    upload = {"purpose": "batch", "file": (io.BytesIO(data.encode()), "in.jsonl")}
    file_id = client.post("/v1/files", data=upload, content_type="multipart/form-data").get_json()["id"]
    batch = {"input_file_id": file_id, "endpoint": CMPL, "completion_window": "24h"}
    batch_id = client.post("/v1/batches", json=batch).get_json()["id"]
    runner = build_runner(BatchSettings.model_validate({**common, "batch_slice_s": 10.0}))
    try:
        deadline = time.monotonic() + 60
        while runner.run(batch_id) != "ended":
            assert time.monotonic() < deadline, "the batch never ended"
    finally:
        runner._ctx.hub.stop()
    assert client.get(f"/v1/batches/{batch_id}").get_json()["status"] == "completed"
    assert client.get("/v1/batches").status_code == client.get("/v1/files").status_code == 200
    assert client.delete(f"/v1/files/{file_id}").status_code == 200


def stage_a_dead_worker(r: redis.Redis, keys: Keys) -> str:
    """A worker that registered, was sent a request and died: its heartbeat expires at once; failover
    re-queues the request to the live workers. Returns the request's id."""
    now = time.time()
    beat = Heartbeat(
        worker_id="ghost",
        model=MODEL,
        free_blocks=0,  # nothing more is admitted to it meanwhile
        total_blocks=64,
        block_size=16,
        num_running=1,
        num_waiting=0,
        last_step_time=now,
        started_at=now,
        max_model_len=2048,
    )
    spec = SamplingSpec(temperature=0.0, max_tokens=3)
    request = GenerateRequest(
        request_id="cmpl-ghost", prompt_token_ids=[7] * 20, sampling=spec, arrival_time=now
    )
    pipe = r.pipeline(transaction=False)
    pipe.hset(keys.worker("ghost"), mapping=beat.to_hash())  # type: ignore[arg-type]
    pipe.pexpire(keys.worker("ghost"), 300)
    pipe.sadd(keys.workers, "ghost")
    assignment = Assignment(worker_id="ghost", request=request, reserved_blocks=2)
    pipe.hset(keys.assigned("ghost"), request.request_id, encode(assignment))
    pipe.execute()
    return request.request_id


def wait_until(predicate: Callable[[], object], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
