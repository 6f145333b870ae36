"""The control channel between a front daemon and a decode node: framed, typed messages over TCP, after a
mutual challenge-response on a shared secret.

The KV bytes never travel here: the transfer engine (remote/transfer.py) writes them into the node's
ring one-sidedly, and this channel says where they are. What does travel here is the worker protocol
the daemon already speaks to its local workers (sdk/types.py: Submit, Cancel and the events back),
wrapped in the messages below.

Frames are a 4-byte big-endian length, a msgpack body, and a 16-byte tag: HMAC-SHA256 over the frame's direction,
its sequence number and its bytes, keyed from the secret and both sides' challenges (a Session). So a frame is read
only from the peer that proved the secret on this very connection, in order and once: one who relays the two
proofs between a front and a node learns no key and can add, change or replay nothing. A body is decoded (msgspec)
only after its tag checks, and only into the types of FRONT_MESSAGES and NODE_MESSAGES, each field checked against
its declared type and a size (MAX_NAME, MAX_TEXT, MAX_ITEMS, MAX_TOKEN, MAX_BYTES): nothing runs on load, and no
field asks for more memory than its bytes in the frame (a container's declared length is checked against the bytes
left). A frame that fails is refused with what was wrong, and its connection closed. The handshake names the
protocol (syshax-node/3), so a peer of another version is told so.

The channel is encrypted only with TLS configured (node_tls_cert, node_tls_key, node_tls_ca: tls_context); without
it prompts' token ids and the generated text cross in the clear, authenticated but readable. With it the handshake
and framing above run inside TLS 1.3, both sides' certificates checked against the CA.

A KV record's integrity rests on its MAC (record_mac): keyed BLAKE2b, its key derived from this connection's
session key, over the record's bytes, its request id and the node's reservation (offset and the ring's sequence
number). The node checks it before a decoder may read the record, so bytes that reach the node's ring from anyone
but this front, or a record replayed for another request or twice, are refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import hashlib
import hmac
import os
import ssl
import struct
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin, get_type_hints

import msgspec

from syshaxd.sdk.types import (
    Accepted,
    Cancel,
    Delta,
    EngineStats,
    GenerateRequest,
    Handling,
    Imported,
    KVHandle,
    Prefilled,
    PrefixPlan,
    Rejected,
    SamplingParams,
    Submit,
    TokenLogprob,
    WorkerLost,
)

MAX_FRAME = 16 << 20  # a Submit carries one request: 2**20 prompt tokens take at most 5 MiB
CHALLENGE_BYTES = 32
PROTOCOL = b"syshax-node/3"  # /2: requests carried default_max_tokens; /1: pickled frames
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
    length: Annotated[int, msgspec.Meta(gt=0)]


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
    """A request for the node's decoders (the node picks the decoder). With a KV record (submit.handling.kv), the
    record's MAC (record_mac), which the node checks before its decoder may read the record. A Cancel crosses as
    itself."""

    submit: Submit
    record_mac: bytes = b""


@dataclass(frozen=True)
class FromNode:
    """Events of the node's decoders (Accepted, Delta, Imported, Rejected, WorkerLost), in order."""

    events: tuple[Accepted | Prefilled | Imported | Rejected | Delta | WorkerLost, ...] = field(default_factory=tuple)


# --- what a frame may hold --------------------------------------------------------------------
#
# Every message is a dataclass: the worker protocol's in sdk/types.py, the node's own above. Each is the one
# source of its shape: the Struct msgspec decodes a frame into is derived from it field by field (_mirror), with
# the sizes below added, and turned back into the dataclass once it checks. A frame is msgpack
# [type name, fields]; FromNode's events are [type name, fields] each.

MAX_NAME = 256  # request ids, front ids, worker and model names
MAX_TEXT = 1 << 20  # any other string (a Delta's text, a grammar, an error message), in characters
MAX_ITEMS = 1 << 20  # a tuple's length: a prompt's tokens (no context is longer), a Delta's tokens, a status's decoders
MAX_TOKEN = 1 << 31  # token ids (and CPU numbers) are 0 <= id < this: an engine indexes its vocabulary with them
MAX_BYTES = 4096  # a bytes field (a fingerprint, a MAC)
_NAMED = frozenset({"request_id", "front_id", "name", "node", "model_name", "backend", "state", "transfer_session"})

Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
Token = Annotated[int, msgspec.Meta(ge=0, lt=MAX_TOKEN)]
Blob = Annotated[bytes, msgspec.Meta(max_length=MAX_BYTES)]
Count = Annotated[int, msgspec.Meta(ge=0)]


