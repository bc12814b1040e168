"""Structured outputs and beam search end to end on the default model: gunicorn gateway, scheduler and two
CPU workers as real processes over a real Redis, driven with the official openai client; a worker killed
mid-request hands it to the other, and the output still follows its grammar (or equals an uninterrupted
beam search)."""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest
import requests

from gpu_worker import LLM, SamplingParams
from tests.support.api_cluster import cluster_fixture
from tests.support.cluster import MODEL_NAME, Cluster

NUM_KV_BLOCKS = 512
WORKERS = ("w1", "w2")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo", "Lima"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PEOPLE = [
    "a retired teacher from Paris",
    "a young footballer in London",
    "a chef who lives in Tokyo",
    "a painter from Lima",
    "a student in Paris who loves chess",
]
# Long enough to kill its worker halfway: twenty-four numbers.
NUMBERS = {
    "type": "object",
    "properties": {
        "numbers": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 99},
            "minItems": 24,
            "maxItems": 24,
        }
    },
    "required": ["numbers"],
    "additionalProperties": False,
}


cluster = cluster_fixture("smollm2_path", WORKERS, NUM_KV_BLOCKS=str(NUM_KV_BLOCKS), DTYPE="float32")


@pytest.fixture(scope="module")
def offline(smollm2_path: str) -> LLM:
    return LLM(smollm2_path, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, block_size=16)


def person_request(client: openai.OpenAI, i: int) -> str:
    who = PEOPLE[i % len(PEOPLE)]
    messages = [{"role": "user", "content": f"Describe {who} as JSON with a name, an age and a city."}]
    # vLLM's own field half of the time, OpenAI's response_format the other half.
    if i % 2:
        asked: dict[str, Any] = {"extra_body": {"structured_outputs": {"json": PERSON}}}
    else:
        schema = {"name": "person", "schema": PERSON}
        asked = {"response_format": {"type": "json_schema", "json_schema": schema}}
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,  # type: ignore[arg-type]
        max_completion_tokens=80,
        temperature=0.0 if i < 10 else 0.7,
        seed=i,
        **asked,
    )
    assert out.choices[0].finish_reason == "stop", out
    return out.choices[0].message.content or ""


def test_twenty_json_schema_requests_all_parse_and_validate(cluster: Cluster) -> None:
    client = cluster.client()
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda i: person_request(client, i), range(20)))
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len({t for t in texts}) > 5  # different people, not one answer
    cluster.wait_idle()


def test_json_object_is_a_json_object(cluster: Cluster) -> None:
    out = cluster.client().chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Give me a JSON object with the keys 'a' and 'b'."}],
        max_completion_tokens=60,
        temperature=0.0,
        response_format={"type": "json_object"},
    )
    assert out.choices[0].finish_reason == "stop", out
    assert isinstance(json.loads(out.choices[0].message.content or ""), dict)


def test_choice_and_regex_through_completions(cluster: Cluster) -> None:
    client = cluster.client()
    choice = client.completions.create(
        model=MODEL_NAME,
        prompt="Is the sky blue? Answer:",
        max_tokens=5,
        temperature=0.0,
        extra_body={"structured_outputs": {"choice": ["yes", "no", "sometimes"]}},
    )
    assert choice.choices[0].text in {"yes", "no", "sometimes"}
    regex = client.completions.create(
        model=MODEL_NAME,
        prompt="The year the first man walked on the moon:",
        max_tokens=8,
        temperature=0.0,
        extra_body={"guided_regex": " ?[12][0-9]{3}"},
    )
    assert regex.choices[0].text.strip().isdigit() and len(regex.choices[0].text.strip()) == 4


