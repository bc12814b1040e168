"""The Batch API: OpenAI's files and batches on the gateway (api), run by Celery batch workers (worker).

A batch's lines go into the same requests stream as interactive traffic, at a lower priority; the batch
workers are clients of that stream as the gateway is, and share its request preparation and response shapes.
"""
