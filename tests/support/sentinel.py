"""A Redis primary, its replica and three Sentinels on loopback, as real processes whose pids are all tracked:
for tests of a real failover."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import redis

from tests.support.cluster import free_port

MASTER_NAME = "pagedserve"
DOWN_AFTER_MS = 1000
QUORUM = 2


class SentinelRedis:
    """Primary, replica, three Sentinels (quorum 2, down-after 1 s). `url()` is the services' REDIS_URL."""

    def __init__(self, workdir: Path) -> None:
        self._workdir = workdir
        self._binary = shutil.which("redis-server") or ""
        if not self._binary:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ports: dict[str, int] = {}

    # -- start and stop ----------------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> SentinelRedis:
        primary, replica = free_port(), free_port()
        self._redis("primary", primary)
        self._redis("replica", replica, "--replicaof", "127.0.0.1", str(primary))
        self._wait(
            lambda: "master_link_status:up" in self._info("replica", "replication"), timeout, "replica"
        )
        # failover-timeout 2 s: a Sentinel starts no second failover of a master within twice that, and the
        # tests fail over one after another.
        for n in range(3):
            port = free_port()
            conf = self._workdir / f"sentinel-{n}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self._workdir}\n"
                f"sentinel monitor {MASTER_NAME} 127.0.0.1 {primary} {QUORUM}\n"
                f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {MASTER_NAME} 2000\n"
                f"sentinel parallel-syncs {MASTER_NAME} 1\n"
            )
            self._spawn(f"sentinel-{n}", port, [str(conf), "--sentinel"])
        # A failover needs every Sentinel to know the replica and the others (found through the master).
        self._wait(self._sentinels_agree, timeout, "sentinels")
        return self

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)  # a frozen one must be able to die
                proc.kill()
        for proc in self.procs.values():
            proc.wait(timeout=10)

    def _redis(self, name: str, port: int, *args: str) -> None:
        self._spawn(
            name,
            port,
            ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
            + ["--repl-diskless-sync", "yes"]
            + ["--repl-diskless-sync-delay", "0", "--dir", str(self._workdir), *args],
        )

    def _spawn(self, name: str, port: int, args: list[str]) -> None:
        log = open(self._workdir / f"{name}.log", "wb")  # noqa: SIM115  (kept open for the process's life)
        self.procs[name] = subprocess.Popen([self._binary, *args], stdout=log, stderr=log)
        self.ports[name] = port
        self._wait(lambda: self.client(name).ping(), 10, name)

    # -- reading -----------------------------------------------------------------------------------------

    def url(self, db: int = 0) -> str:
        sentinels = ",".join(f"127.0.0.1:{self.ports[f'sentinel-{n}']}" for n in range(3))
        return f"redis+sentinel://{sentinels}/{MASTER_NAME}/{db}"

    def client(self, name: str) -> redis.Redis:
        return redis.Redis(
            port=self.ports[name], socket_connect_timeout=1, socket_timeout=2, decode_responses=True
        )

    def master_port(self) -> int:
        """The master's port, as a live Sentinel says."""
        for n in range(3):
            try:
                reply: Any = self.client(f"sentinel-{n}").sentinel_get_master_addr_by_name(MASTER_NAME)
                _, port = reply
                return int(port)
            except redis.RedisError:
                continue
        raise RuntimeError("no Sentinel answered")

    def name_of(self, port: int) -> str:
        return next(name for name, p in self.ports.items() if p == port)

    def _info(self, name: str, section: str) -> str:
        """INFO's section as Redis writes it (`field:value` lines)."""
        info = self.client(name).info(section)
        return "\n".join(f"{k}:{v}" for k, v in info.items())

    def _sentinels_agree(self) -> bool:
        """Every Sentinel knows the master, one replica in sync that is not down, and the other two."""
        for n in range(3):
            sentinel = self.client(f"sentinel-{n}")
            master: Any = sentinel.sentinel_master(MASTER_NAME)
            replicas = [
                r
                for r in sentinel.sentinel_slaves(MASTER_NAME)
                if not r.get("is_sdown") and not r.get("is_odown") and r.get("master-link-status") == "ok"
            ]
            if not replicas or int(master["num-other-sentinels"]) < 2:
                return False
        return True

    @staticmethod
    def _wait(check, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if check():
                    return
            except redis.RedisError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"{what} not ready within {timeout:.0f} s")

    # -- faults ------------------------------------------------------------------------------------------

    def kill_master(self) -> str:
        """kill -9 of the current master; its name."""
        name = self.name_of(self.master_port())
        self.procs[name].kill()
        self.procs[name].wait(timeout=10)
        return name

    def restore(self, name: str, timeout: float = 30.0) -> None:
        """Start the killed server again, as a replica of the current master, once in sync and known to every
        Sentinel: back to a primary with one replica."""
        master = self.master_port()
        self._redis(name, self.ports[name], "--replicaof", "127.0.0.1", str(master))
        self._wait(lambda: "master_link_status:up" in self._info(name, "replication"), timeout, name)
        self._wait(self._sentinels_agree, timeout, "sentinels")

    def signal(self, name: str, signum: int) -> None:
        os.kill(self.procs[name].pid, signum)

    def wait_for_new_master(self, old_port: int, timeout: float = 30.0) -> float:
        """Seconds until the Sentinels name a master other than old_port (and it answers as one)."""
        start = time.monotonic()

        def switched() -> bool:
            port = self.master_port()
            return port != old_port and "role:master" in self._info(self.name_of(port), "replication")

        self._wait(switched, timeout, "the failover")
        return time.monotonic() - start

    def wait_role(self, name: str, role: str, timeout: float = 30.0) -> None:
        self._wait(lambda: f"role:{role}" in self._info(name, "replication"), timeout, f"{name} as {role}")
