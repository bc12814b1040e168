"""Transparent huge pages for the CPU engine's large, hot memory: the KV pool and the packed weights.

A 4 KiB page covers 64 cache lines. A decode step streams every weight once and reads K and V from blocks
anywhere in the pool, so with 4 KiB pages nearly every page it touches misses the TLB, and the hardware
prefetchers, which stop at a page's end, start over every 64 lines. 2 MiB pages take both away
(docs/kernels.md). PAGEDSERVE_HUGE_PAGES=0 in the environment asks for neither (to measure the difference;
where Linux's own setting is "always", it gives huge pages anyway).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

MADV_HUGEPAGE = 14  # Linux's madvise advice: back this range with huge pages where they are enabled
MADV_COLLAPSE = 25  # Linux 6.1+: replace this range's pages by huge pages now
HUGE_PAGE = 2 << 20


def _enabled() -> bool:
    return sys.platform.startswith("linux") and os.environ.get("PAGEDSERVE_HUGE_PAGES", "1") != "0"


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Asks Linux to back `tensor`'s whole 2 MiB pages with transparent huge pages (where they are enabled, on
    "always" or "madvise"); whether the advice was taken. Only pages not yet touched are affected."""
    if not _enabled() or tensor.device.type != "cpu":
        return False
    start = (tensor.data_ptr() + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // HUGE_PAGE * HUGE_PAGE
    if end <= start:
        return False
    return _libc().madvise(start, end - start, MADV_HUGEPAGE) == 0


def _private_anonymous_mappings() -> list[tuple[int, int]]:
    """[start, end) of this process's private, writable, anonymous mappings (the heap's included)."""
    spans = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        path = fields[5] if len(fields) > 5 else ""
        if fields[1].startswith("rw") and fields[1][3] == "p" and path in ("", "[heap]"):
            low, high = (int(part, 16) for part in fields[0].split("-"))
            spans.append((low, high))
    return spans


def collapse_into_huge_pages(ranges: Iterable[tuple[int, int]]) -> int:
    """Moves the memory of the given (address, bytes) ranges, already written, into transparent huge pages
    now (madvise MADV_COLLAPSE): each 2 MiB page that overlaps a range and lies within one private anonymous
    mapping, with whatever else it holds. Returns the bytes now in huge pages: 0 off Linux, with
    PAGEDSERVE_HUGE_PAGES=0, or where the kernel (before 6.1) or its settings refuse. The contents do not
    change; up to a huge page's worth of memory past a range's ends, if unused, becomes resident."""
    if not _enabled():
        return 0
    pages: set[int] = set()  # numbered by their start's address over HUGE_PAGE
    for address, size in ranges:
        pages.update(range(address // HUGE_PAGE, (address + size - 1) // HUGE_PAGE + 1))
    spans = _private_anonymous_mappings()
    libc = _libc()
    done = 0
    for page in sorted(pages):
        start = page * HUGE_PAGE
        if not any(low <= start and start + HUGE_PAGE <= high for low, high in spans):
            continue
        libc.madvise(start, HUGE_PAGE, MADV_HUGEPAGE)  # keeps it huge if Linux splits and merges it again
        if libc.madvise(start, HUGE_PAGE, MADV_COLLAPSE) == 0:
            done += HUGE_PAGE
        elif ctypes.get_errno() in (errno.EINVAL, errno.EPERM):  # no MADV_COLLAPSE here, or THP off
            break
    return done
