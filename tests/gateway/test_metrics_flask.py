"""The gateway's /metrics: every name vLLM's metrics test expects, per-worker figures from heartbeats, and
request histograms that move by each finished request's figures."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import create_app
from gateway.serving.batch_records import BatchStore
from gateway.settings import GatewaySettings
from shared.batches import BatchSpec
from shared.keys import Keys
from shared.protocol import (
    ITERATION_TOKENS_BUCKETS,
    GenerateRequest,
    Heartbeat,
    RequestTimings,
    SchedulerStats,
    TokenEvent,
)
from shared.records import push_event
from shared.streams import read_request
from tests.support.metrics import VLLM_NAMES

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture
def client(redis_url: str, redis_prefix: str, tiny_model_path: str):  # type: ignore[no-untyped-def]
    settings = GatewaySettings.model_validate(
        {
            "redis_url": redis_url,
            "redis_prefix": redis_prefix,
            "model": tiny_model_path,
            "served_model_name": MODEL,
            "sse_heartbeat_s": 0.2,
        }
    )
    return create_app(settings).test_client()


def beat(wid: str, **fields: object) -> Heartbeat:
    now = time.time()
    values: dict[str, object] = {
        "worker_id": wid,
        "model": MODEL,
        "free_blocks": 30,
        "total_blocks": 40,
        "block_size": 16,
        "num_running": 0,
        "num_waiting": 0,
        "last_step_time": now,
        "started_at": now,
        "max_model_len": 2048,
        **fields,
    }
    return Heartbeat.model_validate(values)


def register(r: redis.Redis, keys: Keys, heartbeat: Heartbeat) -> None:
    r.hset(keys.worker(heartbeat.worker_id), mapping=heartbeat.to_hash())  # type: ignore[arg-type]
    r.expire(keys.worker(heartbeat.worker_id), 60)
    r.sadd(keys.workers, heartbeat.worker_id)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape by (name, sorted labels)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(text: str, name: str, **labels: str) -> float:
    return samples(text).get((name, tuple(sorted({"model_name": MODEL, **labels}.items()))), 0.0)


def test_every_name_vllm_expects_is_exposed(client, r, keys) -> None:
    register(r, keys, beat("w0"))
    stats = SchedulerStats(num_waiting=0, num_assigned=0, updated_at=time.time())
    r.hset(keys.scheduler_stats, mapping=stats.to_hash())  # type: ignore[arg-type]
    text = client.get("/metrics").get_data(as_text=True)
    missing = [name for name in VLLM_NAMES if name not in text]
    assert not missing


def test_worker_figures_are_labelled_per_worker(client, r, keys) -> None:
    buckets = [3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4]  # 3 decode steps of 1 token, one prefill of 40
    assert len(buckets) == len(ITERATION_TOKENS_BUCKETS) + 1
    register(
        r,
        keys,
        beat(
            "w0",
            prefix_cache_queries_total=96,
            prefix_cache_hits_total=32,
            num_preemptions=2,
            iteration_tokens_buckets=buckets,
            iteration_tokens_sum=43,
            dtype="float32",
            device="cpu",
        ),
    )
    register(r, keys, beat("w1", free_blocks=10, prefix_cache_queries_total=7))
    text = client.get("/metrics").get_data(as_text=True)
    assert value(text, "vllm:prefix_cache_queries_total", worker="w0") == 96
    assert value(text, "vllm:prefix_cache_hits_total", worker="w0") == 32
    assert value(text, "vllm:gpu_prefix_cache_hits_total", worker="w0") == 32
    assert value(text, "vllm:prefix_cache_queries_total", worker="w1") == 7
    assert value(text, "vllm:num_preemptions_total", worker="w0") == 2
    assert value(text, "vllm:kv_cache_usage_perc", worker="w1") == 0.75
    assert value(text, "vllm:iteration_tokens_total_count", worker="w0") == 4
    assert value(text, "vllm:iteration_tokens_total_sum", worker="w0") == 43
    assert value(text, "vllm:iteration_tokens_total_bucket", worker="w0", le="1.0") == 3
    info = [
        labels
        for (name, labels), v in samples(text).items()
        if name == "vllm:cache_config_info" and dict(labels)["worker"] == "w0" and v == 1.0
    ]
    assert len(info) == 1
    expected = {"block_size": "16", "num_gpu_blocks": "40", "cache_dtype": "float32", "device": "cpu"}
    assert expected.items() <= dict(info[0]).items()


def test_speculative_decoding_counters_are_vllms(client, r, keys) -> None:
    register(
        r,
        keys,
        beat(
            "w0",
            spec_decode_num_drafts=10,
            spec_decode_num_draft_tokens=40,
            spec_decode_num_accepted_tokens=25,
            spec_decode_num_accepted_tokens_per_pos=[9, 7, 5, 4],
        ),
    )
    register(r, keys, beat("w1"))  # speculation off: no figures of its own
    text = client.get("/metrics").get_data(as_text=True)
    assert value(text, "vllm:spec_decode_num_drafts_total", worker="w0") == 10
    assert value(text, "vllm:spec_decode_num_draft_tokens_total", worker="w0") == 40
    assert value(text, "vllm:spec_decode_num_accepted_tokens_total", worker="w0") == 25
    per_position = [
        value(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", worker="w0", position=str(i))
        for i in range(4)
    ]
    assert per_position == [9, 7, 5, 4]
    assert ("vllm:spec_decode_num_drafts_total", (("model_name", MODEL), ("worker", "w1"))) not in samples(
        text
    )


def answer(r: redis.Redis, keys: Keys, request: GenerateRequest, token_ids: list[int]) -> None:
    """Play the worker: every sample gets token_ids in one event that ends it, with its timings."""
    for index in request.sample_indices():
        event = TokenEvent(
            request_id=request.request_id,
            index=index,
            start=0,
            token_ids=token_ids,
            finish_reason="length",
            num_prompt_tokens=len(request.prompt_token_ids),
            worker_id="w0",
            timings=RequestTimings(queued_s=0.01, prefill_s=0.25 + index, decode_s=1.5 + index),
        )
        pipe = r.pipeline(transaction=False)
        push_event(pipe, keys, event, ttl_s=60)
        pipe.execute()


def test_a_finished_request_moves_the_request_histograms_by_its_figures(client, r, keys) -> None:
    register(r, keys, beat("w0"))
    names = [
        "vllm:request_prompt_tokens_sum",
        "vllm:request_prompt_tokens_count",
        "vllm:request_generation_tokens_sum",
        "vllm:request_params_n_sum",
        "vllm:request_params_max_tokens_sum",
        "vllm:request_prefill_time_seconds_sum",
        "vllm:request_decode_time_seconds_sum",
        "vllm:request_inference_time_seconds_sum",
        "vllm:request_inference_time_seconds_count",
        "vllm:time_per_output_token_seconds_count",
    ]
    before = client.get("/metrics").get_data(as_text=True)
    prompt = [5, 6, 7, 8, 9]

    def worker() -> None:
        reply = r.xread({keys.requests: "0"}, block=5000)
        request = read_request(reply[0][1][0][1])  # type: ignore[index]
        answer(r, keys, request, [11, 12, 13])

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    response = client.post(
        "/v1/completions", json={"prompt": prompt, "max_tokens": 3, "n": 2, "temperature": 0.5}
    )
    thread.join(timeout=10)
    assert response.status_code == 200, response.get_json()
    after = client.get("/metrics").get_data(as_text=True)
    delta = {name: value(after, name) - value(before, name) for name in names}
    assert delta == {
        "vllm:request_prompt_tokens_sum": 5,
        "vllm:request_prompt_tokens_count": 1,
        "vllm:request_generation_tokens_sum": 6,
        "vllm:request_params_n_sum": 2,
        "vllm:request_params_max_tokens_sum": 3,
        # The samples share one prefill (the shortest) and the request decodes until its last sample ends.
        "vllm:request_prefill_time_seconds_sum": 0.25,
        "vllm:request_decode_time_seconds_sum": 2.5,
        "vllm:request_inference_time_seconds_sum": 2.75,
        "vllm:request_inference_time_seconds_count": 1,
        # One event per sample: no gap between two tokens was seen.
        "vllm:time_per_output_token_seconds_count": 0,
    }


def test_batch_progress_counts_batches_by_status_and_the_lines_of_those_running(client, r, keys) -> None:
    store = BatchStore(r, keys, retention_s=60)
    made = {
        "running": ("in_progress", 10, 4, 1),
        "closing": ("finalizing", 5, 5, 0),
        "done": ("completed", 7, 7, 0),
    }
    for bid, (status, total, completed, failed) in made.items():
        spec = BatchSpec(
            id=bid,
            endpoint="/v1/completions",
            input_file_id="f",
            completion_window="24h",
            created_at=0,
            expires_at=0,
        )
        store.create(spec)
        store.set_total(bid, total)
        for n in range(completed + failed):
            store.record(bid, f"line-{n}", {"n": n}, failed=n >= completed)
        assert store.move(bid, {"validating"}, status)
    store.create(
        BatchSpec(
            id="new",
            endpoint="/v1/completions",
            input_file_id="f",
            completion_window="24h",
            created_at=0,
            expires_at=0,
        )
    )
    got = samples(client.get("/metrics").get_data(as_text=True))
    statuses = {labels[0][1]: v for (name, labels), v in got.items() if name == "pagedserve:batches"}
    assert statuses == {
        "validating": 1,
        "in_progress": 1,
        "finalizing": 1,
        "completed": 1,
        "failed": 0,
        "expired": 0,
        "cancelling": 0,
        "cancelled": 0,
    }
    lines = {labels[0][1]: v for (name, labels), v in got.items() if name == "pagedserve:batch_requests"}
    assert lines == {"total": 15, "completed": 9, "failed": 1}  # the ended batch's lines are not counted
    r.delete(
        keys.batches, *(keys.batch(bid) for bid in [*made, "new"]), *(keys.batch_done(bid) for bid in made)
    )


def test_the_grafana_dashboard_queries_only_what_the_gateway_exposes(client, r, keys) -> None:
    """deploy/grafana's dashboard: every metric its queries name and every label they group or label by."""
    register(r, keys, beat("w0"))
    stats = SchedulerStats(num_waiting=0, num_assigned=0, updated_at=time.time())
    r.hset(keys.scheduler_stats, mapping=stats.to_hash())  # type: ignore[arg-type]
    exposed: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(client.get("/metrics").get_data(as_text=True)):
        for sample in family.samples:
            exposed.setdefault(sample.name, set()).update(sample.labels)
    dashboard = json.loads((Path(__file__).parents[2] / "deploy" / "grafana" / "pagedserve.json").read_text())
    targets = [t for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(targets) >= 10
    for target in targets:
        names = set(re.findall(r"\b((?:vllm|pagedserve):[a-z_]+)", target["expr"]))
        assert names and names <= set(exposed), target["expr"]
        labels = (
            set(re.findall(r"by \(([^)]*)\)", target["expr"])[0].replace(" ", "").split(",")) - {"le"}
            if " by (" in target["expr"]
            else set()
        )
        labels |= set(re.findall(r"\{\{(\w+)\}\}", target["legendFormat"]))
        for name in names:
            assert labels <= exposed[name], (target["expr"], labels - exposed[name])
