"""The KV bytes between hosts: Mooncake's transfer engine, writing a record one-sidedly into a node's ring.

Why Mooncake and not NIXL (the closing note of issue 22 has the measurement): its CPU-only wheel
(`mooncake-transfer-engine-non-cuda`, the `remote` extra) installs from the package registry with
nothing but Debian's libibverbs1, needs no metadata server in its P2PHANDSHAKE mode, and the same
calls run over TCP here and over RDMA where the hosts have NICs for it (protocol "rdma" and the
device's name, e.g. "mlx5_0"); NIXL's wheels are CUDA builds.

What a peer of the transfer engine can reach, and why each record's room is registered alone (tcp). Mooncake's
TCP transport takes, from whoever connects to its data port, a header naming an address and a length, and reads or
writes there; 0.3.13.post1 refuses an address outside the memory registered with the engine ("remote-supplied
address ... is not within any registered buffer", measured) but authenticates nobody, and its two ports (the P2P
handshake's and the data port, each picked at random in 15000-17000, MC_MIN_RPC_PORT..MC_MAX_RPC_PORT) listen on
every interface whatever MC_TCP_BIND_ADDRESS says (measured with ss). So over tcp:

* the node registers only the room of the record being written (remote/node.py, Room): from its ReserveKV to the
  Submit that says the write is over, then takes it back before it checks the record's MAC (remote/wire.py). A
  register and unregister cost 1.6 us together here, a 1 MiB write over loopback 760 us: the cost is nothing, and
  the rest of the ring (other requests' records, the header page) is out of every peer's reach;
* the front registers nothing: a TCP write's source needs no registration, so nothing of the front's can be read
  or written through its engine's port.

Over rdma the whole records' area of each ring is registered once, at the start: registering memory with a NIC pins
and maps it (costly per record) and the peer writes with a key from the registration it fetched at the start.

What is left is the window of the record in flight, writable by anyone who reaches the node's data port while it
is open; the MAC catches what they write before the Submit, not a write they start inside the window and hold
open past it. Hence the firewall rule in docs/operations.md ("Ports to open"): the node's ports
15000-17000 open to its front(s) alone, the front's to its nodes alone.
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
        # asked of its TCP transport; 0.3.13.post1 listens on every interface all the same (above)
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
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

    @property
    def windowed(self) -> bool:
        """Each record's memory is registered for its own transfer only (tcp); rdma registers the ring once."""
        return self.protocol == "tcp"

    def unregister(self, address: int) -> None:
        rc = self._engine.unregister_memory(address)
        if rc != 0:
            log.warning("the transfer engine could not unregister the memory at %#x (code %d)", address, rc)

    def write(self, peer: str, local: int, remote: int, length: int) -> None:
        """Copy `length` bytes at `local` here to `remote` in `peer`'s registered memory; blocks until done."""
        rc = self._engine.transfer_sync_write(peer, local, remote, length)
        if rc != 0:
            raise TransferFailed(f"writing {length} bytes to {peer} failed (code {rc})")
