"""What the services share: the wire protocol, the Redis key names, configuration. Never imports torch."""
