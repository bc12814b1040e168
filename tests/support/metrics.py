"""The metric names vLLM's own metrics test expects of a server."""

from __future__ import annotations

# The names vLLM's own metrics test (tests/entrypoints/openai/test_metrics.py) looks for in a scrape.
VLLM_NAMES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:gpu_cache_usage_perc",
    "vllm:gpu_prefix_cache_queries",
    "vllm:gpu_prefix_cache_hits",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:iteration_tokens_total",
    "vllm:cache_config_info",
    "vllm:request_success_total",
    *(
        f"vllm:{name}_{suffix}"
        for name in (
            "request_prompt_tokens",
            "request_generation_tokens",
            "request_params_n",
            "request_params_max_tokens",
            "time_per_output_token_seconds",
            "time_to_first_token_seconds",
            "inter_token_latency_seconds",
            "e2e_request_latency_seconds",
            "request_queue_time_seconds",
            "request_inference_time_seconds",
            "request_prefill_time_seconds",
            "request_decode_time_seconds",
        )
        for suffix in ("sum", "bucket", "count")
    ),
]
