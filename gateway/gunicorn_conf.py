"""gunicorn's configuration for the gateway, read from GatewaySettings (the environment).

gevent workers: every stream is a greenlet waiting on Redis, so one process holds many of them, and
the worker's liveness ping runs in its own greenlet (a long stream never trips `timeout`). gunicorn
patches the standard library before it imports the app, so redis-py's sockets and waits yield to other
greenlets. The app is not preloaded for the same reason: the master imports nothing but this file.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from gunicorn import util

from gateway.settings import GatewaySettings

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # the name prometheus_client reads

_settings = GatewaySettings.model_validate({})

bind = f"{_settings.host}:{_settings.port}"
workers = _settings.gateway_workers
worker_class = "gevent"
worker_connections = 1000
timeout = 60
graceful_timeout = 30  # a stream still running after this is cut when a worker stops
keepalive = 5
preload_app = False
loglevel = _settings.log_level.lower()
accesslog = "-"
errorlog = "-"
proc_name = "pagedserve-gateway"
# The control socket sits at one path per user: several gateways on a host would contend for it.
control_socket_disable = True

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Each worker process writes its metric samples under this folder; a scrape of any worker sums them.
# It must be set before any worker imports prometheus_client, so here, in the master.
if not os.environ.get(MULTIPROC_ENV):
    os.environ[MULTIPROC_ENV] = tempfile.mkdtemp(prefix="pagedserve-gateway-metrics-")


def _write_error(sock: Any, status_int: int, reason: str, mesg: str) -> None:
    """gunicorn answers what it cannot parse (request line or headers past its limits, a malformed request)
    before the app sees it, in HTML; the gateway's clients get OpenAI-format JSON instead."""
    from gateway.errors import raw_error_response  # in a worker, where the app has imported it already

    util.write_nonblock(sock, raw_error_response(status_int, mesg))


# NOTE: gunicorn's workers look the function up on the module at each error; they are forked from this
# process, so they all inherit the replacement.
util.write_error = _write_error


def on_starting(server: Any) -> None:
    # Samples left by an earlier run would be added to this one's.
    folder = os.environ[MULTIPROC_ENV]
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder, exist_ok=True)


def child_exit(server: Any, worker: Any) -> None:
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)
