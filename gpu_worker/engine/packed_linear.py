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

On a CPU without AVX512_BF16 or AMX, oneDNN only emulates bfloat16: it converts to float32 at a fraction of
its float32 rate, and lays the weight out otherwise. There a bfloat16 weight is packed into panels of pairs
here (own_bf16_panels), oneDNN is left out, and the panel kernel takes every step, widening each pair of
weights to float32 in registers: half a float32 weight's bytes to stream, multiplied at about the float32
rate.

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
    """Whether `dtype` weights can be packed here: for this CPU's oneDNN, or as the panel kernel's own bf16
    panels (own_bf16_panels)."""
    return onednn_packs(dtype) or (dtype == torch.bfloat16 and own_bf16_panels())


def onednn_packs(dtype: torch.dtype) -> bool:
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
    return bool(native) and onednn_packs(torch.bfloat16)


def own_bf16_panels() -> bool:
    """Whether bf16 weights are packed here as panels of pairs for the panel kernel alone: where this CPU does
    not multiply bf16 natively (oneDNN would emulate it) and the kernel widens bf16 weights to float32."""
    return not cpu_has_bf16() and kernels.panel_kernel_ready(torch.bfloat16)


def own_panel_width(weight: torch.Tensor) -> int:
    """The width of the panels a bf16 weight [N, K] is packed in here (own_bf16_panels), 0 where it is not:
    another dtype, an odd K, or no width of PANEL_WIDTHS that divides N."""
    rows, cols = weight.shape
    if weight.dtype != torch.bfloat16 or cols % 2 or not own_bf16_panels():
        return 0
    return next((width for width in PANEL_WIDTHS if rows % width == 0), 0)


def can_pack(linear: nn.Linear) -> bool:
    """Whether PackedLinear takes this linear's weight here: as the kernel's own panels, or for oneDNN."""
    return bool(own_panel_width(linear.weight)) or onednn_packs(linear.weight.dtype)


def bf16_panels(plain: torch.Tensor, width: int) -> torch.Tensor:
    """A bf16 weight [N, K] as panels of `width` output columns, each column's inputs k and k + 1 side by
    side: [N / width, K / 2, width, 2], the layout oneDNN gives it on CPUs with AVX512_BF16."""
    rows, cols = plain.shape
    return plain.reshape(rows // width, width, cols // 2, 2).transpose(1, 2).contiguous()


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
    unless the plain one is shared, as a head tied to the embeddings is. It is a oneDNN tensor, or (bf16 where
    own_bf16_panels) a plain one of panels of pairs [N / panel, K / 2, panel, 2] that only the panel kernel
    reads."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        plain = linear.weight.detach()
        self.bias = linear.bias
        width = own_panel_width(plain)
        if width:
            self.weight = nn.Parameter(bf16_panels(plain, width), requires_grad=False)
            self.panel = width
            return
        packed = torch.ops.mkldnn._reorder_linear_weight(plain, None)
        self.weight = nn.Parameter(packed, requires_grad=False)
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
    Does nothing on other devices, or where neither oneDNN nor the panel kernel takes the weights' dtype; a
    linear that neither takes (see can_pack) stays as it is."""
    first = next(model.parameters())
    if first.device.type != "cpu" or not packing_supported(first.dtype):
        return 0
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear and can_pack(module)
    ]
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, PackedLinear(linear))
    logger.debug("packed %d linear layers for oneDNN", len(targets))
    return len(targets)


def _weight_range(weight: torch.Tensor) -> tuple[int, int]:
    """Where a packed weight's bytes lie: (address, size)."""
    if weight.is_mkldnn:
        return int(torch.ops.mkldnn.data_ptr(weight)), int(torch.ops.mkldnn._nbytes(weight))
    return weight.data_ptr(), weight.numel() * weight.element_size()


def weights_into_huge_pages(model: nn.Module) -> int:
    """Moves every packed weight of `model` into transparent huge pages (huge_pages.collapse_into_huge_pages);
    returns the bytes now in huge pages. Each decode step streams all of them: on huge pages SmolLM2's decode
    steps take 1.5 to 7% less time (benchmarks/huge_pages.py, docs/kernels.md)."""
    ranges = [_weight_range(m.weight) for m in model.modules() if isinstance(m, PackedLinear)]
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
