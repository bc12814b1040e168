"""A decode step's matmuls on the CPU: oneDNN's kernels against the panel kernel, on the same packed weights.

    .venv/bin/python benchmarks/panel_linear_bench.py                  # rows 1 to 256, ~1 min
    .venv/bin/python benchmarks/panel_linear_bench.py --rows 1 8 32
    .venv/bin/python benchmarks/panel_linear_bench.py --dtype bfloat16
    PAGEDSERVE_AVX512=0 .venv/bin/python benchmarks/panel_linear_bench.py  # AVX2 tiles, AVX-512 CPU

Every layer's qkv, o, gate_up and down weights at SmolLM2's shapes (30 layers, 424 MB in fp32, 212 MB in
bf16: more than any cache), each packed once for oneDNN (PackedLinear). One timed call multiplies the same
rows by all of them in turn, as a decode step does, so each weight comes from memory; best of --repeats.
oneDNN is torch.ops.mkldnn._linear_pointwise; the panel kernel (kernels/csrc/cpu/panel_linear_cpu.cpp) reads
the same bytes, which is what PackedLinear runs for up to 128 rows. GB/s is the weights' bytes over the time.
The panel kernel runs AVX-512 tiles where the CPU has them (PAGEDSERVE_AVX512=0: its AVX2 tiles). bf16
weights: where the CPU has AVX512_BF16, oneDNN's panels of pairs, multiplied by its pair dot product (or AMX);
elsewhere PackedLinear packs its own panels of pairs, which the kernel widens to float32, and oneDNN (which
emulates bf16 there) multiplies a copy packed for it.
Prints the table; writes JSON.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from torch import nn
from workloads import write_json

import kernels
from gpu_worker.engine.packed_linear import PackedLinear

LAYERS, HIDDEN, INTERMEDIATE, QKV = 30, 576, 1536, 960
SHAPES = ((QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE))


def step_ms(run: Any, weights: list[PackedLinear], inputs: dict[int, torch.Tensor], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats + 1):  # the first warms up
        start = time.perf_counter()
        for linear in weights:
            run(linear, inputs[linear.in_features])
        best = min(best, time.perf_counter() - start)
    return 1000 * best


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--json", default="benchmarks/results/panel_linear_bench.json")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    kernels.load(torch.device("cpu"), dtype)
    assert kernels.panel_kernel_ready(dtype), (
        f"no {args.dtype} panel kernel here (not built with AVX2 and no AVX-512, "
        "or PAGEDSERVE_PANEL_KERNEL=0)"
    )
    torch.manual_seed(0)
    with torch.inference_mode():
        plain = [nn.Linear(k, n, bias=False).to(dtype) for _ in range(args.layers) for n, k in SHAPES]
        weights = [PackedLinear(linear) for linear in plain]
        panels = sorted({w.panel for w in weights})
        assert 0 not in panels, "oneDNN lays these weights out other than as panels on this CPU"
        gigabytes = sum(w.in_features * w.out_features * dtype.itemsize for w in weights) / 1e9
        # oneDNN's own packing of each weight, where the panel kernel's is not oneDNN's.
        for_onednn = {
            id(packed): torch.ops.mkldnn._reorder_linear_weight(linear.weight, None)
            for packed, linear in zip(weights, plain, strict=True)
            if not packed.weight.is_mkldnn
        }
        del plain

        def onednn(linear: PackedLinear, x: torch.Tensor) -> torch.Tensor:
            weight = for_onednn.get(id(linear), linear.weight)
            return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")

        def panel(linear: PackedLinear, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.pagedserve_cpu.packed_linear(x, linear.weight, None, linear.panel)

        cases = []
        for rows in args.rows:
            inputs = {k: torch.randn(rows, k, dtype=dtype) for k in (HIDDEN, INTERMEDIATE)}
            sample = weights[0]
            ref = onednn(sample, inputs[sample.in_features]).float()
            close = 1e-4 if dtype == torch.float32 else 2e-2
            got = panel(sample, inputs[sample.in_features]).float()
            torch.testing.assert_close(got, ref, atol=close, rtol=close)
            onednn_ms = step_ms(onednn, weights, inputs, args.repeats)
            panel_ms = step_ms(panel, weights, inputs, args.repeats)
            cases.append({"rows": rows, "onednn_ms": onednn_ms, "panel_ms": panel_ms,
                          "onednn_gb_s": gigabytes / onednn_ms * 1e3,
                          "panel_gb_s": gigabytes / panel_ms * 1e3,
                          "speedup": onednn_ms / panel_ms})  # fmt: skip
    print(f"a decode step's matmuls, {args.layers} layers, {gigabytes * 1e3:.0f} MB {args.dtype}, "
          f"panels of {panels}, {torch.get_num_threads()} threads")  # fmt: skip
    print(f"{'rows':>5} {'oneDNN ms':>10} {'GB/s':>6} {'panel ms':>9} {'GB/s':>6} {'speedup':>8}")
    for c in cases:
        print(f"{c['rows']:5d} {c['onednn_ms']:10.2f} {c['onednn_gb_s']:6.1f} {c['panel_ms']:9.2f} "
              f"{c['panel_gb_s']:6.1f} {c['speedup']:7.2f}x")  # fmt: skip
    results = {"args": vars(args), "threads": torch.get_num_threads(), "panels": panels, "cases": cases}
    print(f"wrote {write_json(results, args.json)}")
    return results


if __name__ == "__main__":
    main()
