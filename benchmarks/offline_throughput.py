"""Offline throughput: pagedserve's LLM.generate against transformers' static batched generate(), same run.

Random-token prompts (fixed seed), input lengths uniform in [--min-input, --max-input], --output tokens each
with ignore_eos. Prints a table and writes JSON.

    python benchmarks/offline_throughput.py                 # default model, 64 prompts
    python benchmarks/offline_throughput.py --model DIR --num-prompts 8 --output 8   # a quick smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import offline
import torch
from transformers import AutoModelForCausalLM
from workloads import Workload

from gpu_worker import LLM, SamplingParams
from gpu_worker.engine.model_loader import resolve_model_path


def make_prompts(num: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num,), generator=g).tolist()
    # Token ids 0-16 hold the tokenizer's special tokens; keep prompts to ordinary ones.
    return [torch.randint(17, vocab, (n,), generator=g).tolist() for n in lengths]


def run_static(model: Any, prompts: list[list[int]], output_len: int, batch_size: int, pad_id: int) -> float:
    """transformers' generate() over left-padded static batches; returns seconds."""
    longest = max(map(len, prompts))
    workload = Workload("headline", prompts, [output_len] * len(prompts), longest, output_len)
    return offline.run_static(model, workload, batch_size, pad_id)


def run_paged(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="model folder or GGUF file (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-input", type=int, default=32)
    parser.add_argument("--max-input", type=int, default=256)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument(
        "--static-batch-sizes", default="16,64", help="comma-separated; the best one is reported"
    )
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="benchmarks/results/offline_throughput.json")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    path = resolve_model_path(args.model)
    llm = LLM(path, dtype="float32", device="cpu", max_num_batched_tokens=2048, max_num_seqs=256)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = model.get_input_embeddings().weight.shape[0]
    prompts = make_prompts(args.num_prompts, args.min_input, args.max_input, vocab, args.seed)
    output_tokens = args.num_prompts * args.output
    pad_id = model.generation_config.pad_token_id or 0

    times: dict[str, list[float]] = {"pagedserve": []}
    batch_sizes = [int(b) for b in args.static_batch_sizes.split(",")]
    for b in batch_sizes:
        times[f"static generate() batch={b}"] = []
    run_paged(llm, prompts[:2], 2)  # warm-up
    for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits every system alike
        times["pagedserve"].append(run_paged(llm, prompts, args.output))
        for b in batch_sizes:
            times[f"static generate() batch={b}"].append(run_static(model, prompts, args.output, b, pad_id))

    results = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    best_static = min(v for k, v in results.items() if k != "pagedserve")
    rows = []
    print(
        f"{args.num_prompts} prompts, input {args.min_input}-{args.max_input}, output {args.output}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print(f"{'system':32} {'seconds':>8} {'output tok/s':>13} {'vs best static':>15}")
    for name, seconds in results.items():
        rows.append(
            {
                "system": name,
                "seconds": seconds,
                "output_tokens_per_s": output_tokens / seconds,
                "speedup_vs_best_static": best_static / seconds,
                "all_seconds": times[name],
            }
        )
        print(f"{name:32} {seconds:8.2f} {output_tokens / seconds:13.1f} {best_static / seconds:14.2f}x")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"args": vars(args), "machine": platform.platform(), "results": rows}, indent=2)
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
