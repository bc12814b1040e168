"""`python -m gpu_worker`: one worker process (settings from the environment; --help lists them)."""

from __future__ import annotations

import logging

from gpu_worker.service import WorkerService
from gpu_worker.settings import WorkerSettings
from shared.settings import parse_settings


def main() -> None:
    settings = parse_settings(WorkerSettings, prog="gpu_worker")
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    WorkerService(settings).run()


if __name__ == "__main__":
    main()
