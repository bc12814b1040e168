"""pagedserve's own forward for Llama-family models (Llama, Mistral without a sliding window, Qwen2, Qwen3,
SmolLM): the same weights as transformers' modules, fewer and fused ops.

A layer is four matmuls (q/k/v as one, o, gate/up as one, down) and three fused elementwise passes
(kernels): the residual sum with the next RMSNorm, SiLU-and-multiply, and rotary applied to the query and to
the key as it is written into the paged cache. One Python call runs a layer, with no module hooks or keyword
plumbing between the ops. Every other architecture, and a model this does not take, runs through
transformers with the paged attention plugged into its attention interface (gpu_worker.engine.attention).

The fused ops round where transformers' modules do, so float32 greedy output is transformers' own, token for
token (`tests/gpu_worker/engine/test_golden.py`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

import kernels
from gpu_worker.engine.attention import AttentionMetadata
from gpu_worker.engine.packed_linear import PackedLinear, can_pack, packing_supported

logger = logging.getLogger(__name__)

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why this forward cannot run `model`, or None when it can."""
    config = model.config
    if config.model_type not in LLAMA_FAMILY:
        return f"architecture {config.model_type!r} is not of the Llama family"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types) or (
        config.model_type == "mistral" and getattr(config, "sliding_window", None) is not None
    ):
        return "sliding-window attention"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "tensor-parallel pretraining slices (pretraining_tp)"
    return None