def _wire_type(hint, name: str):
    """The type msgspec checks a field of this Python type against; TypeError for a type that cannot cross."""
    if get_origin(hint) is Annotated:
        return hint  # a wire message's own bound
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _mirror(hint)
    if hint is str:
        return Name if name in _NAMED else Text
    if hint is bytes:
        return Blob
    if hint in (int, float, bool, dict) or (isinstance(hint, type) and issubclass(hint, Enum)):
        return hint  # ints are 64-bit in msgpack; dicts (a request's tools) are bounded by the frame alone
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, UnionType):
        if str in args:  # Fallback | str: a Fallback is its value on the wire (turned back by _builder)
            args = tuple(a for a in args if not (isinstance(a, type) and issubclass(a, Enum)))
        return Union[tuple(_wire_type(a, name) for a in args)]
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = Token if args[0] is int else _wire_type(args[0], name)
        # types built at run time from the dataclasses' hints: beyond what a static checker follows
        return Annotated[tuple[item, ...], msgspec.Meta(max_length=MAX_ITEMS)]  # type: ignore[valid-type]
    if origin is tuple:
        return tuple[tuple(_wire_type(a, name) for a in args)]  # type: ignore[misc]
    if hint is type(None):
        return hint
    raise TypeError(f"field {name} of type {hint} cannot cross the wire")


_MIRRORS: dict[type, type] = {}


def _mirror(cls: type) -> type:
    """The Struct a frame's fields for dataclass cls are checked against: every field, required, nothing else."""
    if cls not in _MIRRORS:
        hints = get_type_hints(cls, include_extras=True)
        _MIRRORS[cls] = msgspec.defstruct(cls.__name__, [(f.name, _wire_type(hints[f.name], f.name))
                                                         for f in dataclasses.fields(cls)],
                                          forbid_unknown_fields=True, module=__name__)
    return _MIRRORS[cls]


def _builder(hint):
    """What turns a decoded value of this type back into the Python one; None where it is already that."""
    if get_origin(hint) is Annotated:
        return None
    if dataclasses.is_dataclass(hint):
        hints = get_type_hints(hint, include_extras=True)
        builders = [_builder(hints[f.name]) for f in dataclasses.fields(hint)]
        cls, astuple = hint, msgspec.structs.astuple  # the mirror's fields are the dataclass's, in its order
        if all(b is None for b in builders):
            return lambda s: cls(*astuple(s))
        converted = [(i, b) for i, b in enumerate(builders) if b is not None]

        def build(s):
            values = list(astuple(s))
            for i, b in converted:
                values[i] = b(values[i])
            return cls(*values)
        return build
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, UnionType):
        enums = [a for a in args if isinstance(a, type) and issubclass(a, Enum)]
        inner = [b for b in (_builder(a) for a in args if a is not type(None) and a not in enums) if b is not None]
        if enums and str in args:  # a Fallback's value back into the Fallback, any other string as it is
            values = {e.value: e for e in enums[0]}
            return lambda v: values.get(v, v)
        if inner:
            (one,) = inner  # a dataclass or None: a union of two dataclasses has no mirror
            return lambda v: None if v is None else one(v)
        return None
    if origin is tuple and args:
        if len(args) == 2 and args[1] is Ellipsis:
            item = _builder(args[0])
            return None if item is None else (lambda v: tuple(item(x) for x in v))
        items = [_builder(a) for a in args]
        if all(b is None for b in items):
            return None
        return lambda v: tuple(x if b is None else b(x) for b, x in zip(items, v))
    return None


def _box(cls: type, fields: list) -> type:
    """A tagged Struct [name, ...]: what lets several message types share one union."""
    return msgspec.defstruct(f"{cls.__name__}Frame", fields, tag=cls.__name__, array_like=True,
                             forbid_unknown_fields=True, module=__name__)


FRONT_MESSAGES = (FrontHello, FrontPing, ReserveKV, AbortKV, ToNode, Cancel)  # what a node reads
NODE_MESSAGES = (NodeHello, NodeStatus, KVReserved, FromNode)  # what a front reads
EVENTS = (Accepted, Prefilled, Imported, Rejected, Delta, WorkerLost)  # what FromNode carries
# every type that crosses, nested ones included: tests/remote/test_wire.py round-trips each
CROSSING = FRONT_MESSAGES + NODE_MESSAGES + EVENTS + (Submit, GenerateRequest, SamplingParams, Handling, KVHandle,
                                                      PrefixPlan, TokenLogprob, DecoderState, EngineStats)

_EVENT_BOXES = {cls: _box(cls, [("value", _mirror(cls))]) for cls in EVENTS}
_BOXES = {cls: _box(cls, [("value", _mirror(cls))]) for cls in FRONT_MESSAGES + NODE_MESSAGES if cls is not FromNode}
_ANY_EVENT: Any = Union[tuple(_EVENT_BOXES.values())]  # built at run time: beyond what a static checker follows
_BOXES[FromNode] = _box(FromNode, [("events", Annotated[tuple[_ANY_EVENT, ...],
                                                        msgspec.Meta(max_length=MAX_ITEMS)])])
