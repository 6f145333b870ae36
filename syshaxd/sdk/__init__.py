"""The plugin SDK: what a backend plugin stands on, and all that it may import of syshax.

* `hookspecs`, `backend`, `plugins`: the hook a plugin implements, the Backend it declares (roles,
  device, capabilities), and how the daemon and each worker find them;
* `types`: the typed messages between the daemon and a worker, and the Engine protocol;
* `output`, `rate`, `prompt_fit`: the output rules (stop strings, lengths), tokens/s, whether a prompt fits;
* `worker`, `faults`: the worker process's loop (where a plugin's engine runs), its fault injection for tests;
* `placement`: where a worker runs, applied in the worker before its engine loads;
* `kv`: the KV record format, the shared-memory ring and the prefix cache's block store;
* `gguf`, `hf_model`: the model files an engine loads (the GGUF, its quantized copy, the HF folder).

The serving side (`syshaxd.engine`, `syshaxd.api`, the daemon) stands on this package; nothing here
imports it, and nothing here is the daemon's alone (tests/structure/test_imports.py checks both): the daemon's end of
a worker's pipe is `engine/channel.py`, the NUMA planning `engine/numa.py`, the model to serve `model.py`.
"""
