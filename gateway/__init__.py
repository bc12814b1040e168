"""The REST gateway (`python -m gateway`): OpenAI's API over HTTP, Flask under gunicorn, SSE, auth, errors as
HTTP responses and /metrics. The request layer it runs requests through is gateway.serving; the batch workers
that run the Batch API's batches are gateway.batch."""
