"""KV-cache transport: the shared-memory ring, the neutral KV record, and engine codecs."""
