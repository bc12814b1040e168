"""Container health checks: `python -m shared.health scheduler|worker` exits 0 when the service is live.

A worker counts as live when a heartbeat of a worker on this host (its id starts with the host name) exists;
the scheduler when its stats hash is fresh. Settings come from the environment, as for the services.
"""

from __future__ import annotations

import socket
import sys

import redis

from shared.settings import CommonSettings, parse_settings


def scheduler_live(client: redis.Redis, settings: CommonSettings) -> bool:
    return bool(client.exists(settings.keys.scheduler_stats))


def worker_live(client: redis.Redis, settings: CommonSettings) -> bool:
    host = socket.gethostname()
    members = [m.decode() for m in client.smembers(settings.keys.workers)]  # type: ignore[union-attr]
    return any(client.exists(settings.keys.worker(w)) for w in members if w.startswith(host))


def main(argv: list[str]) -> int:
    checks = {"scheduler": scheduler_live, "worker": worker_live}
    if len(argv) != 1 or argv[0] not in checks:
        print("usage: python -m shared.health scheduler|worker", file=sys.stderr)
        return 2
    settings = parse_settings(CommonSettings, [])
    client = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=3)
    try:
        return 0 if checks[argv[0]](client, settings) else 1
    except redis.RedisError as e:
        print(f"redis: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
