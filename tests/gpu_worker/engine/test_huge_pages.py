"""Transparent huge pages under the packed weights."""

from __future__ import annotations

import ctypes
import json
import mmap
import subprocess
import sys
import tempfile

import pytest
import torch
from torch import nn

from gpu_worker.engine.huge_pages import HUGE_PAGE, collapse_into_huge_pages
from gpu_worker.engine.packed_linear import packing_supported, weights_into_huge_pages
from tests.support import REPO

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's"
)


# Run in a fresh interpreter: in a long test process the weight can land in the brk heap beside memory that
# earlier tests left behind, whose huge pages Linux may split again before smaps is read (seen once in a whole
# `make test`, never alone).
COLLAPSE_A_PACKED_WEIGHT = """
import json, torch
from torch import nn
from gpu_worker.engine.huge_pages import HUGE_PAGE
from gpu_worker.engine.packed_linear import PackedLinear, weights_into_huge_pages
from tests.support.memory_maps import huge_bytes_of_mapping
torch.manual_seed(0)
packed = PackedLinear(nn.Linear(1024, 4096))  # 16 MiB of float32 weights
x = torch.randn(3, 1024)
before = packed(x)
done = weights_into_huge_pages(nn.Sequential(packed))
middle = int(torch.ops.mkldnn.data_ptr(packed.weight)) + 8 * (1 << 20)
huge = huge_bytes_of_mapping(middle)
print(json.dumps({"done": done, "huge": huge, "same": torch.equal(packed(x), before)}))
"""


@pytest.mark.skipif(not packing_supported(torch.float32), reason="no oneDNN packing here")
def test_packed_weights_move_into_huge_pages_and_keep_their_values() -> None:
    ran = subprocess.run(
        [sys.executable, "-c", COLLAPSE_A_PACKED_WEIGHT],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    seen = json.loads(ran.stdout.strip().splitlines()[-1])
    if seen["done"] == 0:
        pytest.skip("Linux here does not collapse memory into huge pages (MADV_COLLAPSE: 6.1+, THP on)")
    assert seen["done"] >= 7 * HUGE_PAGE  # 16 MiB spans at least 7 whole 2 MiB pages, all of them anonymous
    assert seen["huge"] >= 6 * HUGE_PAGE
    assert seen["same"]


def test_a_files_mapping_is_left_alone() -> None:
    with tempfile.TemporaryFile() as f:
        f.truncate(4 * HUGE_PAGE)
        mapped = mmap.mmap(f.fileno(), 4 * HUGE_PAGE)
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        assert collapse_into_huge_pages([(address, 4 * HUGE_PAGE)]) == 0
        mapped.close()


def test_nothing_to_move_moves_nothing() -> None:
    assert collapse_into_huge_pages([]) == 0
    assert weights_into_huge_pages(nn.Linear(4, 4)) == 0
