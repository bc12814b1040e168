"""Shared by the offline benchmarks: the workloads, the model's shape and FLOPs, the matmul rate."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Token ids 0-16 hold the default tokenizer's special tokens; prompts keep to ordinary ones.
FIRST_TOKEN_ID = 17
WORKLOADS = ("W1", "W2", "W3")
DESCRIPTIONS = {
    "W1": "uniform: 64 requests, input 32, output 64",
    "W2": "mixed: 64 requests, input and output each uniform in [16, 256]",
    "W3": "shared prefix: 64 requests, a common 256-token prefix + 32 of their own, output 64",
}
FLOPS_FORMULA = (
    "per request with p prompt and o output tokens: 2 * N * (p + o) + 2 * vocab * hidden * o"
    " + 4 * layers * heads * head_dim * (p + o) * (p + o + 1) / 2, where N is the parameter count without"
    " the embedding and the LM head (weights), the second term the LM head over sampled tokens, the third"
    " QK^T and AV over the causal context; only requested tokens count (padding and tokens past a"
    " request's own output length are not useful work). Every prompt token counts, also those a prefix-cache"
    " hit skips: with prefix caching the MFU is an effective figure and can exceed what the hardware does"
)


@dataclass(slots=True)
class Workload:
    """Prompts (token ids) and the output length of each request."""

    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    max_input_len: int  # the longest prompt the workload allows, what a contiguous reservation must cover
    max_output_len: int

    @property
    def num_prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def scaled(n: int, scale: float) -> int:
    return max(1, round(n * scale))


def make_workload(name: str, vocab: int, scale: float = 1.0, seed: int = 0, variant: int = 0) -> Workload:
    """Lengths depend only on (name, scale, seed); token contents also on variant.

    Each repeat draws a fresh variant: the same shapes, and no prefix-cache hit on an earlier repeat.
    """
    lengths = torch.Generator().manual_seed(seed)
    tokens = torch.Generator().manual_seed(seed * 1_000_003 + variant + 1)
    num = max(2, round(64 * scale))

    def random_ids(n: int) -> list[int]:
        return torch.randint(FIRST_TOKEN_ID, vocab, (n,), generator=tokens).tolist()

    if name == "W1":
        input_len, output_len = scaled(32, scale), scaled(64, scale)
        return Workload(
            name, [random_ids(input_len) for _ in range(num)], [output_len] * num, input_len, output_len
        )
    if name == "W2":
        low, high = scaled(16, scale), scaled(256, scale)
        input_lens = torch.randint(low, high + 1, (num,), generator=lengths).tolist()
        output_lens = torch.randint(low, high + 1, (num,), generator=lengths).tolist()
        return Workload(name, [random_ids(n) for n in input_lens], output_lens, high, high)
    if name == "W3":
        prefix = random_ids(scaled(256, scale))
        own, output_len = scaled(32, scale), scaled(64, scale)
        prompts = [prefix + random_ids(own) for _ in range(num)]
        return Workload(name, prompts, [output_len] * num, len(prefix) + own, output_len)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


@dataclass(slots=True)
class ModelShape:
    """The sizes that FLOPs and KV bytes are computed from."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    num_params_without_embeddings: int

    @classmethod
    def of(cls, model: Any) -> ModelShape:
        c = model.config
        skip = {id(model.get_input_embeddings().weight)}
        head = model.get_output_embeddings()
        if head is not None:
            skip.add(id(head.weight))
        # named_parameters() yields a tied weight once, so tied and untied heads are both left out.
        params = sum(p.numel() for _, p in model.named_parameters() if id(p) not in skip)
        return cls(
            num_layers=c.num_hidden_layers,
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            hidden_size=c.hidden_size,
            vocab_size=model.get_input_embeddings().weight.shape[0],
            num_params_without_embeddings=params,
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize

    def flops(self, workload: Workload) -> float:
        """Useful FLOPs of a workload (FLOPS_FORMULA)."""
        attention = 4 * self.num_layers * self.num_heads * self.head_dim
        total = 0.0
        for prompt, o in zip(workload.prompts, workload.output_lens):
            n = len(prompt) + o
            total += 2 * self.num_params_without_embeddings * n
            total += 2 * self.vocab_size * self.hidden_size * o
            total += attention * n * (n + 1) / 2
        return total


def matmul_flops_per_s(
    device: torch.device, n: int = 2048, repeats: int = 5, dtype: torch.dtype = torch.float32
) -> float:
    """The best rate of an n x n matmul on this device and thread count (fp32: the MFU denominator)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    best = float("inf")
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first call warms up
            best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def median(values: list[float]) -> float:
    return statistics.median(values)


def write_json(results: dict[str, Any], path: str | Path) -> Path:
    """The results as indented JSON at path, its folder made if need be."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    return out


def save_figure(fig: Any, path: str | Path) -> Path:
    """A matplotlib figure as a PNG at path, its folder made if need be; the figure is closed."""
    import matplotlib.pyplot as plt

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def benchmark_parser(doc: str | None, name: str) -> argparse.ArgumentParser:
    """The options every offline benchmark takes; results go to benchmarks/results/<name>.json and .png."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", default=None, help="model folder or GGUF file (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies request counts and lengths")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=f"benchmarks/results/{name}.json")
    parser.add_argument("--plot", default=f"benchmarks/results/{name}.png")
    return parser
