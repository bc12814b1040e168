"""Smoke runs of the benchmarks in this process, on the tiny model: they run, their JSON makes sense."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.support import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import cpu_kernel_bench
import huge_pages
import memory
import offline
import profile_steps
import roofline
import routing_costs
import vs_vllm
from workloads import ModelShape, make_workload


def test_workloads_have_the_asked_shapes() -> None:
    w2 = make_workload("W2", 1000, seed=0)
    assert len(w2.prompts) == 64 and len(w2.output_lens) == 64
    assert all(16 <= len(p) <= 256 for p in w2.prompts) and all(16 <= o <= 256 for o in w2.output_lens)
    assert all(17 <= t < 1000 for p in w2.prompts for t in p)
    again = make_workload("W2", 1000, seed=0, variant=1)
    assert list(map(len, again.prompts)) == list(map(len, w2.prompts)) and again.prompts != w2.prompts
    w3 = make_workload("W3", 1000)
    assert all(p[:256] == w3.prompts[0][:256] and len(p) == 288 for p in w3.prompts)
    assert w3.prompts[0][256:] != w3.prompts[1][256:]


def test_flops_count_the_causal_context() -> None:
    shape = ModelShape(
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, hidden_size=32, vocab_size=100,
        num_params_without_embeddings=1000,
    )  # fmt: skip
    wl = make_workload("W1", 100, scale=1 / 32)  # 2 requests, 1 prompt token, 2 output tokens
    assert wl.output_lens == [2, 2] and list(map(len, wl.prompts)) == [1, 1]
    per_request = 2 * 1000 * 3 + 2 * 100 * 32 * 2 + 4 * 2 * 4 * 8 * (3 * 4 / 2)
    assert shape.flops(wl) == pytest.approx(2 * per_request)
    assert shape.kv_bytes_per_token(torch.float32) == 2 * 2 * 2 * 8 * 4


def test_vs_vllm_sets_pagedserve_beside_vllm_per_workload(tmp_path: Path) -> None:
    def rows(*pairs: tuple[str, float]) -> dict[str, object]:
        return {"systems": [{"system": name, "output_tokens_per_s": rate} for name, rate in pairs]}

    ours = {
        "workloads": {
            "W2": rows(("pagedserve", 200.0)),
            "W3": rows(("pagedserve, prefix caching", 300.0), ("pagedserve, no prefix caching", 100.0)),
        }
    }
    theirs = {"vllm": "0.32.0", "workloads": {k: {"output_tokens_per_s": 100.0} for k in ("W1", "W2", "W3")}}
    for name, data in (("ours.json", ours), ("theirs.json", theirs)):
        (tmp_path / name).write_text(json.dumps(data))
    out, png = tmp_path / "vs.json", tmp_path / "vs.png"
    got = vs_vllm.main(
        ["--pagedserve", str(tmp_path / "ours.json"), "--vllm", str(tmp_path / "theirs.json"),
         "--json", str(out), "--plot", str(png)]
    )  # fmt: skip
    assert [(r["workload"], r["ratio"]) for r in got] == [("W2", 2.0), ("W3", 3.0)]  # W1: pagedserve not run
    assert json.loads(out.read_text())["rows"] == got and png.stat().st_size > 0
    names = (
        "pagedserve, no prefix caching",
        "static generate() batch=16",
        "transformers continuous batching",
    )
    assert {offline._kind(n) for n in names} == set(offline.SYSTEM_KINDS)  # what --systems picks from


def test_roofline_smoke(tiny_model_path: str, tmp_path: Path) -> None:
    out, png = tmp_path / "roofline.json", tmp_path / "roofline.png"
    results = roofline.main(
        ["--model", tiny_model_path, "--batches", "1", "4", "--steps", "3", "--prefill-tokens", "64",
         "--model-impl", "pagedserve", "--json", str(out), "--plot", str(png)]
    )  # fmt: skip
    assert json.loads(out.read_text()) == results and png.stat().st_size > 0
    machine = results["machine"]
    assert all(machine[k] > 0 for k in ("read_bytes_per_s", "copy_bytes_per_s", "fp32_matmul_flops_per_s"))
    assert [r["step"] for r in results["rows"]] == ["decode 1", "decode 4", "prefill 64"]
    assert {r["model_impl"] for r in results["rows"]} == {"pagedserve"}
    one, four, prefill = results["rows"]
    for r in results["rows"]:  # every weight once, whatever the batch, at the bandwidth around the step
        assert r["memory_bound_s"] == pytest.approx(results["weight_bytes"] / r["read_bytes_per_s"])
    assert four["fp32_compute_bound_s"] > one["fp32_compute_bound_s"] > 0
    assert prefill["flops"] > four["flops"]
    for r in results["rows"]:
        assert r["step_s"] > 0 and r["over_bound"] > 0
        assert r["where"]["matmul_s"] > 0 and r["where"]["profiled_wall_s"] >= r["where"]["matmul_s"]


def test_huge_pages_smoke(tiny_model_path: str, tmp_path: Path) -> None:
    out, png = tmp_path / "huge_pages.json", tmp_path / "huge_pages.png"
    results = huge_pages.main(
        ["--model", tiny_model_path, "--batches", "1", "3", "--steps", "2", "--dtype", "float32",
         "--kv-mib", "4", "--json", str(out), "--plot", str(png)]
    )  # fmt: skip
    assert json.loads(out.read_text()) == results and png.stat().st_size > 0
    assert [r["batch"] for r in results["rows"]] == [1, 3]
    for r in results["rows"]:
        small, huge = (r[label]["median_s"] for label in huge_pages.SETTINGS)
        assert 0 < r["4 KiB pages"]["min_s"] <= small and 0 < r["huge pages"]["min_s"] <= huge
        assert r["huge_over_small"] == pytest.approx(huge / small)
    assert "PAGEDSERVE_HUGE_PAGES" not in os.environ  # each engine's setting is put back


def test_offline_smoke(tiny_model_path: str, tmp_path: Path) -> None:
    out, png = tmp_path / "offline.json", tmp_path / "offline.png"
    offline.main(
        ["--model", tiny_model_path, "--scale", "0.25", "--repeats", "1", "--static-batch-sizes", "4", "16",
         "--kv-budget-mib", "0.25", "--json", str(out), "--plot", str(png)]
    )  # fmt: skip
    results = json.loads(out.read_text())
    assert png.stat().st_size > 0
    assert results["machine"]["fp32_matmul_flops_per_s"] > 0
    assert set(results["workloads"]) == {"W1", "W2", "W3", "W2eq"}
    for key, wl in results["workloads"].items():
        rows = {r["system"]: r for r in wl["systems"]}
        assert any(name.startswith("pagedserve") for name in rows), key
        assert any(name.startswith("static generate()") for name in rows), key
        assert "transformers continuous batching" in rows, key
        for row in rows.values():
            if "error" in row:
                assert row["system"].startswith("transformers"), row  # only that one may be n/a
                continue
            assert row["output_tokens_per_s"] > 0
            assert row["processed_tokens_per_s"] > row["output_tokens_per_s"]
            assert row["seconds_min"] <= row["seconds"] <= row["seconds_max"]
            assert row["mfu"] > 0 and row["vs_best_static"] > 0
    ttft = results["workloads"]["W3"]["ttft"]
    assert set(ttft) == {"prefix caching", "no prefix caching"}
    assert all(t["mean_s"] > 0 and t["p50_s"] > 0 for t in ttft.values())
    # 0.25 MiB holds 256 tokens of the tiny model: two reservations of the longest prompt + output (64 + 64).
    static_eq = [r for r in results["workloads"]["W2eq"]["systems"] if r["system"].startswith("static")]
    assert [r["batch_size"] for r in static_eq] == [2]


def test_memory_smoke(tiny_model_path: str, tmp_path: Path) -> None:
    out, png = tmp_path / "memory.json", tmp_path / "memory.png"
    results = memory.main(
        ["--model", tiny_model_path, "--scale", "0.25", "--kv-budget-mib", "0.25", "--json", str(out),
         "--plot", str(png)]
    )  # fmt: skip
    assert json.loads(out.read_text())["summary"] == results["summary"]
    assert png.stat().st_size > 0
    summary = results["summary"]
    for s in results["samples"]:
        if s["num_running"]:
            assert 0 < s["paged_utilization"] <= 1 and 0 < s["contiguous_utilization"] <= 1
    assert summary["paged_utilization_at_peak"] >= summary["contiguous_utilization_at_peak"]
    assert summary["peak_concurrent_paged"] >= summary["peak_concurrent_contiguous"]
    assert summary["peak_allocated_slots"] <= results["capacity_slots"]


def test_profile_steps_smoke(tiny_model_path: str, tmp_path: Path) -> None:
    out, png = tmp_path / "profile.json", tmp_path / "profile.png"
    results = profile_steps.main(
        ["--model", tiny_model_path, "--scale", "0.125", "--static-batch-size", "4", "--json", str(out),
         "--plot", str(png)]
    )  # fmt: skip
    assert json.loads(out.read_text())["fit"] == results["fit"]
    assert png.stat().st_size > 0
    # W2 at 1/8: 8 requests of 2-32 prompt and output tokens; every token is run once.
    wl = make_workload("W2", 1000, scale=0.125)
    assert results["paged"]["tokens"] == sum(map(len, wl.prompts)) + sum(wl.output_lens) - len(wl.prompts)
    assert sum(n for n, _ in results["step_log"]) == results["paged"]["tokens"]
    assert results["paged"]["steps"] >= max(wl.output_lens)
    # Static batches of 4 pad every row to its batch's longest prompt and output: never fewer tokens.
    assert results["static_over_paged_ceiling"] > 1
    assert results["top_ops"] and all(0 < op["share"] <= 1 for op in results["top_ops"])


def test_cpu_kernel_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "cpu.json"
    results = cpu_kernel_bench.main(
        ["--batches", "1", "3", "--contexts", "20", "--layers", "2", "--head-rows", "1", "4",
         "--vocab", "512", "--repeats", "1", "--json", str(out)]
    )  # fmt: skip
    assert json.loads(out.read_text()) == results
    assert [(r["batch"], r["context"]) for r in results["attention"]] == [(1, 20), (3, 20)]
    assert all(r["kernel_ms"] > 0 and r["twin_ms"] > 0 for r in results["attention"])
    assert [r["rows"] for r in results["lm_head"]] == [1, 4]


def test_cpu_kernel_bench_takes_blocks_from_the_engines_pool_in_bf16(tmp_path: Path) -> None:
    """--pool-gib: the batch's blocks drawn from a KVCache of that size (the kernel checked against its twin
    inside, in bf16 here); a pool too small for the batch is refused."""
    out = tmp_path / "cpu.json"
    results = cpu_kernel_bench.main(
        ["--batches", "3", "--contexts", "40", "--layers", "2", "--head-rows", "1", "--vocab", "512",
         "--repeats", "1", "--dtype", "bfloat16", "--pool-gib", "0.01", "--json", str(out)]
    )  # fmt: skip
    assert results["args"]["pool_gib"] == 0.01 and results["args"]["dtype"] == "bfloat16"
    assert results["attention"][0]["kernel_ms"] > 0
    # K and V of 3 sequences x 40 tokens x 3 KV heads x 64 values, 2 bytes each, over the kernel's time.
    assert results["attention"][0]["kernel_gb_s"] * 1e6 * results["attention"][0][
        "kernel_ms"
    ] == pytest.approx(2 * 3 * 40 * 3 * 64 * 2)
    adjacent = cpu_kernel_bench.main(
        ["--batches", "3", "--contexts", "40", "--layers", "2", "--head-rows", "1", "--vocab", "512",
         "--repeats", "1", "--dtype", "bfloat16", "--pool-gib", "0.01", "--adjacent-blocks",
         "--json", str(out)]
    )  # fmt: skip
    assert adjacent["args"]["adjacent_blocks"] and adjacent["attention"][0]["kernel_ms"] > 0
    with pytest.raises(AssertionError, match="holds"):
        cpu_kernel_bench.main(
            ["--batches", "64", "--contexts", "2048", "--layers", "2", "--head-rows", "1", "--vocab", "512",
             "--repeats", "1", "--pool-gib", "0.01", "--json", str(out)]
        )  # fmt: skip


def test_routing_costs_smoke(redis_url: str, tmp_path: Path) -> None:
    results = routing_costs.main(
        ["--per-step", "1", "4", "--steps", "20", "--workers", "5", "--requests", "200", "--prefixes", "20",
         "--redis-url", redis_url, "--out", str(tmp_path)]
    )  # fmt: skip
    assert json.loads((tmp_path / "routing_costs.json").read_text()) == json.loads(json.dumps(results))
    assert (tmp_path / "routing_costs.png").stat().st_size > 0
    assert set(results["publish_us"]) == {1, 4} and all(us > 0 for us in results["publish_us"].values())
    assert all(results["plan_us"][k] > 0 for k in ("load_us", "prefix_us", "match_us"))


def test_beam_memory_smoke(tiny_model_path: str, tmp_path: Path) -> None:
    import beam_memory

    out, png = tmp_path / "beam.json", tmp_path / "beam.png"
    results = beam_memory.main(
        ["--model", tiny_model_path, "--smoke", "--json", str(out), "--plot", str(png)]
    )  # fmt: skip
    saved = json.loads(out.read_text())["saved_mean_by_width"]
    assert saved == {str(w): s for w, s in results["saved_mean_by_width"].items()}
    assert png.stat().st_size > 0
    assert [r["width"] for r in results["runs"]] == [4, 8]
    for run in results["runs"]:
        assert all(s["num_distinct_blocks"] <= s["num_blocks_unshared"] for s in run["samples"])
        assert 0 < run["saved_mean"] < 1


def test_structured_smoke(tiny_model_path: str, tmp_path: Path) -> None:
    import structured

    out, png = tmp_path / "structured.json", tmp_path / "structured.png"
    results = structured.main(["--model", tiny_model_path, "--smoke", "--json", str(out), "--plot", str(png)])
    assert json.loads(out.read_text())["loss"] == results["loss"] and png.stat().st_size > 0
    [repeat] = results["repeats"]
    for mode in ("free", "mixed"):
        assert repeat[mode]["steps"] >= 8 and repeat[mode]["free_half_output_tokens_per_s"] > 0
    assert repeat["mixed"]["sampler_ms_per_step"] > 0 and results["mixed_over_free_tokens_per_s"] > 0