def stream_and_kill(cluster: Cluster, body: dict[str, Any], kill_after: int) -> tuple[str, str | None]:
    """Stream a chat completion, killing the worker that runs it once kill_after chunks arrived: the whole
    text and the worker killed (None when it finished first)."""
    pieces: list[str] = []
    killed = None
    with requests.post(
        f"{cluster.base_url}/v1/chat/completions", json={**body, "stream": True}, stream=True, timeout=300
    ) as response:
        assert response.status_code == 200, response.text
        for line in response.iter_lines():
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[len(b"data: ") :])
            pieces.extend(c["delta"].get("content") or "" for c in chunk["choices"])
            if killed is None and len(pieces) == kill_after:
                holder = [w for w in cluster.worker_ids() if cluster.redis.hlen(cluster.keys.assigned(w))]
                assert len(holder) == 1
                killed = holder[0]
                cluster.processes[killed].send_signal(signal.SIGKILL)
    return "".join(pieces), killed


def restart(cluster: Cluster, killed: str) -> None:
    """Bring a worker back so the module's other tests (and teardown) see two."""
    cluster.processes[killed].wait()
    cluster.start(f"{killed}-again", "gpu_worker", WORKER_ID=f"{killed}-again")
    cluster.wait_for_workers(2)


def test_a_constrained_request_resumed_after_kill_9_still_validates(cluster: Cluster) -> None:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "List twenty-four small numbers as JSON."}],
        "max_completion_tokens": 120,
        "temperature": 0.0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "numbers", "schema": NUMBERS}},
    }
    uninterrupted = cluster.client().chat.completions.create(**body).choices[0].message.content or ""
    text, killed = stream_and_kill(cluster, body, kill_after=15)
    assert killed is not None
    jsonschema.validate(json.loads(text), NUMBERS)
    assert text == uninterrupted  # greedy: the matcher rebuilt from the streamed tokens changes nothing
    restart(cluster, killed)


def test_beam_search_through_the_services_equals_the_offline_engine(cluster: Cluster, offline: LLM) -> None:
    prompt = "The three most important inventions in history are"
    expected = offline.generate(
        [prompt], SamplingParams(n=2, best_of=4, use_beam_search=True, max_tokens=24), use_tqdm=False
    )[0]
    client = cluster.client()
    for stream in (False, True):
        extra = {"use_beam_search": True, "best_of": 4}
        if not stream:
            out = client.completions.create(
                model=MODEL_NAME, prompt=prompt, n=2, max_tokens=24, extra_body=extra
            )
            texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
            assert out.usage is not None
            assert out.usage.completion_tokens == sum(len(o.token_ids) for o in expected.outputs)
        else:
            chunks = client.completions.create(
                model=MODEL_NAME, prompt=prompt, n=2, max_tokens=24, stream=True, extra_body=extra
            )
            by_index = ["", ""]
            for chunk in chunks:
                for c in chunk.choices:
                    by_index[c.index] += c.text
            texts = by_index
        assert texts == [o.text for o in expected.outputs]
    assert texts[0] != texts[1]  # two beams, not one answer twice


def test_a_beam_search_whose_worker_dies_starts_again_on_the_other(cluster: Cluster) -> None:
    """Nothing of a beam search is streamed before it ends: after kill -9 it runs again, whole, elsewhere."""
    body = {
        "model": MODEL_NAME,
        "prompt": "Write a long story about a dragon:",
        "use_beam_search": True,
        "n": 2,
        "best_of": 4,
        "max_tokens": 80,
    }
    first = requests.post(f"{cluster.base_url}/v1/completions", json=body, timeout=300).json()
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(requests.post, f"{cluster.base_url}/v1/completions", json=body, timeout=300)
        deadline = time.monotonic() + 30
        holder: list[str] = []
        while not holder and time.monotonic() < deadline:
            holder = [w for w in cluster.worker_ids() if cluster.redis.hlen(cluster.keys.assigned(w))]
            time.sleep(0.05)
        assert len(holder) == 1
        time.sleep(0.5)  # a few beam steps in
        cluster.processes[holder[0]].send_signal(signal.SIGKILL)
        second = future.result().json()
    assert [c["text"] for c in second["choices"]] == [c["text"] for c in first["choices"]]
    restart(cluster, holder[0])
