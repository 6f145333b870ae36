"""The KV bytes between hosts: Mooncake's transfer engine, writing a record one-sidedly into a node's ring.

Why Mooncake and not NIXL (the closing note of issue 22 has the measurement): its CPU-only wheel
(`mooncake-transfer-engine-non-cuda`, the `remote` extra) installs from the package registry with
nothing but Debian's libibverbs1, needs no metadata server in its P2PHANDSHAKE mode, and the same
calls run over TCP here and over RDMA where the hosts have NICs for it (protocol "rdma" and the
device's name, e.g. "mlx5_0"); NIXL's wheels are CUDA builds.

Each side registers its ring's whole mapping once; a transfer names a local address in the front's
ring, a remote one in the node's, and a length. Mooncake's TCP transport authenticates nobody:
the node binds it to the address the front reaches it at, and every record it receives is checked
(checksum against the one the front sent over the authenticated control channel, model fingerprint)
before a decoder imports it.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os

from syshaxd.config import TRANSFER_PROTOCOLS as PROTOCOLS

log = logging.getLogger(__name__)


class TransferUnavailable(RuntimeError):
    """The transfer engine cannot run here; the message says what to install."""


class TransferFailed(RuntimeError):
    """One write did not complete; the request's decoder recomputes the prompt instead."""


def mapping_address(mm: mmap.mmap) -> int:
    """The address of an mmap's first byte in this process (what the transfer engine registers)."""
    holder = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(holder)
    finally:
        del holder  # the buffer export ends here, so the mmap can still be closed


class TransferEngine:
    """One process's transfer engine: initialize once with this host's address, register memory, write."""

    def __init__(self, host: str, protocol: str = "tcp", device: str = "") -> None:
        if protocol not in PROTOCOLS:
            raise TransferUnavailable(f"node_transfer_protocol: must be one of {', '.join(PROTOCOLS)}; got {protocol!r}")
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake's own log: errors only (it says much at start)
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)  # its TCP transport listens where we do, not everywhere
        try:
            from mooncake.engine import TransferEngine as Mooncake
        except ImportError as exc:
            raise TransferUnavailable(
                f"the Mooncake transfer engine is not installed ({exc}): pip install 'syshax[remote]' "
                "(and Debian's libibverbs1, which it loads)") from None
        self.host = host
        self.protocol = protocol
        self._engine = Mooncake()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise TransferUnavailable(f"the transfer engine did not start on {host} over {protocol} (code {rc}); "
                                      "check that the address is this host's and, for rdma, the device name")
        self.session = f"{host}:{self._engine.get_rpc_port()}"
        log.info("transfer engine: %s over %s", self.session, protocol)

    def register(self, address: int, length: int) -> None:
        rc = self._engine.register_memory(address, length)
        if rc != 0:
            raise TransferUnavailable(f"the transfer engine could not register {length} bytes at {address:#x} "
                                      f"(code {rc})")

    def write(self, peer: str, local: int, remote: int, length: int) -> None:
        """Copy `length` bytes at `local` here to `remote` in `peer`'s registered memory; blocks until done."""
        rc = self._engine.transfer_sync_write(peer, local, remote, length)
        if rc != 0:
            raise TransferFailed(f"writing {length} bytes to {peer} failed (code {rc})")
