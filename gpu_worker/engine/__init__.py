"""The paged engine as a library (no Redis): the KV pool, the copy-on-write block allocator, the step
scheduler (continuous batching), the sampler, beam search, structured outputs, the model runner and the
offline API (`LLM`)."""

from gpu_worker.engine.beam_search import BeamSearchParams
from gpu_worker.engine.config import EngineConfig
from gpu_worker.engine.llm import LLM, BeamSearchOutput, BeamSearchSequence, CompletionOutput, RequestOutput
from gpu_worker.engine.llm_engine import EngineStats, LLMEngine
from gpu_worker.engine.sampling_params import SamplingParams

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
