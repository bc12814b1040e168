"""The worker service (`python -m gpu_worker`): one process per accelerator, fed from its Redis inbox,
publishing tokens after every step. The engine it runs is the library in gpu_worker.engine, whose offline API
is re-exported here: `from gpu_worker import LLM, SamplingParams`."""

from gpu_worker.engine import (
    LLM,
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
    CompletionOutput,
    EngineConfig,
    EngineStats,
    LLMEngine,
    RequestOutput,
    SamplingParams,
)

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]
