"""Container health checks: `python -m shared.health scheduler|worker` exits 0 when the service is live.

A worker counts as live when a heartbeat of a worker on this host (its id starts with the host name) exists;
the scheduler when its stats are fresh. Settings come from the environment, as for the services.
"""

from __future__ import annotations

import socket
import sys

import redis

from shared.redis_client import connect
from shared.registry import WorkerRegistry
from shared.settings import CommonSettings, parse_settings

CHECK_TIMEOUT_S = 3.0


def scheduler_live(registry: WorkerRegistry) -> bool:
    return registry.scheduler_stats() is not None


def worker_live(registry: WorkerRegistry) -> bool:
    host = socket.gethostname()
    return any(wid.startswith(host) for wid in registry.live_worker_ids())


def main(argv: list[str]) -> int:
    checks = {"scheduler": scheduler_live, "worker": worker_live}
    if len(argv) != 1 or argv[0] not in checks:
        print("usage: python -m shared.health scheduler|worker", file=sys.stderr)
        return 2
    settings = parse_settings(CommonSettings, [])
    timeout = CHECK_TIMEOUT_S
    client = connect(settings.redis_url, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        return 0 if checks[argv[0]](WorkerRegistry(client, settings.keys)) else 1
    except redis.RedisError as e:
        print(f"redis: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
