"""`python -m gateway`: the gateway under gunicorn; `--help` lists every setting and its variable."""

from __future__ import annotations

import os
import sys

from gateway.serving.settings import with_tokenizer_folders
from gateway.settings import GatewaySettings
from shared.settings import parse_settings

APP = "gateway.app:create_app()"
CONFIG = "python:gateway.gunicorn_conf"


def gunicorn_argv() -> list[str]:
    return [sys.executable, "-m", "gunicorn", "--config", CONFIG, APP]


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(GatewaySettings, argv, prog="gateway")
    # A GGUF model's tokenizer is extracted (once, cached) here, so gunicorn's workers only load a folder.
    with_tokenizer_folders(settings)
    # gunicorn's config and its worker processes read the settings from the environment: hand the
    # flags over that way. exec, so the master is a fresh interpreter that has imported nothing else.
    for name, value in settings.model_dump().items():
        if value is not None:
            os.environ[name.upper()] = str(value)
    args = gunicorn_argv()
    os.execv(args[0], args)


if __name__ == "__main__":
    main()
