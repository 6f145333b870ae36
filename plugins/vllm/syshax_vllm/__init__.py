"""syshax's vLLM backend: gpu-mode generation and prefill with a KV connector into the ring (built-in plugin)."""
