"""One request's part in the gateway's metrics: its latencies as tokens arrive, its figures at the end."""

from __future__ import annotations

import time

from gateway import metrics
from gateway.serving.token_receiver import SampleTokens
from shared.protocol import GenerateRequest, RequestTimings


class RequestMetrics:
    """Observes one request that was submitted here (a re-read stream's latencies are not the request's)."""

    def __init__(self, model_name: str, arrived: float, num_samples: int) -> None:
        self._labels = {"model_name": model_name}
        self._arrived = arrived
        self._first_token_seen = False
        self._last_token_at: list[float | None] = [None] * num_samples
        self._timings: list[RequestTimings] = []  # of the samples that ended, as their workers measured them

    def tokens(self, tokens: SampleTokens) -> None:
        """New tokens of a sample: time to first token, and the gaps between a sample's tokens."""
        if tokens.timings is not None:
            self._timings.append(tokens.timings)
        if not tokens.token_ids:
            return
        labels = self._labels
        if not self._first_token_seen:
            self._first_token_seen = True
            metrics.TIME_TO_FIRST_TOKEN.labels(**labels).observe(tokens.arrived_at - self._arrived)
        last = self._last_token_at[tokens.index]
        if last is not None:
            metrics.INTER_TOKEN_LATENCY.labels(**labels).observe(tokens.arrived_at - last)
            metrics.TIME_PER_OUTPUT_TOKEN.labels(**labels).observe(tokens.arrived_at - last)
        self._last_token_at[tokens.index] = tokens.arrived_at

    def finished(self, request: GenerateRequest, finish_reasons: list[str], num_output_tokens: int) -> None:
        """The request ended here, every sample with its finish reason."""
        labels = self._labels
        metrics.E2E_REQUEST_LATENCY.labels(**labels).observe(time.monotonic() - self._arrived)
        for reason in finish_reasons:
            metrics.REQUEST_SUCCESS.labels(finished_reason=reason, **labels).inc()
        sampling = request.sampling
        metrics.REQUEST_PROMPT_TOKENS.labels(**labels).observe(len(request.prompt_token_ids))
        metrics.REQUEST_GENERATION_TOKENS.labels(**labels).observe(num_output_tokens)
        metrics.REQUEST_PARAMS_N.labels(**labels).observe(sampling.n)
        if sampling.max_tokens is not None:
            metrics.REQUEST_PARAMS_MAX_TOKENS.labels(**labels).observe(sampling.max_tokens)
        if self._timings:  # (none when every sample ended on a stop string before its worker's end came)
            # The samples share their prompt's prefill; the request decodes until its last sample ends.
            prefill = min(t.prefill_s for t in self._timings)
            decode = max(t.decode_s for t in self._timings)
            metrics.REQUEST_PREFILL_TIME.labels(**labels).observe(prefill)
            metrics.REQUEST_DECODE_TIME.labels(**labels).observe(decode)
            metrics.REQUEST_INFERENCE_TIME.labels(**labels).observe(prefill + decode)
