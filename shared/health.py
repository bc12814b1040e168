"""Container health checks: `python -m shared.health scheduler|worker [--live]` exits 0 when the check passes.

    --live   the process is alive: its status file was written within LIVE_WINDOW_S (no Redis involved, so
             that a Redis outage never gets a service restarted); a liveness and a startup probe
    (none)   the process serves: live, and for a worker, its heartbeat is in Redis; for the scheduler, its
             stats are fresh; a readiness probe, and compose's health check

A service with STATUS_FILE set writes its status there (StatusFile) about once a second from a thread of its
own, once it has started (a worker: once its model is loaded). Without a status file, a worker counts as
serving when a heartbeat of a worker on this host (its id starts with the host name) exists. Settings come
from the environment, as for the services.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import redis

from shared.redis_client import connect
from shared.registry import WorkerRegistry
from shared.settings import CommonSettings, StatusSettings, parse_settings

CHECK_TIMEOUT_S = 3.0
STATUS_INTERVAL_S = 1.0
# A status older than this is a process that stopped running: ten times the interval it is written at.
LIVE_WINDOW_S = 10.0


@dataclass(frozen=True, slots=True)
class Status:
    """What a service's status file says: who wrote it, in what state (serving, draining), and when."""

    service: str
    id: str
    pid: int
    state: str
    time: float


class StatusFile:
    """One service's status file; written whole (a rename), so a reader never sees half of it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def write(self, status: Status) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".status-")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(asdict(status), f)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def read(self) -> Status | None:
        try:
            return Status(**json.loads(self.path.read_text()))
        except (OSError, ValueError, TypeError):
            return None


class StatusReporter:
    """Writes a service's status every STATUS_INTERVAL_S on a daemon thread, while `alive()` says the process
    runs (a worker whose step hangs stops being live); `state()` names what it is doing. With no path (no
    STATUS_FILE) it does nothing."""

    def __init__(
        self,
        path: str,
        service: str,
        service_id: str,
        state: Callable[[], str],
        alive: Callable[[], bool] = lambda: True,
    ) -> None:
        self._file = StatusFile(path) if path else None
        self._service, self._id = service, service_id
        self._state, self._alive = state, alive
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{service}-status", daemon=True)

    def start(self) -> StatusReporter:
        if self._file is not None:
            self.report()
            self._thread.start()
        return self

    def report(self) -> None:
        if self._file is not None and self._alive():
            status = Status(self._service, self._id, os.getpid(), self._state(), time.time())
            try:
                self._file.write(status)
            except OSError as e:  # a full disk fails the liveness check, not the service
                print(f"status file {self._file.path}: {e}", file=sys.stderr)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.path.unlink()

    def _run(self) -> None:
        while not self._stop.wait(STATUS_INTERVAL_S):
            self.report()


def is_live(status: Status | None, service: str, now: float | None = None) -> bool:
    if status is None or status.service != service:
        return False
    return (now if now is not None else time.time()) - status.time <= LIVE_WINDOW_S


def scheduler_serves(registry: WorkerRegistry, status: Status | None) -> bool:
    return registry.scheduler_stats() is not None


def worker_serves(registry: WorkerRegistry, status: Status | None) -> bool:
    live = registry.live_worker_ids()
    if status is not None:
        return status.id in live
    host = socket.gethostname()
    return any(wid.startswith(host) for wid in live)


class HealthSettings(CommonSettings, StatusSettings):
    """What a health check reads: the services' settings, with the status file."""


def main(argv: list[str]) -> int:
    checks = {"scheduler": scheduler_serves, "worker": worker_serves}
    live_only = "--live" in argv
    names = [a for a in argv if a != "--live"]
    if len(names) != 1 or names[0] not in checks:
        print("usage: python -m shared.health scheduler|worker [--live]", file=sys.stderr)
        return 2
    service = names[0]
    settings = parse_settings(HealthSettings, [])
    status = StatusFile(settings.status_file).read() if settings.status_file else None
    if settings.status_file and not is_live(status, service):
        print(f"{service}: no fresh status in {settings.status_file}", file=sys.stderr)
        return 1
    if live_only:
        if not settings.status_file:
            print("--live needs STATUS_FILE", file=sys.stderr)
            return 2
        return 0
    timeout = CHECK_TIMEOUT_S
    client = connect(settings.redis_url, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        return 0 if checks[service](WorkerRegistry(client, settings.keys), status) else 1
    except redis.RedisError as e:
        print(f"redis: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
