"""Two models behind one gateway, as real processes: each request reaches only workers of its model, a model
with no live worker is 503 no_worker, an unknown one 404 model_not_found."""

from __future__ import annotations

import uuid

import openai
import pytest
import requests

from tests.support.cluster import MODEL_NAME, free_port, running_cluster, service_env

SECOND = "small"


def test_two_models_behind_one_gateway_each_on_its_own_workers(
    tiny_model_path: str,
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
    without_engine: dict[str, str],
) -> None:
    env = service_env(
        redis_url,
        f"pagedserve-models-{uuid.uuid4().hex[:8]}",
        tiny_model_path,
        free_port(),
        EXTRA_MODELS=f"{SECOND}={tiny_model_path}",
        NUM_KV_BLOCKS="64",
        GATEWAY_WORKERS="1",
    )
    with running_cluster(env, tmp_path_factory.mktemp("models-logs"), ("w1",), without_engine) as cluster:
        client = cluster.client()
        with pytest.raises(openai.APIStatusError) as no_worker:
            client.completions.create(model=SECOND, prompt="hello", max_tokens=2)
        assert no_worker.value.status_code == 503 and no_worker.value.code == "no_worker"
        assert [m.id for m in client.models.list()] == [MODEL_NAME]

        cluster.start("w2", "gpu_worker", WORKER_ID="w2", SERVED_MODEL_NAME=SECOND)
        cluster.wait_for_workers(2)
        assert [m.id for m in client.models.list()] == [MODEL_NAME, SECOND]
        before = {wid: beat.prompt_tokens_total for wid, beat in cluster.heartbeats().items()}
        prompt_tokens = {MODEL_NAME: 0, SECOND: 0}
        for model in [SECOND, MODEL_NAME, SECOND, SECOND, MODEL_NAME]:
            out = client.completions.create(model=model, prompt="hello there", max_tokens=2, temperature=0)
            assert out.model == model and out.usage is not None
            prompt_tokens[model] += out.usage.prompt_tokens
        beats = cluster.wait_idle()
        took = {wid: beats[wid].prompt_tokens_total - before[wid] for wid in ("w1", "w2")}
        assert took == {"w1": prompt_tokens[MODEL_NAME], "w2": prompt_tokens[SECOND]}

        metrics = requests.get(f"{cluster.base_url}/metrics", timeout=10).text
        assert f'vllm:num_requests_running{{model_name="{SECOND}",worker="w2"}}' in metrics
        assert f'pagedserve:num_live_workers{{model_name="{SECOND}"}} 1.0' in metrics
        with pytest.raises(openai.NotFoundError) as unknown:
            client.completions.create(model="nope", prompt="hello", max_tokens=2)
        assert unknown.value.code == "model_not_found"
