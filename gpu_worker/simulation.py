"""Simulated workers: the real worker service (inbox, heartbeats, reservations, publishing, failover) around
an engine whose model is replaced by a step-time model, with no weights. Many run in one process, so that the
control plane (gateways, schedulers, Redis) can be tested and measured at scales no model runs at here.

The engine is the real one (block allocator, step scheduler, sampler); only the forward pass is simulated: a
step takes `fixed + per_token x batched tokens` seconds, and the token at each position is a function of the
prompt's first token and the position alone, so a request resumed on another worker goes on identically.

`python -m gpu_worker.simulation --workers 100` runs them (settings from the environment, as a worker's).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from gpu_worker.engine.config import EngineConfig
from gpu_worker.engine.llm_engine import LLMEngine
from gpu_worker.engine.step_scheduler import StepSchedule
from gpu_worker.service import WorkerService
from gpu_worker.settings import WorkerSettings, engine_config

VOCAB_SIZE = 4096
MAX_MODEL_LEN = 8192
DEFAULT_NUM_BLOCKS = 4096


@dataclass(frozen=True, slots=True)
class StepTime:
    """How long a simulated step takes: fixed_s, plus per_token_s for every token it computes."""

    fixed_s: float = 0.010
    per_token_s: float = 0.0001

    def of(self, num_tokens: int) -> float:
        return self.fixed_s + self.per_token_s * num_tokens


class SimulatedRunner:
    """Waits out the step's time and returns logits that make one token certain at each position. It has no
    tokenizer and no end-of-sequence token: requests end at max_tokens (or a stop token id)."""

    device = torch.device("cpu")
    dtype = torch.float32
    tokenizer = None

    def __init__(self, step_time: StepTime, config: EngineConfig, vocab_size: int = VOCAB_SIZE) -> None:
        self.step_time = step_time
        self.vocab_size = vocab_size
        self.num_blocks = config.num_kv_blocks or DEFAULT_NUM_BLOCKS
        self.max_model_len = config.max_model_len or MAX_MODEL_LEN
        self.eos_token_ids: set[int] = set()

    def run(self, out: StepSchedule, sample_rows: list[int]) -> torch.Tensor:
        time.sleep(self.step_time.of(out.num_batched_tokens))
        num_prompt_rows = sum(count for _, _, count in out.prompt_logit_spans)
        num_rows = sum(1 + out.num_draft_tokens[i] for i in sample_rows)
        logits = torch.zeros(num_rows + num_prompt_rows, self.vocab_size)
        row = 0
        for i in sample_rows:
            seq = out.seqs[i]
            for position in range(seq.num_tokens, seq.num_tokens + 1 + out.num_draft_tokens[i]):
                logits[row, next_token(seq.token_ids[0], position, self.vocab_size)] = 30.0
                row += 1
        return logits


def next_token(first_prompt_token: int, position: int, vocab_size: int = VOCAB_SIZE) -> int:
    """The simulated model's token at a position (the prompt is tokens [0, position))."""
    return (first_prompt_token * 31 + position * 7919) % vocab_size


def simulated_engine(config: EngineConfig, step_time: StepTime, *, vocab_size: int = VOCAB_SIZE) -> LLMEngine:
    """The engine with a step-time model for a model: real scheduling, blocks and sampling, no weights."""
    return LLMEngine(config=config, runner=SimulatedRunner(step_time, config, vocab_size))


class SimulatedWorkers:
    """count worker services in this process, one thread each, named `<prefix>-<i>`."""

    def __init__(self, settings: WorkerSettings, count: int, step_time: StepTime, name_prefix: str) -> None:
        self.services = [
            WorkerService(
                settings.model_copy(update={"worker_id": f"{name_prefix}-{i}"}),
                engine=simulated_engine(engine_config(settings), step_time),
            )
            for i in range(count)
        ]
        self._threads = [
            threading.Thread(target=service.serve, name=service.worker_id, daemon=True)
            for service in self.services
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        for service in self.services:
            service.stop()
        for thread in self._threads:
            thread.join(timeout=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_worker.simulation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=10, help="simulated workers in this process")
    parser.add_argument("--step-ms", type=float, default=10.0, help="fixed time of a step")
    parser.add_argument("--per-token-us", type=float, default=100.0, help="time per batched token")
    parser.add_argument("--name", default="sim", help="worker ids are <name>-<i>")
    args = parser.parse_args(argv)
    settings = WorkerSettings.model_validate({})  # from the environment
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    step_time = StepTime(args.step_ms / 1000, args.per_token_us / 1e6)
    workers = SimulatedWorkers(settings, args.workers, step_time, args.name)
    stopped = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        stopped.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    workers.start()
    stopped.wait()
    workers.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