_BUILD = {box: _builder(cls) for cls, box in (_BOXES | _EVENT_BOXES).items() if cls is not FromNode}
_NAMES = {cls: cls.__name__ for cls in _BOXES}
_EVENT_NAMES = {cls: cls.__name__ for cls in EVENTS}
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Union[tuple(_BOXES.values())])


def dumps(message) -> bytes:
    """The message's frame body; WireError for a type this channel does not carry, or one over the frame limit."""
    name = _NAMES.get(type(message))
    if name is None:
        raise WireError(f"a {type(message).__name__} does not cross to a node")
    if isinstance(message, FromNode):
        try:
            body = (name, tuple((_EVENT_NAMES[type(e)], e) for e in message.events))
        except KeyError as exc:
            raise WireError(f"a {exc.args[0].__name__} is not an event a node sends") from None
    else:
        body = (name, message)
    data = _ENCODER.encode(body)
    if len(data) > MAX_FRAME:
        raise WireError(f"a {type(message).__name__} of {len(data)} bytes is over the {MAX_FRAME}-byte frame limit")
    return data


def loads(data: bytes):
    """The message a frame body holds, every field checked against its type and size; WireError says what failed."""
    try:
        box = _DECODER.decode(data)
    except msgspec.ValidationError as exc:
        raise WireError(f"a frame's fields are wrong: {exc}") from None
    except msgspec.DecodeError as exc:  # truncated, or not msgpack at all
        raise WireError(f"not a message: {exc}") from None
    try:
        if isinstance(box, _BOXES[FromNode]):
            return FromNode(tuple(_BUILD[type(e)](e.value) for e in box.events))  # type: ignore[attr-defined]
        return _BUILD[type(box)](box.value)
    except (TypeError, ValueError) as exc:  # a dataclass that refuses its values
        raise WireError(f"a frame's fields are wrong: {exc}") from None


TAG_BYTES = 16


class Session:
    """One authenticated connection's framing: each frame sealed with its direction and sequence number."""

    def __init__(self, key: bytes, sending: bytes, receiving: bytes) -> None:
        self._key = key
        # the KV records' MAC key (record_mac): the same on both ends of this connection, and on no other
        self.record_key = hmac.new(key, PROTOCOL + b"|kv-record", hashlib.sha256).digest()
        self._sending, self._receiving = sending, receiving
        self._sent = self._received = 0

    def _tag(self, direction: bytes, seq: int, data: bytes) -> bytes:
        mac = hmac.new(self._key, direction + seq.to_bytes(8, "big"), hashlib.sha256)
        mac.update(data)
        return mac.digest()[:TAG_BYTES]

    def frame(self, message) -> bytes:
        return self.seal(dumps(message))

    def seal(self, data: bytes) -> bytes:
        """A frame of these bytes as they are (frame() seals a message's)."""
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


RECORD_MAC_BYTES = 32
_RECORD_PERSON = b"syshax-kv-record"  # BLAKE2b's personalisation: a record's MAC is no other MAC of this key


def record_mac(key: bytes, request_id: str, offset: int, seq: int, payload) -> bytes:
    """A KV record's MAC: keyed BLAKE2b over what it is for (the request, and the node's reservation: its offset and
    the ring's sequence number, which no other record has) and its bytes. A record is good for that request on that
    reservation once; what the transfer engine's port receives from anyone else fails it."""
    rid = request_id.encode()
    mac = hashlib.blake2b(key=key, digest_size=RECORD_MAC_BYTES, person=_RECORD_PERSON)
    mac.update(struct.pack("!QQQH", offset, seq, len(payload), len(rid)) + rid)
    mac.update(payload)
    return mac.digest()


def _session_key(secret: bytes, node_challenge: bytes, front_challenge: bytes) -> bytes:
    return hmac.new(secret, PROTOCOL + b"|session|" + node_challenge + front_challenge, hashlib.sha256).digest()


# --- the handshake ----------------------------------------------------------------------------


def read_secret(path: str) -> bytes:
    """The shared secret from its file (surrounding whitespace dropped); OSError or ValueError say what is wrong."""
    if not path:
        raise ValueError("node_secret_file is not set: the front and its nodes need a shared secret "
                         "(e.g. `openssl rand -hex 32 > /etc/syshax/node.secret; chown root:syshax /etc/syshax/node.secret; "
                         "chmod 640 /etc/syshax/node.secret`: the daemon's user must read it)")
    secret = Path(os.path.expandvars(path)).expanduser().read_bytes().strip()
    if len(secret) < 16:
        raise ValueError(f"node_secret_file {path}: the secret is {len(secret)} bytes; use at least 16 "
                         "(e.g. `openssl rand -hex 32`)")
    return secret


