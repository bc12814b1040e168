"""The request layer, a library with no Flask: an OpenAI request body checked, tokenized and queued as a
cluster request (prepare), its tokens received in order (token_receiver, event_hub) and turned into text
(output) and OpenAI's response objects (responses). The HTTP process (gateway) and the batch workers
(gateway.batch) both run requests through it; it also holds the Batch API's records, files and queue, which
both sides use."""
