"""Addresses of decode nodes: "host:port", IPv6 in brackets."""

from __future__ import annotations

ALL_INTERFACES = frozenset({"0.0.0.0", "::", "*"})


def split_address(address: str, key: str) -> tuple[str, int]:
    """("host", port) from "host:port"; ValueError naming the config `key` when it is not one."""
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f'{key}: expected "host:port", e.g. "10.0.0.2:7070"; got {address!r}')
    return host, int(port)
