"""What every backend serving a GGUF shares: its header and fingerprint, vocabulary, chat template and quantization."""
