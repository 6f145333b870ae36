"""The control channel between a front daemon and a decode node: framed, typed messages over TCP, after a
mutual challenge-response on a shared secret.

The KV bytes never travel here: the transfer engine (remote/transfer.py) writes them into the node's
ring one-sidedly, and this channel says where they are. What does travel here is the worker protocol
the daemon already speaks to its local workers (sdk/types.py: Submit, Cancel and the events back),
wrapped in the messages below.

Frames are a 4-byte big-endian length, a pickle, and a 16-byte tag: HMAC-SHA256 over the frame's direction, its
sequence number and its bytes, keyed from the secret and both sides' challenges (a Session). So a frame is read
only from the peer that proved the secret on this very connection, in order and once: one who relays the two
proofs between a front and a node learns no key and can add, change or replay nothing. Pickle runs code on
load, so a frame is unpickled only after its tag checks, and then by an unpickler that builds only the message
classes of ALLOWED_MODULES: a frame naming anything else is refused and the connection closed. The channel is
not encrypted: prompts' token ids cross it in the clear.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import io
import os
import pickle
import struct
from dataclasses import dataclass, field
from pathlib import Path

from syshaxd.sdk.types import EngineStats

MAX_FRAME = 64 << 20  # a Submit carries at most one request (its prompt tokens): far below this
CHALLENGE_BYTES = 32
PROTOCOL = b"syshax-node/1"
_HEADER = struct.Struct("!I")


class WireError(Exception):
    """The peer sent something this end does not accept (a bad frame, a type it may not send)."""


class AuthFailed(WireError):
    """The peer does not hold the shared secret (or speaks another protocol)."""


# --- the messages -----------------------------------------------------------------------------


@dataclass(frozen=True)
class DecoderState:
    """One of the node's decode workers, as the front shows it."""

    name: str
    state: str
    in_flight: int
    max_batch_size: int
    threads: int
    cpus: tuple[int, ...] = ()
    error: str = ""
    stats: EngineStats = EngineStats()
    attention: str = ""  # llama.cpp: "tiled" or "llama.cpp" (its own)
    exact_decode: bool = False  # its warm-up proved that a decode step gives a prompt chunk's bits


@dataclass(frozen=True)
class NodeHello:
    """The node's first message after the handshake: what it serves and where its ring lies."""

    node: str  # its listen address, as it names itself in logs
    backend: str
    model_name: str
    fingerprint: bytes  # the model's (sdk/gguf): the front refuses a node that serves another model
    transfer_session: str  # host:port of the node's transfer engine
    ring_address: int  # the ring's mapping in the node's address space, as registered with the transfer engine
    ring_capacity: int
    decoders: tuple[DecoderState, ...] = ()
    # its config's tiled_attention: a front refuses a node whose decoders would sum attention another way than its
    # own prefill worker, as their tokens would part from one host's
    tiled_attention: bool = True


@dataclass(frozen=True)
class NodeStatus:
    """Sent every HEARTBEAT seconds: the node's decoders. Silence longer than the link timeout is a dead link."""

    decoders: tuple[DecoderState, ...]
    ring_used: int = 0
    # the requests this front may run on the node's decoders at once (its share, node_front_slots); 0: all of them.
    # Past it the node queues the front's requests until one of its own ends.
    front_slots: int = 0
    fronts: int = 1  # fronts the node serves now


@dataclass(frozen=True)
class FrontHello:
    """The front's first message, after the node's hello: who it is. A node serves several fronts at once, each on
    its own connection; the same front connecting again (its link was lost) replaces its own earlier session."""

    front_id: str


@dataclass(frozen=True)
class FrontPing:
    """Sent by the front every HEARTBEAT seconds: a node drops a front silent longer than its link timeout (and
    cancels that front's requests alone)."""


@dataclass(frozen=True)
class ReserveKV:
    """The front asks for room for a record of `length` bytes in the node's ring."""

    request_id: str
    length: int


@dataclass(frozen=True)
class KVReserved:
    request_id: str
    offset: int = -1
    seq: int = 0
    address: int = 0  # where the payload goes, in the node's address space
    error: str = ""  # not reserved (ring full): the node decodes the request from its prompt


@dataclass(frozen=True)
class AbortKV:
    """The front will not fill a reservation (its transfer failed, or the request is gone)."""

    request_id: str


@dataclass(frozen=True)
class ToNode:
    """A worker message (Submit or Cancel) for the node's decoders; the node picks the decoder."""

    message: object


@dataclass(frozen=True)
class FromNode:
    """Events of the node's decoders (Accepted, Delta, Imported, Rejected, WorkerLost), in order."""

    events: tuple = field(default_factory=tuple)


# --- what a frame may hold --------------------------------------------------------------------

ALLOWED_MODULES = ("syshaxd.sdk.types", "syshaxd.remote.wire")
_BUILTINS = frozenset({"tuple", "list", "dict", "set", "frozenset", "bytes", "bytearray", "str", "int", "float",
                       "bool", "complex", "NoneType", "slice", "range"})


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "builtins" and name in _BUILTINS:
            return super().find_class(module, name)
        # a dotted name would reach through the module's own imports ("os.system"): only its own classes
        if module in ALLOWED_MODULES and "." not in name and not name.startswith("_"):
            found = super().find_class(module, name)
            if isinstance(found, type) and found.__module__ == module:
                return found
        raise WireError(f"the peer sent a {module}.{name}, which this channel does not carry")