def tls_context(server: bool, cert: str, key: str, ca: str) -> ssl.SSLContext | None:
    """The control channel's TLS (node_tls_cert, node_tls_key, node_tls_ca): each side shows its certificate and
    requires the other's, signed by the CA; a front also checks that the node's names the address it dials (its
    remote_nodes entry, as a subjectAltName). None when all three are empty; OSError or ssl.SSLError say what is
    wrong with a file."""
    if not (cert or key or ca):
        return None
    path = lambda p: os.path.expanduser(os.path.expandvars(p))  # noqa: E731
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    for name, given in (("node_tls_cert", cert), ("node_tls_key", key), ("node_tls_ca", ca)):
        if not os.path.isfile(path(given)):  # say which of the three, where ssl says only "No such file"
            raise FileNotFoundError(errno.ENOENT, f"{name}: {given} does not exist or is not a file")
    try:
        context.load_cert_chain(path(cert), path(key))
    except ssl.SSLError as exc:
        raise OSError(f"node_tls_cert {cert} with node_tls_key {key}: {exc} (is the key this certificate's, "
                           "both PEM?)") from None
    try:
        context.load_verify_locations(cafile=path(ca))
    except ssl.SSLError as exc:
        raise OSError(f"node_tls_ca {ca}: {exc} (a PEM certificate of the CA is expected)") from None
    context.verify_mode = ssl.CERT_REQUIRED  # the client's check_hostname stays on (PROTOCOL_TLS_CLIENT's default)
    return context


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


def _spoken(data: bytes, want: int, who: str) -> bytes:
    """The rest of a handshake message after this protocol's name; AuthFailed naming the peer's protocol if not."""
    if data.startswith(PROTOCOL + b" ") and len(data) == len(PROTOCOL) + 1 + want:
        return data[len(PROTOCOL) + 1:]
    name = data.split(b" ", 1)[0] if data.startswith(b"syshax-node/") else b""
    if name and name != PROTOCOL:
        theirs = name.decode(errors="replace")
    elif len(data) in (CHALLENGE_BYTES, 32 + CHALLENGE_BYTES):  # what syshax-node/1 sent: no name at all
        theirs = "syshax-node/1"
    else:
        raise AuthFailed(f"the {who}'s handshake message is not {PROTOCOL.decode()}'s ({len(data)} bytes)")
    raise AuthFailed(f"the {who} speaks {theirs}, this end {PROTOCOL.decode()}: run the same syshax version on the "
                     "front and its nodes")


async def _message(reader: asyncio.StreamReader) -> bytes:
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size > 256:
        raise AuthFailed(f"the peer's handshake message has {size} bytes (another protocol?)")
    return await reader.readexactly(size)


async def prove_as_node(reader, writer, secret: bytes) -> Session:
    """The node's side: challenge the front, check its proof, prove itself; AuthFailed when the front fails."""
    challenge = os.urandom(CHALLENGE_BYTES)
    await _exchange(writer, PROTOCOL + b" " + challenge)
    try:
        answer = _spoken(await _message(reader), 32 + CHALLENGE_BYTES, "front")
    except asyncio.IncompleteReadError:
        raise AuthFailed(f"the front closed the connection before answering (one older than {PROTOCOL.decode()}, "
                         "or not a front)") from None
    if not hmac.compare_digest(answer[:32], _proof(secret, b"front", challenge)):
        raise AuthFailed("the front's proof does not match this node's secret")
    await _exchange(writer, _proof(secret, b"node", answer[32:]))
    return Session(_session_key(secret, challenge, answer[32:]), b"node>front", b"front>node")


async def prove_as_front(reader, writer, secret: bytes) -> Session:
    """The front's side: answer the node's challenge, challenge it back; AuthFailed when the node fails."""
    challenge = _spoken(await _message(reader), CHALLENGE_BYTES, "node")
    mine = os.urandom(CHALLENGE_BYTES)
    await _exchange(writer, PROTOCOL + b" " + _proof(secret, b"front", challenge) + mine)
    try:
        answer = await _raw(reader, 32)
    except asyncio.IncompleteReadError:
        raise AuthFailed("the node closed the connection: it refused this front's secret") from None
    if not hmac.compare_digest(answer, _proof(secret, b"node", mine)):
        raise AuthFailed("the node's proof does not match this front's secret")
    return Session(_session_key(secret, challenge, mine), b"front>node", b"node>front")
