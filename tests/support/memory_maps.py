"""This process's memory mappings as Linux reports them (/proc/self/smaps), for the huge-page tests."""

from __future__ import annotations

import re
from pathlib import Path


def mapping_field(address: int, field: str) -> str | None:
    """The value of `field` (e.g. "VmFlags", "AnonHugePages") in the smaps entry of the mapping holding
    `address`, or None where no mapping holds it."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(" ", 1)[0]
        if re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", head):
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif inside and line.startswith(f"{field}:"):
            return line.split(":", 1)[1].strip()
    return None


def huge_bytes_of_mapping(address: int) -> int:
    """AnonHugePages of the mapping holding `address`, in bytes."""
    value = mapping_field(address, "AnonHugePages")  # "2048 kB"
    return int(value.split()[0]) * 1024 if value else 0
