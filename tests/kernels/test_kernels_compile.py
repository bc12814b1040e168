"""The CUDA sources build with nvcc alone, for Hopper and Ampere: no GPU and no CUDA build of torch needed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from kernels import DECODE_HEAD_SIZES
from kernels.build import CSRC, SOURCES

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")

ARCHS = ("sm_90", "sm_80")
CU_FILES = sorted(path.name for path in CSRC.glob("*.cu"))
# torch's extension build compiles with these: the device code must not lean on implicit half conversions.
TORCH_NVCC_FLAGS = [
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
    "--expt-relaxed-constexpr",
]
TORCH_INCLUDE = Path(torch.__file__).parent / "include"
# The only header a CPU build of torch lacks for the bindings; a CUDA build's own copy wins (-idirafter).
CUDA_MACROS_STUB = "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n"

Result = subprocess.CompletedProcess[str]


def nvcc(*args: str) -> Result:
    assert NVCC is not None
    return subprocess.run([NVCC, *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Result, Path]]:
    """Every .cu file for every arch, and bindings.cpp against torch's headers, compiled in parallel once."""
    out = tmp_path_factory.mktemp("nvcc")
    stub = out / "stub" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text(CUDA_MACROS_STUB)
    jobs: dict[str, tuple[list[str], Path]] = {}
    for name in CU_FILES:
        for arch in ARCHS:
            obj = out / f"{name}.{arch}.o"
            flags = [f"-arch={arch}", "-std=c++17", "-O2", *TORCH_NVCC_FLAGS]
            jobs[f"{name}-{arch}"] = ([*flags, "-c", str(CSRC / name), "-o", str(obj)], obj)
    obj = out / "bindings.o"
    jobs["bindings.cpp"] = (
        [
            "-std=c++20", "-O0", "-c", str(CSRC / "bindings.cpp"), "-o", str(obj),
            "-I", str(TORCH_INCLUDE), "-I", str(TORCH_INCLUDE / "torch" / "csrc" / "api" / "include"),
            "-Xcompiler", f"-idirafter,{out / 'stub'}",
        ],
        obj,
    )  # fmt: skip
    # Each dtype's decode kernels take about 12 s per arch on one core; the rest is quick.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(lambda job: nvcc(*job[0]), jobs.values()))
    return {key: (result, job[1]) for (key, job), result in zip(jobs.items(), results)}


def report(result: Result) -> str:
    return f"{' '.join(result.args)}\n{result.stdout}\n{result.stderr}"


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", CU_FILES)
def test_cuda_source_compiles(builds: dict[str, tuple[Result, Path]], name: str, arch: str) -> None:
    result, obj = builds[f"{name}-{arch}"]
    assert result.returncode == 0, report(result)
    assert obj.stat().st_size > 0


@needs_nvcc
@pytest.mark.skipif(
    not (TORCH_INCLUDE / "c10" / "cuda" / "CUDAGuard.h").exists(), reason="torch ships no c10/cuda headers"
)
def test_bindings_compile_against_torch_headers(builds: dict[str, tuple[Result, Path]]) -> None:
    result, _ = builds["bindings.cpp"]
    assert result.returncode == 0, report(result)


@needs_nvcc
@pytest.mark.skipif(shutil.which("nm") is None, reason="nm is not on PATH")
def test_objects_link(builds: dict[str, tuple[Result, Path]]) -> None:
    """Every pagedserve function an object calls (a launcher, a per-dtype instantiation) is defined by one
    of the sm_90 objects with that exact signature: what the extension's link would find missing."""

    def symbols(path: Path, flag: str) -> set[str]:
        lines = subprocess.run(["nm", flag, str(path)], capture_output=True, text=True, check=True).stdout
        return {line.split()[-1] for line in lines.splitlines() if "10pagedserve" in line}

    objects = [builds[f"{name}-sm_90"] for name in CU_FILES] + [builds["bindings.cpp"]]
    if any(result.returncode != 0 for result, _ in objects):
        pytest.skip("an object failed to compile (reported above)")
    called = set().union(*(symbols(obj, "--undefined-only") for _, obj in objects))
    defined = set().union(*(symbols(obj, "--defined-only") for _, obj in objects))
    assert "_ZN10pagedserve22paged_attention_decodeERKNS_10DecodeArgsENS_5DTypeEP11CUstream_st" in called
    assert called <= defined, f"called but defined nowhere: {sorted(called - defined)}"


def test_extension_sources_are_complete() -> None:
    """kernels.build compiles every .cu file in csrc, and the bindings."""
    assert sorted(SOURCES) == sorted([*CU_FILES, "bindings.cpp"])


def test_python_head_sizes_match_the_compiled_ones() -> None:
    """kernels.DECODE_HEAD_SIZES routes exactly the head sizes the decode kernel is compiled for."""
    source = (CSRC / "paged_attention.h").read_text()
    match = re.search(r"#define PAGEDSERVE_FOR_EACH_HEAD_SIZE\(X\)((?: X\(\d+\))+)", source)
    assert match, "the head-size list moved"
    assert tuple(int(n) for n in re.findall(r"\d+", match.group(1))) == DECODE_HEAD_SIZES
