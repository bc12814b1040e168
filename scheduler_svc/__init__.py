"""The scheduler service: admits queued requests to workers by free KV blocks; re-queues dead ones' work."""
