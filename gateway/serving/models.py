"""The models one gateway serves: each a name (the API's model id, and the SERVED_MODEL_NAME of the workers
that run it) with its tokenizer and a watch on its workers.

The first is SERVED_MODEL_NAME with MODEL; EXTRA_MODELS adds more as comma-separated `name=model` pairs
(model: a folder or a .gguf file; empty for the default model). A request names its model in `model` (none:
the first); the scheduler keeps a queue per model and sends each request only to workers of its model.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from gateway.serving.errors import APIError
from gateway.serving.settings import ClientSettings, model_sources
from gateway.serving.tokenization import Tokenizer, load_tokenizer
from gateway.serving.worker_watch import WorkerWatch
from shared.errors import ErrorCode
from shared.protocol import GenerateRequest
from shared.registry import WorkerRegistry


@dataclass(frozen=True, slots=True)
class ServedModel:
    name: str
    tokenizer: Tokenizer
    watch: WorkerWatch


class ServedModels:
    """The served models by name; the first is what a request that names none gets."""

    def __init__(self, settings: ClientSettings, registry: WorkerRegistry) -> None:
        limit = settings.max_model_len
        self._models = {
            name: ServedModel(name, load_tokenizer(model, limit), WorkerWatch(registry, name))
            for name, model in model_sources(settings)
        }
        self.default = next(iter(self._models.values()))

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self._models.values())

    def names(self) -> list[str]:
        return list(self._models)

    def get(self, requested: str | None) -> ServedModel:
        """The model a request names (None: the first); 404 model_not_found for one not served here."""
        if requested is None:
            return self.default
        model = self._models.get(requested)
        if model is None:
            served = ", ".join(f"'{name}'" for name in self._models)
            raise APIError(
                ErrorCode.MODEL_NOT_FOUND,
                f"the model '{requested}' does not exist; this server serves {served}",
                param="model",
            )
        return model

    def of(self, request: GenerateRequest) -> ServedModel:
        """The model a request was prepared for (a request of no model, from an older gateway: the first)."""
        return self._models.get(request.model, self.default)
