"""The plugin SDK: what a backend plugin stands on, and all that it may import of syshax.

* `hookspecs`, `backend`, `plugins`: the hook a plugin implements, the Backend it declares (roles,
  device, capabilities), and how the daemon and each worker find them;
* `types`: the typed messages between the daemon and a worker, and the Engine protocol;
* `output`, `rate`, `admission`: the output rules (stop strings, lengths), tokens/s, whether a prompt fits;
* `worker`, `channel`, `faults`: the worker process's loop, its pipe, its fault injection for tests;
* `kv`: the KV record format, the shared-memory ring and the prefix cache's block store;
* `gguf`, `model`, `hf_model`, `numa`: the model files an engine loads, and where its worker runs.

The serving side (`syshaxd.engine`, `syshaxd.api`, the daemon) stands on this package; nothing here
imports it.
"""
