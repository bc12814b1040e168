"""The scheduler service: admits queued requests against the free KV blocks of each worker (not built yet)."""