def dumps(message) -> bytes:
    """The message's pickle; WireError when it is over the frame limit."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) > MAX_FRAME:
        raise WireError(f"a {type(message).__name__} of {len(data)} bytes is over the {MAX_FRAME}-byte frame limit")
    return data


def loads(data: bytes):
    try:
        return _Unpickler(io.BytesIO(data)).load()
    except WireError:
        raise
    except Exception as exc:  # truncated, or not a pickle at all
        raise WireError(f"not a message: {type(exc).__name__}: {exc}") from None


TAG_BYTES = 16


class Session:
    """One authenticated connection's framing: each frame sealed with its direction and sequence number."""

    def __init__(self, key: bytes, sending: bytes, receiving: bytes) -> None:
        self._key = key
        self._sending, self._receiving = sending, receiving
        self._sent = self._received = 0

    def _tag(self, direction: bytes, seq: int, data: bytes) -> bytes:
        mac = hmac.new(self._key, direction + seq.to_bytes(8, "big"), hashlib.sha256)
        mac.update(data)
        return mac.digest()[:TAG_BYTES]

    def frame(self, message) -> bytes:
        data = dumps(message)
        tag = self._tag(self._sending, self._sent, data)
        self._sent += 1
        return _HEADER.pack(len(data)) + data + tag

    async def read(self, reader: asyncio.StreamReader):
        """The next whole message; IncompleteReadError at the end of the stream, WireError on a bad frame."""
        (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
        if size > MAX_FRAME:
            raise WireError(f"a frame of {size} bytes is over the {MAX_FRAME}-byte limit")
        data = await reader.readexactly(size)
        tag = await reader.readexactly(TAG_BYTES)
        if not hmac.compare_digest(tag, self._tag(self._receiving, self._received, data)):
            raise WireError("a frame failed its check: it is not from the peer that proved the secret on this "
                            "connection (or came out of order)")
        self._received += 1
        return loads(data)

    async def send(self, writer: asyncio.StreamWriter, message) -> None:
        writer.write(self.frame(message))
        await writer.drain()


def _session_key(secret: bytes, node_challenge: bytes, front_challenge: bytes) -> bytes:
    return hmac.new(secret, PROTOCOL + b"|session|" + node_challenge + front_challenge, hashlib.sha256).digest()


# --- the handshake ----------------------------------------------------------------------------


def read_secret(path: str) -> bytes:
    """The shared secret from its file (surrounding whitespace dropped); OSError or ValueError say what is wrong."""
    if not path:
        raise ValueError("node_secret_file is not set: the front and its nodes need a shared secret "
                         "(e.g. `openssl rand -hex 32 > /etc/syshax/node.secret; chmod 600 /etc/syshax/node.secret`)")
    secret = Path(os.path.expandvars(path)).expanduser().read_bytes().strip()
    if len(secret) < 16:
        raise ValueError(f"node_secret_file {path}: the secret is {len(secret)} bytes; use at least 16 "
                         "(e.g. `openssl rand -hex 32`)")
    return secret


def _proof(secret: bytes, role: bytes, challenge: bytes) -> bytes:
    return hmac.new(secret, PROTOCOL + b"|" + role + b"|" + challenge, hashlib.sha256).digest()


async def _exchange(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(_HEADER.pack(len(data)) + data)
    await writer.drain()


async def _raw(reader: asyncio.StreamReader, want: int) -> bytes:
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size != want:
        raise AuthFailed(f"the peer's handshake message has {size} bytes, not {want} (another protocol?)")
    return await reader.readexactly(size)


async def prove_as_node(reader, writer, secret: bytes) -> Session:
    """The node's side: challenge the front, check its proof, prove itself; AuthFailed when the front fails."""
    challenge = os.urandom(CHALLENGE_BYTES)
    await _exchange(writer, challenge)
    answer = await _raw(reader, 32 + CHALLENGE_BYTES)
    if not hmac.compare_digest(answer[:32], _proof(secret, b"front", challenge)):
        raise AuthFailed("the front's proof does not match this node's secret")
    await _exchange(writer, _proof(secret, b"node", answer[32:]))
    return Session(_session_key(secret, challenge, answer[32:]), b"node>front", b"front>node")


async def prove_as_front(reader, writer, secret: bytes) -> Session:
    """The front's side: answer the node's challenge, challenge it back; AuthFailed when the node fails."""
    challenge = await _raw(reader, CHALLENGE_BYTES)
    mine = os.urandom(CHALLENGE_BYTES)
    await _exchange(writer, _proof(secret, b"front", challenge) + mine)
    try:
        answer = await _raw(reader, 32)
    except asyncio.IncompleteReadError:
        raise AuthFailed("the node closed the connection: it refused this front's secret") from None
    if not hmac.compare_digest(answer, _proof(secret, b"node", mine)):
        raise AuthFailed("the node's proof does not match this front's secret")
    return Session(_session_key(secret, challenge, mine), b"front>node", b"node>front")

