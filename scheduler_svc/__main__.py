"""`python -m scheduler_svc`: the scheduler service (settings from the environment; `--help` lists them)."""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Sequence
from types import FrameType

from scheduler_svc.service import SchedulerService
from scheduler_svc.settings import SchedulerSettings
from shared.settings import parse_settings

log = logging.getLogger("scheduler_svc")


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(SchedulerSettings, argv, prog="scheduler")
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    service = SchedulerService(settings)

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        # Only a flag: the loop finishes its step (at most one poll interval) and returns.
        log.info("received %s, stopping", signal.Signals(signum).name)
        service.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    service.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
