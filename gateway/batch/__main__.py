"""`python -m gateway.batch`: a batch worker (Celery); `--help` lists every setting and its variable."""

from __future__ import annotations

import os
import socket

from gateway.batch.settings import BatchSettings
from gateway.serving.settings import with_tokenizer_folders
from shared.batches import BATCH_QUEUE
from shared.settings import parse_settings


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(BatchSettings, argv, prog="gateway.batch")
    # A GGUF model's tokenizer is extracted (once, cached) before the worker loads it.
    with_tokenizer_folders(settings)
    # The task module reads its settings from the environment (as `celery -A gateway.batch.worker` does).
    for name, value in settings.model_dump().items():
        if value is not None:
            os.environ[name.upper()] = str(value)
    from gateway.batch.worker import app, runner

    runner()  # the tokenizer, loaded before the first batch arrives
    app.worker_main(
        [
            "worker",
            "--pool=threads",
            f"--concurrency={settings.batch_concurrency}",
            f"--queues={BATCH_QUEUE}",
            f"--hostname=batch-{os.getpid()}@{socket.gethostname()}",
            f"--loglevel={settings.log_level}",
            "--without-gossip",
            "--without-mingle",
        ]
    )


if __name__ == "__main__":
    main()
