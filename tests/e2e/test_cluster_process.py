"""End to end: gunicorn gateway, scheduler service and two CPU workers as real processes over a real Redis,
driven with the official openai client and raw HTTP. Greedy output must equal the offline engine's."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from gpu_worker import LLM, LLMEngine, SamplingParams
from gpu_worker.settings import WorkerSettings, engine_config
from shared.protocol import SampleEnd, decode
from tests.support import REPO
from tests.support.cluster import MODEL_NAME, Cluster, free_port, process_tree, running_cluster, service_env

NUM_KV_BLOCKS = 128
WORKERS = ("w1", "w2")


@pytest.fixture(scope="module")
def cluster(
    tiny_model_path: str,
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
    without_engine: dict[str, str],
) -> Iterator[Cluster]:
    prefix = f"pagedserve-e2e-{uuid.uuid4().hex[:10]}"
    env = service_env(redis_url, prefix, tiny_model_path, free_port(), NUM_KV_BLOCKS=str(NUM_KV_BLOCKS))
    with running_cluster(env, tmp_path_factory.mktemp("logs"), WORKERS, without_engine) as c:
        yield c


@pytest.fixture(autouse=True)
def drained(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "cluster" in request.fixturenames:
        c: Cluster = request.getfixturevalue("cluster")
        c.wait_idle()


PROMPTS = [
    "The quick brown fox",
    "Once upon a time in a land far away, there lived",
    "1, 2, 3, 4,",
    "Paged attention stores the KV cache in blocks",
]


def offline_text(offline: LLM, prompts: list[str], max_tokens: int) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return [o.outputs[0].text for o in offline.generate(prompts, params, use_tqdm=False)]


def mapped_files(pid: int) -> set[str]:
    return {line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "/" in line}


def test_gateway_and_scheduler_serve_without_torch(cluster: Cluster, without_engine: dict[str, str]) -> None:
    """Their processes run where torch and the engine cannot be imported, and none has torch loaded."""
    out = cluster.client().completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4, temperature=0)
    assert out.usage is not None and out.usage.completion_tokens == 4
    gateway = process_tree(cluster.processes["gateway"].pid)
    assert len(gateway) == 1 + int(cluster.env["GATEWAY_WORKERS"])  # the master and its workers
    for pid in [*gateway, cluster.processes["scheduler"].pid]:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert f"PYTHONPATH={without_engine['PYTHONPATH']}".encode() in environ
        assert not [f for f in mapped_files(pid) if "libtorch" in f or "/torch/" in f]
    worker = cluster.processes[WORKERS[0]].pid
    assert [f for f in mapped_files(worker) if "libtorch" in f]  # what the check would see


def test_completions_match_offline_engine(cluster: Cluster, offline: LLM) -> None:
    client = cluster.client()
    params = SamplingParams(temperature=0, max_tokens=20)
    expected = [o.outputs[0] for o in offline.generate(PROMPTS, params, use_tqdm=False)]
    for prompt, reference in zip(PROMPTS, expected):
        out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=20, temperature=0)
        assert out.choices[0].text == reference.text
        assert out.choices[0].finish_reason == reference.finish_reason
        assert out.usage is not None
        assert out.usage.prompt_tokens == len(
            offline.get_tokenizer().encode(prompt, add_special_tokens=False)
        )
        assert out.usage.completion_tokens == len(reference.token_ids)


def test_streaming_completion_equals_non_streaming(cluster: Cluster, offline: LLM) -> None:
    client = cluster.client()
    expected = offline_text(offline, PROMPTS[:2], 24)
    for prompt, text in zip(PROMPTS[:2], expected):
        stream = client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, usage, finish = [], None, None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                pieces.append(choice.text)
                finish = choice.finish_reason or finish
        assert "".join(pieces) == text
        assert usage is not None and usage.completion_tokens > 0
        assert finish in ("stop", "length")


def test_chat_streaming_and_not_match_offline(cluster: Cluster, offline: LLM) -> None:
    client = cluster.client()
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    expected = (
        offline.chat(messages, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
        .outputs[0]
        .text
    )
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0)
    assert out.choices[0].message.content == expected
    assert out.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == expected


def test_n2_max_tokens_usage_and_logprobs(cluster: Cluster) -> None:
    client = cluster.client()
    out = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[1],
        max_tokens=7,
        temperature=1.0,
        seed=5,
        n=2,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in out.choices) == [0, 1]
    for choice in out.choices:
        assert choice.finish_reason == "length"
        assert choice.logprobs is not None and len(choice.logprobs.token_logprobs) == 7
        assert all(len(top) <= 3 for top in choice.logprobs.top_logprobs)
    assert out.usage is not None and out.usage.completion_tokens == 14
    again = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[1],
        max_tokens=7,
        temperature=1.0,
        seed=5,
        n=2,
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in again.choices] == [c.text for c in out.choices]


def test_stop_string_cuts_the_text(cluster: Cluster, offline: LLM) -> None:
    client = cluster.client()
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = offline.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].text
    # A stop string from the middle of the text that is not blank; the text must end right before it.
    start = next(i for i in range(len(full) // 2, len(full) - 3) if full[i : i + 3].strip())
    stop = full[start : start + 3]
    out = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[0],
        max_tokens=30,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == full[: full.index(stop)]


def test_several_prompts_in_one_request_answer_as_each_alone(cluster: Cluster) -> None:
    client = cluster.client()
    prompts = PROMPTS[:3]
    alone = [
        client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=12, temperature=0) for p in prompts
    ]
    firsts = [a.choices[0] for a in alone]
    expected = [(i, firsts[i // 2].text, firsts[i // 2].finish_reason) for i in range(2 * len(prompts))]
    out = client.completions.create(model=MODEL_NAME, prompt=prompts, n=2, max_tokens=12, temperature=0)
    assert [(c.index, c.text, c.finish_reason) for c in out.choices] == expected
    assert out.usage is not None
    assert out.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone if a.usage)
    assert out.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone if a.usage)
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=prompts,
        n=2,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts = [""] * len(expected)
    finishes: list[str | None] = [None] * len(expected)
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert list(zip(range(len(expected)), texts, finishes)) == expected
    assert usage is not None and usage.model_dump() == out.usage.model_dump()


def test_hundred_concurrent_streams_complete_on_both_workers(cluster: Cluster) -> None:
    before = {wid: b.generation_tokens_total for wid, b in cluster.heartbeats().items()}
    results: list[str | BaseException] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        try:
            client = cluster.client()
            stream = client.completions.create(
                model=MODEL_NAME,
                prompt=f"request {i}: {PROMPTS[i % 4]}",
                max_tokens=12,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            finish = None
            for chunk in stream:
                for choice in chunk.choices:
                    finish = choice.finish_reason or finish
            with lock:
                results.append(finish or "missing")
        except BaseException as e:
            with lock:
                results.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(100)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert results.count("length") == 100, results[:5]
    beats = cluster.wait_idle()
    took = {wid: beats[wid].generation_tokens_total - before.get(wid, 0) for wid in WORKERS}
    assert all(n > 0 for n in took.values()), took
    assert sum(took.values()) == 100 * 12


def test_client_disconnect_aborts_the_request(cluster: Cluster) -> None:
    body = {
        "model": MODEL_NAME,
        "prompt": PROMPTS[2],
        "max_tokens": 1000,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with requests.post(f"{cluster.base_url}/v1/completions", json=body, stream=True, timeout=60) as response:
        assert response.status_code == 200
        seen = 0
        for line in response.iter_lines():
            if line.startswith(b"data: {"):
                seen += 1
                if seen == 3:
                    break
    # The connection is closed here; the gateway notices and the worker drops the request long before its
    # 1000 tokens, and its blocks are back in the pool.
    cluster.wait_idle(timeout=30)
    flags = list(cluster.redis.scan_iter(match=cluster.keys.abort_flag("*")))
    disconnected = [k for k in flags if cluster.redis.get(k) == "client_disconnect"]
    assert len(disconnected) == 1
    head, tail = cluster.keys.abort_flag("\0").split("\0")  # the key around its request id
    rid = disconnected[0][len(head) : -len(tail)]
    assert decode(SampleEnd, cluster.redis.hget(cluster.keys.finished(rid), "0")).finish_reason == "abort"
    assert 3 <= cluster.redis.llen(cluster.keys.tokens(rid, 0)) < 1000


def test_a_prompt_goes_to_the_worker_that_holds_its_prefix(cluster: Cluster) -> None:
    """Both workers equally free, so routing by load alone would take the first by id: by prefix, the
    request goes to the worker that computed its prefix, and finds it in that worker's cache."""
    client = cluster.client()
    keys = cluster.keys
    prefix = [300 + i for i in range(6 * 16)]  # six blocks of 16 tokens
    body = {"model": MODEL_NAME, "max_tokens": 1000, "stream": True, "ignore_eos": True}
    with requests.post(
        f"{cluster.base_url}/v1/completions", json={**body, "prompt": [9] * 800}, stream=True, timeout=60
    ) as busy:
        next(line for line in busy.iter_lines() if line.startswith(b"data: {"))
        (busy_worker,) = [wid for wid in WORKERS if cluster.redis.hlen(keys.assigned(wid))]
        # The other worker has the most free blocks: the prefix is computed there.
        first = client.completions.create(model=MODEL_NAME, prompt=prefix + [7], max_tokens=1)
    cluster.wait_idle(timeout=30)  # the busy stream is aborted: both workers are equally free again
    (holder,) = [wid for wid in WORKERS if cluster.redis.scard(keys.kv_blocks(wid)) and wid != busy_worker]
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert not first.usage.prompt_tokens_details.cached_tokens
    second = client.completions.create(model=MODEL_NAME, prompt=prefix + [8, 9], max_tokens=1)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens == len(prefix), (holder, busy_worker)
    stats = cluster.redis.hgetall(keys.scheduler_stats)
    assert json.loads(stats["routing_policy"]) == "prefix" and json.loads(stats["routed_matched_blocks"]) >= 6


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/completions", b"{not json", 400),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": -1}, 400),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": 10**9}, 400),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "logit_bias": {"not an id": 1}}, 400),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": 5}, 400),
        ("/v1/chat/completions", {"model": MODEL_NAME, "messages": []}, 400),
        ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user"}]}, 400),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi " * 5000}, 400),
        ("/v1/nothing", {}, 404),
    ],
)
def test_bad_input_gets_an_openai_error(cluster: Cluster, path: str, body: object, status: int) -> None:
    if isinstance(body, bytes):
        response = requests.post(
            cluster.base_url + path, data=body, headers={"Content-Type": "application/json"}
        )
    else:
        response = requests.post(cluster.base_url + path, json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["message"]


def test_metrics_and_models(cluster: Cluster) -> None:
    models = cluster.client().models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    text = requests.get(f"{cluster.base_url}/metrics", timeout=10).text
    for name in (
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
    ):
        assert name in text
    assert 'worker="w1"' in text and 'worker="w2"' in text


def test_serving_benchmark_smoke(cluster: Cluster, tiny_model_path: str, tmp_path: Path) -> None:
    """The serving benchmark's two paths, tiny, so it cannot rot: one Poisson rate, one concurrency."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import serving

    # The worker's settings as the cluster's environment gives them; the engine is built as main() builds it.
    settings = WorkerSettings(model=tiny_model_path, num_kv_blocks=NUM_KV_BLOCKS)
    config = engine_config(settings)
    assert config.num_kv_blocks == NUM_KV_BLOCKS
    assert engine_config(settings, num_kv_blocks=7).num_kv_blocks == 7
    engine = LLMEngine(settings.model, config, dtype=settings.dtype, device=settings.device)
    scenarios = serving.make_scenarios(4, [20.0], 2, seed=0)
    assert [s.name for s in scenarios] == ["rate 20/s", "concurrency 2"]
    arrivals = scenarios[0].arrivals
    assert arrivals[0] == 0 and arrivals == sorted(arrivals) and arrivals[-1] > 0
    assert arrivals == serving.make_scenarios(4, [20.0], 2, seed=0)[0].arrivals
    client = cluster.client()
    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the cluster's workers run (OMP_NUM_THREADS=1)
    try:
        for k, scenario in enumerate(scenarios):
            prompts = serving.make_prompts(4, engine.vocab_size, (8, 16), seed=k)
            gateway = serving.run_gateway(client, MODEL_NAME, prompts, scenario, 4)
            rows.append(serving.compare(scenario, gateway, serving.run_offline(engine, prompts, scenario, 4)))
    finally:
        torch.set_num_threads(threads)
    assert not engine.has_unfinished_requests() and not engine.requests
    for row in rows:
        for path in ("gateway", "offline"):
            r = row[path]
            assert r["num_failed"] == 0, r["errors"]
            assert r["num_output_tokens"] == 4 * 4 and r["tokens_per_chunk"] >= 1
            assert r["request_throughput"] > 0 and r["output_throughput"] > 0 and r["duration_s"] > 0
            for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
                m = r[metric]
                assert 0 < m["p50"] <= m["p90"] <= m["p99"], (path, metric, m)
            assert r["ttft_ms"]["p99"] <= r["e2e_ms"]["p99"]
        assert set(row["overhead"]) == {
            "itl_p99_added_ms", "output_throughput_ratio", "itl_target_met", "throughput_target_met"
        }  # fmt: skip
    png = tmp_path / "serving.png"
    serving.plot(rows, png)
    assert png.stat().st_size > 0
    serving.print_table(rows)
    assert json.loads(json.dumps(rows)) == rows


def test_a_dropped_stream_resumes_with_last_event_id(cluster: Cluster, offline: LLM) -> None:
    """The connection drops mid-stream; the client sends the request again with the id of the last event it
    got, and receives the rest of the same generation: together, the uninterrupted text."""
    prompt = PROMPTS[2]
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    expected = offline.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 120, "temperature": 0, "ignore_eos": True}
    url = f"{cluster.base_url}/v1/completions"
    pieces: list[str] = []
    last_id = None
    with requests.post(url, json={**body, "stream": True}, stream=True, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith(b"id: "):
                last_id = line[len(b"id: ") :].decode()
            elif line.startswith(b"data: {"):
                pieces.extend(c["text"] for c in json.loads(line[len(b"data: ") :])["choices"])
                if len(pieces) == 15:
                    break  # the connection drops
    assert last_id is not None and len(pieces) == 15
    time.sleep(0.3)
    with requests.post(
        url, json=body, headers={"Last-Event-ID": last_id}, stream=True, timeout=60
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith(b"data: {"):
                pieces.extend(c["text"] for c in json.loads(line[len(b"data: ") :])["choices"])
    assert "".join(pieces) == expected


def keys_without_ttl(cluster: Cluster) -> set[str]:
    return {
        k for k in cluster.redis.scan_iter(match=f"{cluster.keys.prefix}:*") if cluster.redis.ttl(k) == -1
    }


def test_redis_memory_stays_bounded(cluster: Cluster) -> None:
    """Hundreds of requests leave no key without a TTL behind them, and every stream drained."""
    client = cluster.client()

    def complete(i: int) -> None:
        out = client.completions.create(model=MODEL_NAME, prompt=f"Request {i}:", max_tokens=2, temperature=0)
        assert out.usage is not None and out.usage.completion_tokens == 2

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(complete, range(20)))
        cluster.wait_idle()
        before = keys_without_ttl(cluster)
        list(pool.map(complete, range(300)))
    cluster.wait_idle()
    after = keys_without_ttl(cluster)
    assert after == before
    keys = cluster.keys
    live = cluster.worker_ids()
    per_worker = [
        key
        for w in live
        for key in (keys.inbox(w), keys.assigned(w), keys.reserved(w), keys.kv_blocks(w), keys.kv_events(w))
    ]
    assert after <= {keys.requests, keys.workers, *per_worker}  # none of them per request
    assert cluster.redis.xlen(keys.requests) == 0
    assert all(cluster.redis.xlen(keys.inbox(w)) == 0 for w in live)
    assert all(int(cluster.redis.get(keys.reserved(w)) or 0) == 0 for w in live)  # every promise kept


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0.0}, {"temperature": 0.8, "top_p": 0.95, "seed": 1234}],
    ids=["greedy", "seeded"],
)
def test_killed_worker_resumes_on_the_other(cluster: Cluster, offline: LLM, sampling: dict[str, Any]) -> None:
    """kill -9 mid-generation: one stream, no gap, no duplicate, the same output as an uninterrupted run
    (a seeded sample's draws depend only on its seed and the token position)."""
    prompt = PROMPTS[3]
    params = SamplingParams(**sampling, max_tokens=300, ignore_eos=True)
    expected = offline.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 300, "stream": True, "ignore_eos": True}
    pieces: list[str] = []
    killed = None
    with requests.post(
        f"{cluster.base_url}/v1/completions", json={**body, **sampling}, stream=True, timeout=120
    ) as response:
        for line in response.iter_lines():
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[len(b"data: ") :])
            pieces.extend(c["text"] for c in chunk["choices"])
            if killed is None and len(pieces) == 20:
                holder = [w for w in cluster.worker_ids() if cluster.redis.hlen(cluster.keys.assigned(w))]
                assert len(holder) == 1
                killed = holder[0]
                cluster.processes[killed].send_signal(signal.SIGKILL)
    assert killed is not None
    assert "".join(pieces) == expected
    # Bring a worker back so the module's other tests (and teardown) see two.
    cluster.processes[killed].wait()
    cluster.start(f"{killed}-again", "gpu_worker", WORKER_ID=f"{killed}-again")
    cluster.wait_for_workers(2)
