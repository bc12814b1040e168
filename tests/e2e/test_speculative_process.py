"""Speculative decoding through the services on the default model: a worker with SPECULATIVE_CONFIG (n-gram
prompt lookup) behind the gunicorn gateway and the scheduler, as real processes over a real Redis, driven
with the official openai client. Answers that repeat their prompt are what the drafts are for: streamed or
not, their text is the text the engine gives without speculation, stop strings still cut it, and /metrics
counts the drafts accepted."""

from __future__ import annotations

import json
import time

import pytest
import requests

from gpu_worker import LLM, SamplingParams
from tests.support.api_cluster import cluster_fixture
from tests.support.cluster import MODEL_NAME, Cluster

NUM_KV_BLOCKS = 256
PASSAGE = (
    "The river rises in the mountains, gathers snowmelt through the spring, and winds past farms, mills and "
    "old stone bridges before it reaches the sea. Towns grew where it could be crossed, and trade followed."
)
REWRITE = f"Repeat this passage word for word:\n\n{PASSAGE}"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}

cluster = cluster_fixture(
    "smollm2_path",
    NUM_KV_BLOCKS=str(NUM_KV_BLOCKS),
    DTYPE="float32",
    SPECULATIVE_CONFIG=json.dumps(SPEC),
)


@pytest.fixture(scope="module")
def plain(smollm2_path: str) -> LLM:
    """The engine without speculation: what every answer must equal."""
    return LLM(smollm2_path, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, block_size=16)


def expected_text(plain: LLM, content: str, max_tokens: int) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return plain.chat([{"role": "user", "content": content}], params, use_tqdm=False)[0].outputs[0].text


def accepted_drafts(cluster: Cluster) -> float:
    text = requests.get(f"{cluster.base_url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:spec_decode_num_accepted_tokens_total{")
    )


def test_a_grounded_answer_streamed_and_whole_is_the_plain_engines(cluster: Cluster, plain: LLM) -> None:
    client = cluster.client()
    messages = [{"role": "user", "content": REWRITE}]
    before = accepted_drafts(cluster)
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=80,
        temperature=0.0,
        stream=True,  # type: ignore[arg-type]
    )
    deltas = [c.choices[0].delta.content or "" for c in stream if c.choices]
    whole = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=80,
        temperature=0.0,  # type: ignore[arg-type]
    )
    expected = expected_text(plain, REWRITE, 80)
    assert "".join(deltas) == whole.choices[0].message.content == expected
    assert "mountains" in expected  # the model does repeat it: drafts were there to accept
    deadline = time.monotonic() + 10  # the counters come with the next heartbeat
    while accepted_drafts(cluster) <= before:
        assert time.monotonic() < deadline, "no draft accepted"
        time.sleep(0.2)


def test_a_stop_string_inside_accepted_drafts_still_cuts_the_text(cluster: Cluster, plain: LLM) -> None:
    expected = expected_text(plain, REWRITE, 80)
    word = "bridges"
    assert word in expected
    out = cluster.client().completions.create(
        model=MODEL_NAME,
        prompt=plain.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": REWRITE}], add_generation_prompt=True, tokenize=False
        ),
        max_tokens=80,
        temperature=0.0,
        stop=[word],
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == expected[: expected.index(word)]


def test_seeded_sampling_is_reproducible_with_drafts(cluster: Cluster) -> None:
    client = cluster.client()
    texts = [
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": REWRITE}],  # type: ignore[arg-type]
            max_tokens=60,
            temperature=0.8,
            seed=123,
        )
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert texts[0] == texts[1] and texts[0]
