"""syshax's llama.cpp backend: q4_0 CPU engine with continuous batching (built-in plugin)."""
