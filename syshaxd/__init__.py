"""syshax: a heterogeneous LLM inference runtime (prefill on an accelerator, decode on CPUs)."""

__version__ = "0.1.0"
