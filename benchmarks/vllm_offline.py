"""vLLM's CPU build on the offline workloads of benchmarks/offline.py: the same token-id prompts, greedy with
ignore_eos, fp32, the same KV pool and step budget. Runs in a venv of its own (`make bench-vllm` makes it and
runs this); imports vllm and benchmarks/workloads.py, nothing of pagedserve.

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python benchmarks/vllm_offline.py --model <SmolLM2 folder>

Each repeat draws fresh token contents of the same shapes (the variants offline.py uses), after a warm-up on
other contents. Prints median seconds and output tokens/s per workload; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: offline.py's --pool-mib 1024

from workloads import WORKLOADS, Workload, make_workload, write_json

MAX_BATCHED_TOKENS = 2048  # as offline.py
MAX_NUM_SEQS = 256


def run(llm: Any, workload: Workload) -> float:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in workload.prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in workload.output_lens]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == workload.output_lens
    return elapsed


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="the model folder (safetensors) pagedserve serves")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--json", default="benchmarks/results/vllm_offline.json")
    args = parser.parse_args(argv)

    import vllm

    config = json.loads((Path(args.model) / "config.json").read_text())
    llm = vllm.LLM(
        model=args.model,
        dtype=args.dtype,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        max_num_seqs=MAX_NUM_SEQS,
        enable_prefix_caching=True,
        seed=args.seed,
    )
    vocab = config["vocab_size"]
    run(llm, make_workload("W1", vocab, 0.1, args.seed, variant=-1))  # warm-up
    seconds: dict[str, list[float]] = {key: [] for key in args.workloads}
    for rep in range(args.repeats):  # interleaved, as offline.py does
        for key in args.workloads:
            elapsed = run(llm, make_workload(key, vocab, args.scale, args.seed, variant=2 * rep))
            seconds[key].append(elapsed)
            print(f"  {key} vLLM {vllm.__version__}: {elapsed:.2f} s", flush=True)
    results: dict[str, Any] = {"vllm": vllm.__version__, "args": vars(args), "workloads": {}}
    for key in args.workloads:
        wl = make_workload(key, vocab, args.scale, args.seed, variant=0)
        median = statistics.median(seconds[key])
        results["workloads"][key] = {
            "seconds": seconds[key],
            "median_s": median,
            "output_tokens_per_s": wl.num_output_tokens / median,
            "num_output_tokens": wl.num_output_tokens,
        }
        print(f"{key}: {median:.2f} s, {wl.num_output_tokens / median:.1f} output tokens/s")
    out = Path(args.json)
    write_json(results, out)
    print(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
