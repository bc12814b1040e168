"""Paged KV-cache ops: the single import point the model runner uses."""

# Dispatch point: for now every op is the pure-torch one. Once the CUDA extension is built, a CUDA op with the
# same signature is picked here when the tensors are on CUDA; callers never import torch_ops directly.
from kernels.torch_ops import copy_blocks, paged_attention, write_kv_cache

__all__ = ["copy_blocks", "paged_attention", "write_kv_cache"]
