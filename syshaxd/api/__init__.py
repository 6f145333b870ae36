"""The daemon's HTTP side: the OpenAI-compatible API and health."""
