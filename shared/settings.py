"""What every service's settings share, and how they are read from the environment and the command line.

Each service has one typed settings object (gateway.settings, scheduler_svc.settings, gpu_worker.settings),
a subclass of CommonSettings. Every field is an environment variable of the same name in capitals
(`redis_url` ← `REDIS_URL`); each service's `--help` lists them, and a flag (`--redis-url`) overrides the
variable for one run.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TypeVar

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.keys import Keys
from shared.redis_client import is_sentinel_url, parse_sentinel_url


class CommonSettings(BaseSettings):
    """What every service needs: where Redis is, the key prefix, the model."""

    model_config = SettingsConfigDict(extra="ignore", case_sensitive=False, protected_namespaces=())

    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis the services talk through: redis://HOST:PORT/DB, or a master under Sentinel: "
        "redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER_NAME[/DB]",
    )
    redis_prefix: str = Field("pagedserve", description="prefix of every Redis key")
    model: str | None = Field(None, description="model folder or .gguf file (default: SmolLM2-135M-Instruct)")
    heartbeat_ttl_s: float = Field(5.0, description="a worker whose heartbeat is older than this is dead")
    request_ttl_s: int = Field(3600, description="lifetime of a request's token record and abort flag")
    log_level: str = Field("INFO", description="logging level")

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, url: str) -> str:
        if is_sentinel_url(url):
            parse_sentinel_url(url)  # a malformed one says what is wrong at start-up
        return url

    @property
    def keys(self) -> Keys:
        return Keys(self.redis_prefix)


DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ServedModelSettings(BaseSettings):
    """The name a model is served under: the API's model id, and the model a worker takes requests for."""

    model_config = SettingsConfigDict(extra="ignore", case_sensitive=False, protected_namespaces=())

    served_model_name: str = Field(
        DEFAULT_MODEL_NAME, description="model id in the API; a worker takes only the requests for it"
    )


class StatusSettings(BaseSettings):
    """A long-running process that health checks look at (the scheduler, a worker)."""

    model_config = SettingsConfigDict(extra="ignore", case_sensitive=False, protected_namespaces=())

    status_file: str = Field(
        "", description="file the process writes its status to every second, for `python -m shared.health`"
    )


class DrainSettings(StatusSettings):
    """A process that drains on SIGTERM (a worker), and `python -m shared.drain`, which waits for it."""

    drain_timeout_s: float = Field(
        30.0,
        description="on SIGTERM, seconds to finish the requests held (taking no new ones) before the rest "
        "are handed to other workers; 0: hand them over at once",
    )


S = TypeVar("S", bound=BaseSettings)


def parse_settings(cls: type[S], argv: Sequence[str] | None = None, prog: str | None = None) -> S:
    """Settings from the environment, overridden by command-line flags; `--help` lists every name."""
    parser = argparse.ArgumentParser(
        prog=prog, description=cls.__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    for name, field in cls.model_fields.items():
        default = None if field.default_factory is not None else field.default
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            default=argparse.SUPPRESS,
            help=f"{field.description} [env {name.upper()}, default {default}]",
        )
    overrides = vars(parser.parse_args(argv))
    return cls(**overrides)
