"""Loading a Hugging Face causal LM (a folder or a GGUF file), with a disk cache for de-quantized GGUF."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from gpu_worker.engine.attention import ATTENTION_NAME
from gpu_worker.engine.packed_linear import cpu_has_bf16
from shared.model_files import converted_folder, is_gguf, model_source, publish_folder, write_tokenizer_files

logger = logging.getLogger(__name__)


def _convert_gguf(gguf_path: Path, folder: Path) -> None:
    """De-quantize once (slow) and save as safetensors, so later starts load in well under a second."""
    logger.info("de-quantizing %s (once)", gguf_path)
    # The tokenizer comes from the same torch-free extraction the gateway uses, so both tokenize alike.
    write_tokenizer_files(gguf_path, folder)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, dtype=torch.float32, gguf_file=gguf_path.name
    )
    # The weights are plain tensors now; drop the GGUF marks so save_pretrained accepts the model.
    del model.config.quantization_config
    model.hf_quantizer = None  # type: ignore[assignment]
    model.is_quantized = False  # type: ignore[assignment]
    model.save_pretrained(folder)


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16 on a GPU and on a CPU with bf16 instructions (weights, KV cache and matmuls in bf16,
    accumulated in fp32), else float32."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" or cpu_has_bf16() else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, dtype, None)
    if not isinstance(resolved, torch.dtype) or resolved not in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
    ):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")
    return resolved


def resolve_model_path(model: str | None) -> str:
    """A folder from_pretrained can load: the argument itself, or the de-quantized cache of a GGUF file."""
    path = model_source(model)
    if not is_gguf(path):
        return str(path)
    target = converted_folder(path)
    if not (target / "config.json").exists():
        publish_folder(target, lambda folder: _convert_gguf(path, folder))
    return str(target)


def load_model(
    model: str | None, dtype: torch.dtype, device: torch.device
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model in eval mode with pagedserve's attention, and its tokenizer."""
    path = resolve_model_path(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    # Loading a converted folder takes well under a second; its per-tensor progress bar is only noise.
    hf_logging.disable_progress_bar()
    try:
        hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=ATTENTION_NAME)
    finally:
        hf_logging.enable_progress_bar()
    hf_model.to(device)  # type: ignore[arg-type]
    hf_model.eval()
    return hf_model, tokenizer
