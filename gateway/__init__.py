"""The OpenAI-compatible REST gateway: Flask under gunicorn, tokenization, stop strings, SSE streaming."""
