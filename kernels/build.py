"""Builds the kernels of kernels/csrc into torch extensions (JIT, cached on disk) and loads them.

    python -m kernels.build     # ahead of time: `make kernels`, the Docker image

Two extensions: the CUDA kernels (torch.ops.pagedserve, csrc/*.cu) and the CPU decode attention
(torch.ops.pagedserve_cpu, csrc/cpu/). The CUDA build targets TORCH_CUDA_ARCH_LIST ("8.0;9.0", "9.0+PTX")
when it is set, else the current GPU; the CPU build, the vector extensions of the CPU it runs on. Each
extension's name carries a hash of its sources and flags, so an edited header or another architecture builds
afresh while an unchanged tree loads the cached library in well under a second.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
CPU_CSRC = CSRC / "cpu"
SOURCES = [
    "paged_attention_decode.cu",
    "paged_attention_decode_fp32.cu",
    "paged_attention_decode_fp16.cu",
    "paged_attention_decode_bf16.cu",
    "cache_kernels.cu",
    "bindings.cpp",
]
# Architectures of an ahead-of-time build on a machine without a GPU: A100 and H100/H200.
DEFAULT_ARCHS = "8.0;9.0"


def arch_flags() -> list[str]:
    """nvcc -gencode flags for TORCH_CUDA_ARCH_LIST, else the current device, else DEFAULT_ARCHS."""
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if not arch_list:
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            arch_list = f"{major}.{minor}"
        else:
            arch_list = DEFAULT_ARCHS
    flags = []
    for arch in arch_list.replace(",", ";").replace(" ", ";").split(";"):
        if not arch:
            continue
        number = arch.removesuffix("+PTX").replace(".", "")
        flags.append(f"-gencode=arch=compute_{number},code=sm_{number}")
        if arch.endswith("+PTX"):
            flags.append(f"-gencode=arch=compute_{number},code=compute_{number}")
    return flags


def extension_name(flags: list[str], folder: Path = CSRC, stem: str = "pagedserve_kernels") -> str:
    digest = hashlib.sha256(" ".join(flags).encode())
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return f"{stem}_{digest.hexdigest()[:12]}"


@contextlib.contextmanager
def exclusive_build(name: str) -> Iterator[None]:
    """One build of the extension at a time, by a lock the kernel drops when its holder dies; and, once held,
    away with the lock file torch's builder leaves when a build is killed midway (torch would wait for it
    forever: every later process that loads the extension would hang)."""
    from torch.utils.cpp_extension import _get_build_directory

    folder = Path(_get_build_directory(name, verbose=False))
    try:
        held = (folder / "pagedserve.flock").open("w")
    except OSError:  # a read-only folder: a prebuilt extension, which nothing builds again
        yield
        return
    with held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = folder / "lock"
        if stale.exists():
            logger.warning("removing %s, left by a build that did not finish", stale)
            stale.unlink(missing_ok=True)
        yield


def build(verbose: bool = False) -> str:
    """Compile (or find in the cache) the extension, load it into torch.ops.pagedserve; returns its path."""
    # Deferred: cpp_extension pulls in setuptools, which nothing on the CPU path needs.
    from torch.utils.cpp_extension import load

    cuda_flags = ["-O3", "-lineinfo", *arch_flags()]
    name = extension_name(cuda_flags)
    with exclusive_build(name):
        path = load(
            name=name,
            sources=[str(CSRC / source) for source in SOURCES],
            extra_cflags=["-O3"],
            extra_cuda_cflags=cuda_flags,
            is_python_module=False,
            verbose=verbose,
        )
    return str(path)


@functools.cache
def load_extension() -> Any | None:
    """torch.ops.pagedserve with the CUDA ops (built on first use), or None where CUDA is unavailable."""
    if torch.version.cuda is None or not torch.cuda.is_available():
        return None
    try:
        build()
    except Exception:  # a GPU without a CUDA toolkit still serves, through the torch ops
        logger.exception("building the pagedserve CUDA kernels failed; using the pure-torch ops")
        return None
    return torch.ops.pagedserve


def cpu_flags() -> list[str]:
    """Compiler flags of the CPU extension: AVX2 and FMA where torch itself runs on them."""
    flags = ["-O3", "-fopenmp"]
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma"]
    return flags


def build_cpu(verbose: bool = False) -> str:
    """Compile (or find in the cache) the CPU extension, load it into torch.ops.pagedserve_cpu."""
    from torch.utils.cpp_extension import load

    flags = cpu_flags()
    name = extension_name(flags, CPU_CSRC, "pagedserve_cpu_kernels")
    with exclusive_build(name):
        path = load(
            name=name,
            sources=[str(p) for p in sorted(CPU_CSRC.glob("*.cpp"))],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=verbose,
        )
    return str(path)


@functools.cache
def load_cpu_extension() -> Any | None:
    """torch.ops.pagedserve_cpu (built on first use), or None where it cannot be built (no C++ compiler).

    PAGEDSERVE_CPU_KERNELS=0 keeps the CPU on the pure-torch ops.
    """
    if os.environ.get("PAGEDSERVE_CPU_KERNELS", "1") == "0":
        return None
    try:
        build_cpu()
    except Exception:
        logger.exception("building the pagedserve CPU kernels failed; using the pure-torch ops")
        return None
    return torch.ops.pagedserve_cpu


def main() -> int:
    logging.basicConfig(level=logging.INFO)
    print(f"kernels.build: CPU kernels, {' '.join(cpu_flags())}", flush=True)
    print(f"kernels.build: {build_cpu(verbose=True)}")
    if torch.version.cuda is None:
        print(f"kernels.build: torch {torch.__version__} has no CUDA; no CUDA kernels", file=sys.stderr)
        return 0
    print(f"kernels.build: building for {' '.join(arch_flags())}", flush=True)
    print(f"kernels.build: {build(verbose=True)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
