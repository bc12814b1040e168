"""The batch workers (`python -m gateway.batch`): Celery workers that run the Batch API's batches line by line
through the request layer (gateway.serving), with no HTTP stack; and the batch CLI (`python -m
gateway.batch.cli`), a client of the API."""
