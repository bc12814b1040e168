"""Building the kernels: a build that was killed midway does not hang the processes that come after it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils.cpp_extension import _get_build_directory

from kernels.build import CPU_CSRC, cpu_flags, extension_name
from tests.support import REPO


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler for the CPU kernel")
def test_the_lock_file_of_a_killed_build_does_not_hang_the_next_load() -> None:
    folder = Path(
        _get_build_directory(extension_name(cpu_flags(), CPU_CSRC, "pagedserve_cpu_kernels"), False)
    )
    stale = folder / "lock"
    stale.touch()  # what torch's builder leaves behind when it is killed before it finishes
    try:
        # Without the fix the load waits for the lock's owner, which is gone, forever.
        subprocess.run(
            [sys.executable, "-c", "from kernels.build import build_cpu; print(build_cpu())"],
            cwd=REPO,
            check=True,
            timeout=300,
            capture_output=True,
        )
    finally:
        leftover = stale.exists()
        stale.unlink(missing_ok=True)
    assert not leftover
