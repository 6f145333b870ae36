"""syshax's torch backend: transformers prefill on cuda, npu or cpu, handing KV to the CPU decoders (built-in plugin)."""
