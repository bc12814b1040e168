"""The worker service (`python -m gpu_worker`): one process per accelerator, fed from its Redis inbox,
publishing tokens after every step. The engine it runs is the library in gpu_worker.engine, whose offline API
is re-exported here: `from gpu_worker import LLM, SamplingParams`."""

from gpu_worker.engine import *  # noqa: F403 - the offline API, exactly as the engine exports it
from gpu_worker.engine import __all__ as __all__
