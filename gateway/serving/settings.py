"""What the clients of the requests stream share, read from the environment: the HTTP process and the batch
workers (their own settings add to these)."""

from __future__ import annotations

from pydantic import Field

from shared.settings import CommonSettings, ServedModelSettings


class ClientSettings(CommonSettings, ServedModelSettings):
    """What the gateway and the batch workers (gateway.batch) share."""

    extra_models: str = Field(
        "",
        description="more models to serve, as comma-separated name=model pairs (model: a folder or .gguf "
        "file; empty: the default model); each is run by workers with SERVED_MODEL_NAME=name",
    )
    request_timeout_s: float = Field(600.0, description="give up on a request after this long")
    no_worker_grace_s: float = Field(
        5.0, description="a request in flight with no live worker for this long ends with 503 no_worker"
    )
    redis_outage_grace_s: float = Field(
        30.0, description="a request in flight fails (queue_unavailable) when Redis stays away this long"
    )
    max_model_len: int | None = Field(
        None, description="longest prompt + output in tokens (default and cap: the model's context)"
    )
    batch_storage_dir: str = Field(
        "~/.local/share/pagedserve/files",
        description="folder of the Batch API's files, shared by the gateway and the batch workers",
    )
    batch_visibility_timeout_s: float = Field(
        300.0, description="a batch task whose Celery worker died runs again after this long"
    )
    batch_retention_s: int = Field(30 * 86400, description="a batch is listed for this long after it ends")


def model_sources(settings: ClientSettings) -> list[tuple[str, str | None]]:
    """(name, model) of every model to serve, the first one first; ValueError for a malformed list."""
    sources = [(settings.served_model_name, settings.model)]
    for item in (part.strip() for part in settings.extra_models.split(",")):
        if not item:
            continue
        name, sep, model = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"EXTRA_MODELS: '{item}' is not name=model")
        sources.append((name.strip(), model.strip() or None))
    names = [name for name, _ in sources]
    if len(set(names)) != len(names):
        raise ValueError(f"EXTRA_MODELS: a model is named twice in {names}")
    return sources


def with_tokenizer_folders(settings: ClientSettings) -> None:
    """Point MODEL and EXTRA_MODELS at folders holding each tokenizer (a GGUF file's is extracted once, then
    cached), so that the processes that serve only load folders."""
    from shared.model_files import tokenizer_folder

    sources = model_sources(settings)
    settings.model = tokenizer_folder(settings.model)
    settings.extra_models = ",".join(f"{name}={tokenizer_folder(model)}" for name, model in sources[1:])
