"""The model's linear layers on the CPU, with weights reordered once into oneDNN's blocked layout.

A decode step multiplies a few rows by each weight. The BLAS behind F.linear repacks the weight on every call,
and with few rows that repacking costs more than the product: the step becomes bound by the GEMM's setup,
not by memory. oneDNN multiplies against a weight already in its own layout, so each call only streams it.
On SmolLM2 (2 threads) fp32 decode steps run 1.2 to 1.7x faster from 1 to 64 sequences, and prefill a little
faster (`benchmarks/roofline.py`); the LM head alone 1.8 to 4x (`benchmarks/cpu_kernel_bench.py`).

oneDNN's kernels for a few rows still leave part of the read bandwidth unused. Where oneDNN lays a float32
weight out as panels of P output columns ([N / P][K][P], P = 64 on AVX2 and AVX-512 CPUs), pagedserve's panel
kernel (kernels/csrc/cpu/panel_linear_cpu.cpp) reads those same bytes for steps of up to 128 rows: no second
copy. A bfloat16 weight, on a CPU with AVX512_BF16, is laid out as panels of pairs ([N / P][K / 2][P][2]),
which the kernel's bfloat16 tiles read in place the same way; on a CPU with AMX-BF16 those panels are what its
tiles multiply, and the kernel runs on them (kernels/csrc/cpu/panel_tiles_amx.cpp).
Whether a weight is so laid out is not asked of oneDNN but checked, once, byte for byte against the plain
weight (panel_width); any other layout stays with oneDNN alone.

Only the summation order changes, as with any BLAS; fp32 greedy output still equals transformers'
(`tests/gpu_worker/engine/test_golden.py`).
"""

from __future__ import annotations

import ctypes
import logging
import time

import torch
from torch import nn

import kernels
from gpu_worker.engine.huge_pages import collapse_into_huge_pages

logger = logging.getLogger(__name__)


def packing_supported(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN multiplies `dtype` weights (bf16 natively or emulated: see cpu_has_bf16)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (avx512_bf16 or AMX), where bf16 runs faster than fp32
    instead of being emulated."""
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return bool(native) and packing_supported(torch.bfloat16)


# Panel widths the panel kernel takes (multiples of its 16-column strips), in the order they are tried.
PANEL_WIDTHS = (64, 32, 16, 48, 128)


def packed_bytes(packed: torch.Tensor) -> torch.Tensor:
    """A oneDNN tensor's buffer as it lies in memory, in its dtype (a view, valid while `packed` lives)."""
    size = int(torch.ops.mkldnn._nbytes(packed))
    buffer = (ctypes.c_char * size).from_address(int(torch.ops.mkldnn.data_ptr(packed)))
    return torch.frombuffer(buffer, dtype=packed.dtype)


def panel_width(plain: torch.Tensor, packed: torch.Tensor) -> int:
    """P where oneDNN packed the weight `plain` [N, K] as panels of P output columns, checked byte for byte:
    in float32 [N / P][K][P] (row k of a panel the k-th input of each column), in bfloat16
    [N / P][K / 2][P][2] (each column's inputs k and k + 1 side by side); 0 for any other layout, or where the
    panel kernel does not run this dtype."""
    if plain.dtype != packed.dtype or not kernels.panel_kernel_ready(plain.dtype):
        return 0
    rows, cols = plain.shape
    raw = packed_bytes(packed)
    if raw.numel() != rows * cols:  # padded or blocked otherwise (so is an odd K, in either dtype)
        return 0
    for width in PANEL_WIDTHS:
        if rows % width:
            continue
        if plain.dtype == torch.float32:
            panels = plain.view(rows // width, width, cols).transpose(1, 2)
        else:
            panels = plain.view(rows // width, width, cols // 2, 2).transpose(1, 2)
        # Compared as integers: the same bits, whatever they mean (a NaN equals itself).
        if torch.equal(raw.view(torch.int16), panels.flatten().view(torch.int16)):
            return width
    return 0


class PackedLinear(nn.Module):
    """Drop-in for an nn.Linear on the CPU. The packed weight replaces the plain one (same bytes, one copy)
    unless the plain one is shared, as a head tied to the embeddings is."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        plain = linear.weight.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(plain, None)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = linear.bias
        # The panel kernel's width for this weight, 0 where it stays with oneDNN alone.
        self.panel = panel_width(plain, packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panel:
            return kernels.packed_linear(x, self.weight, self.bias, self.panel)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        bias = self.bias is not None
        sizes = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{sizes}, bias={bias}, panel={self.panel}"


def pack_linears(model: nn.Module) -> int:
    """Swap every nn.Linear of a CPU model (LM head included) for a PackedLinear; returns how many.
    Does nothing on other devices, or where this CPU's oneDNN lacks the weights' dtype."""
    first = next(model.parameters())
    if first.device.type != "cpu" or not packing_supported(first.dtype):
        return 0
    targets = [(name, module) for name, module in model.named_modules() if type(module) is nn.Linear]
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, PackedLinear(linear))
    logger.debug("packed %d linear layers for oneDNN", len(targets))
    return len(targets)


def weights_into_huge_pages(model: nn.Module) -> int:
    """Moves every packed weight of `model` into transparent huge pages (huge_pages.collapse_into_huge_pages);
    returns the bytes now in huge pages. Each decode step streams all of them: on huge pages SmolLM2's decode
    steps take 1.5 to 7% less time (benchmarks/huge_pages.py, docs/kernels.md)."""
    ranges = [
        (int(torch.ops.mkldnn.data_ptr(m.weight)), int(torch.ops.mkldnn._nbytes(m.weight)))
        for m in model.modules()
        if isinstance(m, PackedLinear)
    ]
    if not ranges:
        return 0
    start = time.perf_counter()
    done = collapse_into_huge_pages(ranges)
    logger.info(
        "packed weights: %.0f MB, %.0f MB of huge pages over them (%.1f s)",
        sum(size for _, size in ranges) / 1e6,
        done / 1e6,
        time.perf_counter() - start,
    )
    return done
