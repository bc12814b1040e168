"""The worker: paged KV pool, copy-on-write block allocator, continuous batching, and the offline API."""

from gpu_worker.config import EngineConfig
from gpu_worker.engine import EngineStats, LLMEngine
from gpu_worker.llm import LLM, CompletionOutput, RequestOutput
from gpu_worker.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]
