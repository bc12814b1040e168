"""The worker: paged KV pool, copy-on-write block allocator, continuous batching, and the offline API."""

from gpu_worker.beam_search import BeamSearchParams
from gpu_worker.config import EngineConfig
from gpu_worker.engine import EngineStats, LLMEngine
from gpu_worker.llm import LLM, BeamSearchOutput, BeamSearchSequence, CompletionOutput, RequestOutput
from gpu_worker.sampling_params import SamplingParams

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
