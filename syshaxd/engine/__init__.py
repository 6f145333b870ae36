"""The serving side's engine room: what the daemon does with its engines, above the SDK.

* `scheduler` (with `decider`, `prefix_routing`, `estimates`; the rules it applies are the config's,
  `syshaxd/routing_rules.py`): which route and which engine a
  request gets, within the daemon's capacity (the one meaning of "admit": taken in by the scheduler);
* `capabilities`: the one check of what a request asks of the engines on its way;
* `journey` and `attempts`: one request's state machine across the engines, and its submissions;
* `supervisor` (WorkerHandle), `channel`, `engine_handle`: the worker processes, their pipes, and the protocol
  the scheduler holds every engine by (a local worker or a decode node on another host), with the stream an
  attempt's events arrive on;
* `kv_ledger`, `prefix_cache`: the one owner of the KV records and the prefix cache's blocks; `prefix_disk`: the
  prefix cache's disk tier (block files that outlive evictions and restarts); `prefix_warm`: `syshax cache warm`;
* `prompts`: each prompt tokenized once; `plan`, `numa`: which workers to start and where;
* `status`, `exactness`: what the daemon reports of itself, and which exact promises hold.

The worker process's own loop and the messages between it and the daemon are the SDK's (`syshaxd.sdk`).
"""
