"""The OpenAI-compatible REST gateway: Flask under gunicorn, streaming over SSE (not built yet)."""
