"""The paged KV pool's host memory."""

from __future__ import annotations

import ctypes
import mmap
import sys

import pytest
import torch

from gpu_worker.engine.huge_pages import HUGE_PAGE, advise_huge_pages
from gpu_worker.engine.kv_cache import KVCache
from tests.support.memory_maps import mapping_field


def huge_page_advised(address: int) -> bool:
    """Whether the mapping holding `address` carries madvise(MADV_HUGEPAGE): "hg" in its VmFlags."""
    return "hg" in (mapping_field(address, "VmFlags") or "").split()


def test_the_pool_starts_as_zeros_in_every_layer() -> None:
    cache = KVCache(2, 64, 16, 3, 64, torch.float32, torch.device("cpu"))
    assert cache.kv_cache.shape == (2, 2, 64, 16, 3, 64)
    assert not cache.kv_cache.any()
    k, v = cache.layers[1]
    assert k.data_ptr() == cache.kv_cache[1, 0].data_ptr() and v.shape == (64, 16, 3, 64)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_the_pool_asks_for_huge_pages_before_it_is_touched() -> None:
    # The negative control: a mapping of its own, never advised. (A large torch.empty is no such control: the
    # allocator may hand back heap memory that an earlier pool in this process had advised.)
    fresh = mmap.mmap(-1, 4 * HUGE_PAGE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(fresh))
    assert not huge_page_advised(address + HUGE_PAGE)
    fresh.close()
    plain = torch.empty(100, dtype=torch.float32)
    assert not advise_huge_pages(plain)  # no whole 2 MiB page inside: nothing to ask
    cache = KVCache(1, 2048, 16, 4, 64, torch.float32, torch.device("cpu"))  # 64 MiB of K and V
    assert huge_page_advised(cache.kv_cache.data_ptr() + HUGE_PAGE)
    assert not cache.kv_cache.any()