def _fused_linear(parts: list[nn.Linear], pack: bool) -> nn.Module:
    """One linear layer whose output is the parts' outputs side by side (their weights stacked)."""
    weight = torch.cat([p.weight.detach() for p in parts])
    biases = [p.bias for p in parts]
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=biases[0] is not None, device=weight.device)
    linear.to(weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if linear.bias is not None:
            linear.bias.copy_(torch.cat([b.detach() for b in biases if b is not None]))
    linear.requires_grad_(False)
    return PackedLinear(linear) if pack and can_pack(linear) else linear


def _linear(part: nn.Module, pack: bool) -> nn.Module:
    return PackedLinear(part) if pack and type(part) is nn.Linear and can_pack(part) else part


@dataclass(slots=True)
class _Layer:
    qkv: nn.Module
    o: nn.Module
    gate_up: nn.Module
    down: nn.Module
    input_norm: Tensor
    post_attention_norm: Tensor
    q_norm: Tensor | None  # Qwen3's per-head norms of the query and the key
    k_norm: Tensor | None


class LlamaForward(nn.Module):
    """The model runner's forward for a Llama-family model: built from transformers' model (whose layers it
    takes apart), it answers the runner's one call per step."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"pagedserve's Llama forward cannot run this model: {reason}")
        config = model.config
        self.config = config
        self.generation_config = model.generation_config
        inner: Any = model.model
        first = next(model.parameters())
        pack = first.device.type == "cpu" and packing_supported(first.dtype)
        self.embed_tokens = inner.embed_tokens
        self.rotary_emb = inner.rotary_emb
        self.norm = inner.norm
        head = model.get_output_embeddings()
        self.lm_head = _linear(head, pack)
        self.eps = float(config.rms_norm_eps)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_dim**-0.5
        self.shape = (self.num_heads, self.num_kv_heads, self.head_dim)
        self.fused = nn.ModuleList()  # the layers' matmuls, among this module's parameters
        self.hf_layers = inner.layers  # the norms' weights stay where transformers put them
        self.layers: list[_Layer] = []
        for hf_layer in inner.layers:
            attn, mlp = hf_layer.self_attn, hf_layer.mlp
            q_norm = getattr(attn, "q_norm", None)
            k_norm = getattr(attn, "k_norm", None)
            layer = _Layer(
                qkv=_fused_linear([attn.q_proj, attn.k_proj, attn.v_proj], pack),
                o=_linear(attn.o_proj, pack),
                gate_up=_fused_linear([mlp.gate_proj, mlp.up_proj], pack),
                down=_linear(mlp.down_proj, pack),
                input_norm=hf_layer.input_layernorm.weight,
                post_attention_norm=hf_layer.post_attention_layernorm.weight,
                q_norm=None if q_norm is None else q_norm.weight,
                k_norm=None if k_norm is None else k_norm.weight,
            )
            self.fused.append(nn.ModuleList([layer.qkv, layer.o, layer.gate_up, layer.down]))
            self.layers.append(layer)
            # The projections now live in the fused layers: drop the originals (one copy of each weight).
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                setattr(attn, name, nn.Identity())
            for name in ("gate_proj", "up_proj", "down_proj"):
                setattr(mlp, name, nn.Identity())
        # A decode step's layers can run in one C++ call (the CPU kernels, weights packed for oneDNN).
        self.decode_weights = self._decode_weights() if pack else None
        self.use_cpp_layers = self.decode_weights is not None
        # Each layer's qkv, o, gate_up and down panel widths (0: oneDNN), for the C++ loop's matmuls.
        self.decode_panels = [
            getattr(module, "panel", 0)
            for layer in self.layers
            for module in (layer.qkv, layer.o, layer.gate_up, layer.down)
        ]
        logger.debug("pagedserve's Llama forward over %d layers (packed: %s)", len(self.layers), pack)

    def _decode_weights(self) -> list[Tensor | None] | None:
        """Each layer's tensors in the order kernels.llama_decode_layers takes them, or None where that op
        is not built, the attention kernel cannot take the model's heads, or a linear stayed unpacked."""
        weight = self.embed_tokens.weight
        if not kernels.cpp_layers_support(weight, self.head_dim):
            return None
        linears = [m for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if not all(isinstance(m, PackedLinear) for m in linears):
            return None
        tensors: list[Tensor | None] = []
        for layer in self.layers:
            tensors += [
                _param(layer.qkv, "weight"),
                _param(layer.qkv, "bias"),
                _param(layer.o, "weight"),
                _param(layer.gate_up, "weight"),
                _param(layer.down, "weight"),
                layer.input_norm,
                layer.post_attention_norm,
                layer.q_norm,
                layer.k_norm,
            ]
        return tensors

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(
        self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, logits_indices: Tensor
    ) -> Tensor:
        """Logits `[len(logits_indices), vocab]` at those of the step's tokens (input_ids and positions are
        `[T]`)."""
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(hidden, positions.unsqueeze(0))
        cos, sin = cos[0], sin[0]
        # Every row one query token (decodes, and the drafts of a verify split into rows): one C++ call.
        if (
            self.use_cpp_layers
            and self.decode_weights is not None
            and meta.seq_lens.shape[0] == hidden.shape[0]
        ):
            x = kernels.llama_decode_layers(
                hidden,
                self.decode_weights,
                self.norm.weight,
                cos,
                sin,
                meta,
                self.shape,
                self.eps,
                self.scale,
                self.decode_panels,
            )
            return self.lm_head(x[logits_indices])
        residual = hidden
        x = torch.empty_like(hidden)
        kernels.rms_norm(x, hidden, self.layers[0].input_norm, self.eps)
        for index, layer in enumerate(self.layers):
            x = self._layer(index, layer, x, residual, cos, sin, meta)
        # The last layer's output, summed into the residual and normed.
        kernels.add_rms_norm(x, residual, self.norm.weight, self.eps)
        return self.lm_head(x[logits_indices])

    def _layer(
        self,
        index: int,
        layer: _Layer,
        x: Tensor,
        residual: Tensor,
        cos: Tensor,
        sin: Tensor,
        meta: AttentionMetadata,
    ) -> Tensor:
        """One layer from its input norm's output x; residual is updated in place. Returns the next layer's
        input norm's output (the model's last hidden state, before its sum, after the last layer)."""
        tokens = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = layer.qkv(x)
        q = qkv[:, :q_size].reshape(tokens, self.num_heads, self.head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:
            q, k = _head_norm(q, layer.q_norm, self.eps), _head_norm(k, layer.k_norm, self.eps)
        k_cache, v_cache = meta.kv_caches[index]
        kernels.rotary_write_kv(q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping)
        attended = torch.empty_like(q)
        kernels.paged_attention(
            attended, q, k_cache, v_cache, meta.block_table, meta.seq_lens, meta.query_start_loc, self.scale
        )
        h = layer.o(attended.view(tokens, q_size))
        kernels.add_rms_norm(h, residual, layer.post_attention_norm, self.eps)
        gate_up = layer.gate_up(h)
        act = torch.empty(tokens, gate_up.shape[1] // 2, dtype=h.dtype, device=h.device)
        kernels.silu_and_mul(act, gate_up)
        out = layer.down(act)
        if index + 1 < len(self.layers):
            kernels.add_rms_norm(out, residual, self.layers[index + 1].input_norm, self.eps)
        return out


def _param(module: nn.Module, name: str) -> Tensor | None:
    value = getattr(module, name)
    assert value is None or isinstance(value, Tensor)
    return value


def _head_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    out = torch.empty_like(x)
    kernels.rms_norm(out, x.contiguous(), weight, eps)
    return out
