"""`python -m shared.drain`: ask the process of this container to drain, and wait until it has stopped.

A Kubernetes preStop hook (deploy/k8s): the process named by STATUS_FILE gets SIGTERM. A worker then takes no
new requests, finishes those it holds for up to DRAIN_TIMEOUT_S and hands the rest to other workers. This
command returns when the process has stopped (its status file is gone) or DRAIN_TIMEOUT_S plus a margin has
passed. Exit status: 0 stopped, 1 still running, 2 nothing to drain. It imports no torch: it starts at once.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Sequence

from shared.health import StatusFile
from shared.settings import DrainSettings, parse_settings

# Beyond the drain: the worker's last flush and the removal of its heartbeat.
MARGIN_S = 10.0
POLL_S = 0.5


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(DrainSettings, argv, prog="shared.drain")
    if not settings.status_file:
        print("shared.drain: STATUS_FILE is not set", file=sys.stderr)
        return 2
    status_file = StatusFile(settings.status_file)
    status = status_file.read()
    if status is None:
        print(f"shared.drain: no status in {settings.status_file}", file=sys.stderr)
        return 2
    try:
        os.kill(status.pid, signal.SIGTERM)
    except ProcessLookupError:
        return 0
    wait_s = settings.drain_timeout_s + MARGIN_S
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        current = status_file.read()
        if current is None or current.pid != status.pid or not _running(status.pid):
            print(f"shared.drain: {status.service} {status.id} stopped")
            return 0
        time.sleep(POLL_S)
    print(f"shared.drain: {status.service} {status.id} still running after {wait_s:.0f}s")
    return 1


if __name__ == "__main__":
    sys.exit(main())
