"""Decode nodes on other hosts: the node daemon, the front's view of it, their control channel and KV transfer."""
