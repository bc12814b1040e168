"""pagedserve against vLLM's CPU build on the same offline workloads: output tokens/s side by side.

    make bench-vllm                        # runs both (benchmarks/offline.py --systems pagedserve,
                                           # benchmarks/vllm_offline.py in its own venv) on W1-W3, then this
    make bench-vllm BENCH_DTYPE=bfloat16   # the same with weights and KV cache in bf16

Reads the two runs' JSON (benchmarks/results/offline_pagedserve_<dtype>.json and vllm_offline_<dtype>.json by
default), prints the table, writes JSON and a bar plot.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from workloads import save_figure, write_json


def pagedserve_rate(offline: dict[str, Any], key: str) -> float | None:
    """Median output tokens/s of pagedserve (with prefix caching, on W3) in an offline.py run."""
    rows = [
        r
        for r in offline["workloads"].get(key, {}).get("systems", [])
        if r["system"].startswith("pagedserve")
    ]
    rows = [r for r in rows if "no prefix" not in r["system"] and "output_tokens_per_s" in r]
    return rows[0]["output_tokens_per_s"] if rows else None


def compare(offline: dict[str, Any], vllm: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for key, theirs in vllm["workloads"].items():
        ours = pagedserve_rate(offline, key)
        if ours is None:
            continue
        rate = theirs["output_tokens_per_s"]
        rows.append({"workload": key, "pagedserve": ours, "vllm": rate, "ratio": ours / rate})
    return rows


def plot(rows: list[dict[str, Any]], version: str, dtype: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["pagedserve"] for r in rows], 0.4, label="pagedserve")
    ax.bar([x + 0.2 for x in xs], [r["vllm"] for r in rows], 0.4, label=f"vLLM {version} (CPU)")
    ax.set_title(dtype)
    ax.set_xticks(list(xs), [f"{r['workload']}\n{r['ratio']:.2f}x" for r in rows])
    ax.set_ylabel("output tokens/s")
    ax.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--pagedserve", help="default: benchmarks/results/offline_pagedserve_<dtype>.json")
    parser.add_argument("--vllm", help="default: benchmarks/results/vllm_offline_<dtype>.json")
    parser.add_argument("--json", help="default: benchmarks/results/vs_vllm_<dtype>.json")
    parser.add_argument("--plot", help="default: benchmarks/results/vs_vllm_<dtype>.png")
    args = parser.parse_args(argv)
    results = Path("benchmarks/results")
    args.pagedserve = args.pagedserve or results / f"offline_pagedserve_{args.dtype}.json"
    args.vllm = args.vllm or results / f"vllm_offline_{args.dtype}.json"
    args.json = args.json or results / f"vs_vllm_{args.dtype}.json"
    args.plot = args.plot or results / f"vs_vllm_{args.dtype}.png"
    vllm = json.loads(Path(args.vllm).read_text())
    rows = compare(json.loads(Path(args.pagedserve).read_text()), vllm)
    print(f"{'workload':<10}{'pagedserve tok/s':>18}{'vLLM tok/s':>12}{'ratio':>8}")
    for r in rows:
        print(f"{r['workload']:<10}{r['pagedserve']:>18.1f}{r['vllm']:>12.1f}{r['ratio']:>7.2f}x")
    write_json({"vllm": vllm["vllm"], "dtype": args.dtype, "rows": rows}, args.json)
    plot(rows, vllm["vllm"], args.dtype, Path(args.plot))
    print(f"wrote {args.json} and {args.plot}")
    return rows


if __name__ == "__main__":
    main()
