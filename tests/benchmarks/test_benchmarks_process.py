"""Smoke runs of the benchmarks that start processes (the services, or a script) on the tiny model."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
import requests
import torch

from tests.support import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import serving


def test_offline_throughput_smoke(tiny_model_path: str, tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    script = REPO / "benchmarks" / "offline_throughput.py"
    subprocess.run(
        [sys.executable, str(script), "--model", tiny_model_path, "--num-prompts", "4", "--output", "4",
         "--static-batch-sizes", "2", "--json", str(out)],
        check=True, capture_output=True,
    )  # fmt: skip
    rows = {r["system"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"pagedserve", "static generate() batch=2"}
    assert all(r["output_tokens_per_s"] > 0 for r in rows.values())
    assert rows["static generate() batch=2"]["speedup_vs_best_static"] == 1.0


def smoke_run(name: str, model: str, tmp_path: Path) -> dict[str, Any]:
    """benchmarks/<name>.py --smoke on model, as a process; its JSON (its plot beside it, as <name>.png)."""
    out = tmp_path / f"{name}.json"
    subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / f"{name}.py"), "--smoke", "--model", model,
         "--json", str(out), "--plot", str(tmp_path / f"{name}.png")],
        check=True, capture_output=True,
    )  # fmt: skip
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def test_tool_calls_smoke(tiny_model_path: str, tmp_path: Path) -> None:
    results = smoke_run("tool_calls", tiny_model_path, tmp_path)
    free, call = results["median"]["free@1"], results["median"]["call@1"]
    assert free["output_tokens"] == 24 and 0 < call["output_tokens"] <= 24
    assert call["first_argument_s"] > call["ttft_s"] > 0  # the call's name comes before its arguments
    assert results["decode_ratio@1"] > 0 and (tmp_path / "tool_calls.png").stat().st_size > 0


def test_speculative_smoke(tiny_model_path: str, tmp_path: Path) -> None:
    results = smoke_run("speculative", tiny_model_path, tmp_path)
    assert results["identical_outputs"] is True
    for workload in ("grounded", "free"):
        off, on = results["median"][f"{workload}@1/off"], results["median"][f"{workload}@1/on"]
        assert off["output_tokens"] == on["output_tokens"] > 0 and on["output_tokens_per_s"] > 0
        assert off["tokens_per_step"] == 1.0 and off["acceptance"] == 0.0
    assert (tmp_path / "speculative.png").stat().st_size > 0


def test_serving_one_command_smoke(
    tiny_model_path: str, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """serving.main starts its own services with scripts/run.sh, measures both paths, and leaves nothing."""
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("NUM_KV_BLOCKS", "64")  # read by the worker and, from the same variable, the engine
    monkeypatch.setenv("GATEWAY_WORKERS", "1")
    # One thread in the services and in-process alike: two-thread steps crawl when the cores are busy.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out, png = tmp_path / "serving.json", tmp_path / "serving.png"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = serving.main(
            ["--model", tiny_model_path, "--num-prompts", "4", "--max-tokens", "4", "--input-len", "8", "16",
             "--request-rates", "inf", "--concurrency", "2", "--json", str(out), "--plot", str(png)]
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert json.loads(out.read_text()) == results
    assert png.stat().st_size > 0 and (tmp_path / "serving.log").stat().st_size > 0
    assert results["num_kv_blocks"] == {"worker": 64, "offline": 64}
    assert [row["scenario"] for row in results["scenarios"]] == ["rate inf", "concurrency 2"]
    for row in results["scenarios"]:
        for path in ("gateway", "offline"):
            assert row[path]["num_failed"] == 0 and row[path]["num_output_tokens"] == 4 * 4
            itl = row[path]["itl_ms"]
            assert 0 < itl["p50"] <= itl["p90"] <= itl["p99"]
    # The services are gone, and so is every key under their prefix.
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{results['url']}/health", timeout=2)
    assert not list(redis.Redis.from_url(redis_url).scan_iter(match=f"{results['redis_prefix']}:*"))


def test_batch_latency_smoke(
    tiny_model_path: str, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """batch_latency.main starts its own services (with a batch worker), runs both phases, leaves nothing."""
    import batch_latency

    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("NUM_KV_BLOCKS", "64")
    monkeypatch.setenv("GATEWAY_WORKERS", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # two-thread steps crawl when the cores are busy
    out, png = tmp_path / "batch_latency.json", tmp_path / "batch_latency.png"
    results = batch_latency.main(
        ["--model", tiny_model_path, "--duration-s", "3", "--clients", "2", "--batch-lines", "20",
         "--batch-max-tokens", "8", "--max-tokens", "8", "--batch-timeout-s", "60", "--json", str(out),
         "--plot", str(png)]
    )  # fmt: skip
    assert json.loads(out.read_text()) == results
    assert png.stat().st_size > 0 and (tmp_path / "batch_latency.log").stat().st_size > 0
    for phase in ("no_batch", "with_batch"):
        assert results[phase]["requests"] > 0 and results[phase]["failed"] == 0
        ttft = results[phase]["ttft_ms"]
        assert 0 < ttft["p50"] <= ttft["p99"]
    batch = results["batch"]
    assert batch["status"] == "completed" and batch["lines"] == 20 and batch["completed"] == 20
    assert batch["seconds"] > 0 and batch["lines_per_s"] > 0
    progress = batch["progress"]
    assert progress and progress[-1][1] == 20
    for before, after in itertools.pairwise(progress):
        assert before[0] < after[0] and before[1] <= after[1] and before[2] <= after[2]
    assert results["ttft_p50_ratio"] > 0 and isinstance(results["target_met"], bool)
    # The services are gone, and so is every key under their prefix.
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{results['url']}/health", timeout=2)
    assert not list(redis.Redis.from_url(redis_url).scan_iter(match=f"{results['redis_prefix']}:*"))


def test_control_plane_smoke(tmp_path: Path) -> None:
    """The control-plane benchmark end to end, small: real scheduler and gateway, simulated workers."""
    import control_plane

    out, png = tmp_path / "cp.json", tmp_path / "cp.png"
    results = control_plane.main(
        ["--workers", "4", "--requests", "200", "--rates", "100", "--paced-s", "1", "--streams", "16",
         "--stream-workers", "4", "--stream-tokens", "8", "--step-ms", "30", "--kill-after-s", "0.3",
         "--json", str(out), "--plot", str(png)]
    )  # fmt: skip
    assert json.loads(out.read_text())["streams"]["streams"] == 16 and png.stat().st_size > 0
    for row in results["admission"]:
        assert row["lost"] == row["duplicated"] == 0 and row["admissions_per_s"] > 0
        assert sum(row["queue_time_buckets"][:-1]) >= 0 and row["queue_time_buckets"][-1] == row["requests"]
    streams = results["streams"]
    assert streams["errors"] == streams["incomplete"] == 0  # one of two worker processes was killed
    assert streams["itl_gateway_ms"][50] > 0 and streams["itl_direct_ms"][50] > 0


def test_routing_smoke(
    tiny_model_path: str, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The routing benchmark end to end, small: both policies, two workers on the tiny model, 10 simulated."""
    import routing

    monkeypatch.setenv("REDIS_URL", redis_url)
    results = routing.main(
        ["--model", tiny_model_path, "--groups", "2", "--rounds", "2", "--concurrency", "2",
         "--max-tokens", "4", "--hot-requests", "4", "--hot-concurrency", "4", "--workers", "10",
         "--requests", "300", "--prefixes", "50", "--scale-runs", "2", "--probes", "3",
         "--out", str(tmp_path)]
    )  # fmt: skip
    assert json.loads((tmp_path / "routing.json").read_text()) == results
    assert (tmp_path / "routing.png").stat().st_size > 0
    prompt_len = routing.SCALE_PREFIX_LEN + routing.SCALE_SUFFIX_LEN
    for policy in routing.POLICIES:
        groups, hot, scale = (results[policy][name] for name in ("groups", "hot", "scale"))
        assert groups["requests"] == 4 and hot["requests"] == 4 and groups["failed"] == hot["failed"] == 0
        # The oracle's one cache holds every prefix: only a prefix's first request misses there.
        assert 0 <= groups["hit_fraction"] <= groups["oracle"]["tokens"] <= 1
        assert 0 < groups["ttft_ms"]["p50"] <= groups["ttft_ms"]["p99"]
        assert sorted(hot["worker_prompt_share"]) == ["w0", "w1"]
        assert sum(hot["worker_prompt_share"].values()) == pytest.approx(1)
        assert scale["workers"] == 10 and scale["requests"] == 300 and scale["admissions_per_s"] > 0
        assert scale["lost"] == scale["duplicated"] == 0 and len(scale["runs"]) == 2
        assert scale["scheduler_cpu_us_per_admission"] > 0 and scale["workers_cpu_us_per_admission"] > 0
        assert sum(scale["worker_prompt_tokens"]) == 300 * prompt_len
        assert 0 <= scale["routed_hit_fraction"] <= 1 and 0 < scale["oracle"]["blocks"] < 1
    assert results["load"]["scale"]["routed_hit_fraction"] == 0  # only routing by prefix matches prompts
    assert {v["target"].split(":")[0] for v in results["verdicts"]} == {"groups", "hot", "scale", "models"}
    models = results["models"]  # the probes of one model ran while the other's queue held a backlog
    assert models["probes"] == 3 and models["model_a_waiting_at_start"] > 0
    assert models["idle_ms_mean"] > 0 and models["flooded_ms_mean"] > 0
