"""The LM head on the CPU, computed as W @ x^T: one stream over the vocabulary weight instead of a repacking.

With few rows to project (a decode step samples one token per sequence), the CPU BLAS behind F.linear
spends more time repacking the [vocab, hidden] weight than multiplying; the transposed product walks the
weight once (`benchmarks/cpu_kernel_bench.py` times both for SmolLM2's [49152, 576] head).
"""

from __future__ import annotations

import torch
from torch import nn


class VocabProjection(nn.Module):
    """Drop-in for the model's LM head nn.Linear, sharing its weight (and so any tie to the embeddings)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self.bias is None:
            out = torch.mm(self.weight, flat.t())
        else:
            out = torch.addmm(self.bias[:, None], self.weight, flat.t())
        return out.t().contiguous().view(*x.shape[:-1], self.weight.shape[0])


def use_vocab_projection(model: nn.Module) -> None:
    """Swap a CPU model's LM head for VocabProjection (same weight, same result up to summation order)."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    if isinstance(head, nn.Linear) and head.weight.device.type == "cpu":
        model.set_output_embeddings(VocabProjection(head))  # type: ignore[operator]
