"""A decode node's control channel as a peer meets it: a real NodeServer (its ring, its ledger, the real Mooncake
transfer engine) on loopback, spoken to over real sockets by this test as a front would, or as a front should not.

The node here has no decoders (none is needed to show what the channel takes and refuses): a request that gets past
the checks ends in WorkerLost ("found no decoder"), one refused ends in Rejected. After every refusal the node takes
the next front's connection and serves it.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import ssl
import time
from contextlib import asynccontextmanager

import pytest
from msgspec import msgpack

from syshaxd.engine.kv_ledger import KVLedger
from syshaxd.remote import wire
from syshaxd.remote.node import NodeServer
from syshaxd.remote.transfer import TransferEngine, TransferUnavailable, mapping_address
from syshaxd.sdk.kv.ring import KVRing
from syshaxd.sdk.types import (Cancel, GenerateRequest, Handling, KVHandle, Rejected, SamplingParams, Submit,
                               WorkerLost)

SECRET = b"a test secret of 32 bytes, here."
RECORD = 64 * 1024
TOKENS = (1, 504, 3458, 282, 4649, 314)


def _engine() -> TransferEngine:
    """A transfer engine on loopback, leaving this process's environment as it found it (other tests start
    daemons)."""
    saved = {k: os.environ.get(k) for k in ("MC_LOG_LEVEL", "MC_TCP_BIND_ADDRESS")}
    try:
        return TransferEngine("127.0.0.1")
    except TransferUnavailable as exc:
        pytest.skip(str(exc))
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


@pytest.fixture(scope="module")
def front_engine():
    """The front's transfer engine and the record it writes (random bytes: the node checks a MAC, not a model).
    Over tcp a front registers nothing (remote/transfer.py)."""
    engine = _engine()
    buffer = mmap.mmap(-1, RECORD)
    buffer[:] = os.urandom(RECORD)
    return engine, buffer


@asynccontextmanager
async def serving(tmp_path, ssl=None):  # noqa: F811 -- the node's TLS context, as NodeServer names it
    """A node on 127.0.0.1 (a port of its own), with a 1 MiB ring and no decoders."""
    ring = KVRing.create(f"syshax-test-{os.getpid()}-{time.monotonic_ns()}", 1 << 20, directory=tmp_path)
    node = NodeServer("127.0.0.1", 0, SECRET, [], ring, _engine(), KVLedger(ring), "llamacpp", "test-model",
                      b"\x07" * 32, ssl=ssl)
    await node.start()
    try:
        yield node
    finally:
        await node.close()
        await asyncio.sleep(0.05)
        ring.unlink()
        ring.close()


class Front:
    """This test, speaking to the node as a front does (wire.prove_as_front and sealed frames)."""

    def __init__(self, node: NodeServer, front_engine) -> None:
        self.node = node
        self.engine, self.buffer = front_engine
        self.reader = self.writer = self.sealed = self.hello = None

    async def connect(self, ssl=None, server_hostname=None) -> "Front":
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.node.port, ssl=ssl,
                                                                 server_hostname=server_hostname)
        self.sealed = await wire.prove_as_front(self.reader, self.writer, SECRET)
        self.hello = await self.sealed.read(self.reader)
        await self.sealed.send(self.writer, wire.FrontHello(f"test front {id(self)}"))
        return self

    async def next(self, kind):
        while not isinstance(message := await asyncio.wait_for(self.sealed.read(self.reader), 10), kind):
            pass
        return message

    async def closed(self) -> bool:
        """The node closed this connection (whatever it sent before)."""
        try:
            while True:
                await asyncio.wait_for(self.sealed.read(self.reader), 10)
        except (asyncio.IncompleteReadError, ConnectionError):
            return True

    async def reserve(self, rid: str) -> wire.KVReserved:
        await self.sealed.send(self.writer, wire.ReserveKV(rid, RECORD))
        room = await self.next(wire.KVReserved)
        assert room.request_id == rid and not room.error, room
        return room

    async def write(self, room: wire.KVReserved) -> None:
        await asyncio.to_thread(self.engine.write, self.hello.transfer_session, mapping_address(self.buffer),
                                room.address, RECORD)

    def mac(self, rid: str, room: wire.KVReserved) -> bytes:
        return wire.record_mac(self.sealed.record_key, rid, room.offset, room.seq, self.buffer[:RECORD])

    async def submit(self, rid: str, room: wire.KVReserved, mac: bytes):
        """Send the request with the record in `room`; the first event the node answers for it."""
        handle = KVHandle(room.offset, RECORD, room.seq, 0, len(TOKENS), TOKENS[-1], time.time())
        request = GenerateRequest(rid, 4, SamplingParams(temperature=0), prompt_tokens=TOKENS)
        await self.sealed.send(self.writer, wire.ToNode(Submit(request, Handling(kv=handle)), mac))
        while True:
            for event in (await self.next(wire.FromNode)).events:
                if event.request_id == rid:
                    return event

    def close(self) -> None:
        self.writer.close()


async def _still_serves(node, front_engine) -> None:
    """Another front connects, gets room, writes a record and hands it on: it gets past every check."""
    front = await Front(node, front_engine).connect()
    room = await front.reserve("after")
    await front.write(room)
    event = await front.submit("after", room, front.mac("after", room))
    assert isinstance(event, WorkerLost) and "found no decoder" in event.why, event
    front.close()


def _refused_line(caplog, said: str) -> str:
    lines = [r.getMessage() for r in caplog.records if said in r.getMessage()]
    assert lines, [r.getMessage() for r in caplog.records]
    return lines[0]


@pytest.mark.parametrize("body, said", [
    (msgpack.encode(("ReserveKV", {"request_id": "r1", "length": "a lot"})),
     "a frame's fields are wrong: Expected `int`, got `str` - at `$[1].length`"),
    (msgpack.encode(("Cancel", {"request_id": 7})), "Expected `str`, got `int` - at `$[1].request_id`"),
    (msgpack.encode(("NodeStatus", {"decoders": [], "ring_used": 0, "front_slots": 0, "fronts": 1})),
     "a NodeStatus is not a front's message"),
    # syshax-node/1 let a 30-byte frame call bytes(2**36); here an array that says it holds 2**32-1 tokens
    (b"\x92\xa6ToNode\x82\xa6submit\x81\xa7request\x81\xadprompt_tokens\xdd\xff\xff\xff\xff\x01",
     "Expected `array` of length <= 1048576 - at `$[1].submit.request.prompt_tokens`"),
    (b"\x92\xa9ReserveKV\xdf\xff\xff\xff\xff\xaarequest_id\xa1x", "not a message: Input data was truncated"),  # 2**32-1 fields
])
def test_a_frame_with_wrong_fields_closes_its_connection_and_the_node_serves_on(tmp_path, front_engine, caplog, body,
                                                                                said):
    async def scenario():
        async with serving(tmp_path) as node:
            front = await Front(node, front_engine).connect()
            front.writer.write(front.sealed.seal(body))
            assert await front.closed()
            await _still_serves(node, front_engine)

    with caplog.at_level(logging.INFO, logger="syshaxd.remote"):
        asyncio.run(scenario())
    line = _refused_line(caplog, said)
    assert line.startswith("front 127.0.0.1:") and "sent what this node does not accept" in line, line
    assert "closing its connection" in line


def test_a_frame_over_the_limit_is_refused_before_it_is_read(tmp_path, front_engine, caplog):
    async def scenario():
        async with serving(tmp_path) as node:
            front = await Front(node, front_engine).connect()
            front.writer.write((1 << 31).to_bytes(4, "big"))  # and nothing more: the node must not wait for 2 GiB
            assert await front.closed()
            await _still_serves(node, front_engine)

    with caplog.at_level(logging.INFO, logger="syshaxd.remote"):
        asyncio.run(scenario())
    assert "a frame of 2147483648 bytes is over the 16777216-byte limit" in _refused_line(caplog, "over the")


def test_a_record_whose_mac_fails_is_refused_and_so_is_its_request(tmp_path, front_engine, caplog):
    """Bytes that are not the ones the front's MAC covers (here: the front says so of another record) never reach a
    decoder: the request is refused, saying why, and its room goes back."""
    async def scenario():
        async with serving(tmp_path) as node:
            front = await Front(node, front_engine).connect()
            room = await front.reserve("forged")
            await front.write(room)
            forged = wire.record_mac(os.urandom(32), "forged", room.offset, room.seq, front.buffer[:RECORD])
            event = await front.submit("forged", room, forged)
            assert isinstance(event, Rejected) and event.kind == "failed", event
            assert "failed its check" in event.message
            node.ring.reclaim()
            assert node.ring.stats().used_bytes == 0  # the room went back
            await _still_serves(node, front_engine)

    with caplog.at_level(logging.INFO, logger="syshaxd.remote"):
        asyncio.run(scenario())
    assert "the KV record of request forged failed its check" in _refused_line(caplog, "failed its check")


def test_a_record_replayed_for_another_request_or_twice_is_refused(tmp_path, front_engine):
    async def scenario():
        async with serving(tmp_path) as node:
            front = await Front(node, front_engine).connect()
            first = await front.reserve("first")
            await front.write(first)
            mac = front.mac("first", first)
            assert isinstance(await front.submit("first", first, mac), WorkerLost)  # it checked: on to a decoder
            # the same record, the same MAC, sent again
            again = await front.submit("first", first, mac)
            assert isinstance(again, Rejected) and "a replay" in again.message, again
            # the first record's MAC for another request's room (its bytes are the same)
            second = await front.reserve("second")
            await front.write(second)
            other = await front.submit("second", second, mac)
            assert isinstance(other, Rejected) and "failed its check" in other.message, other
            # another request naming the first one's room
            third = await front.reserve("third")
            named = await front.submit("third", first, mac)
            assert isinstance(named, Rejected) and "not reserved for it" in named.message, named
            await front.sealed.send(front.writer, Cancel("third"))
            # a record is the connection's own: the same bytes, room and request on another connection fail
            elsewhere = await Front(node, front_engine).connect()
            fourth = await elsewhere.reserve("fourth")
            await elsewhere.write(fourth)
            theirs = await elsewhere.submit("fourth", fourth, front.mac("fourth", fourth))
            assert isinstance(theirs, Rejected) and "failed its check" in theirs.message, theirs
            del third
            await _still_serves(node, front_engine)

    asyncio.run(scenario())


def test_only_the_room_of_the_record_in_flight_is_open_to_the_transfer_engine(tmp_path, front_engine):
    """Over tcp the node's transfer engine takes writes into a record's room from its ReserveKV to its Submit, and
    nowhere else: not the room once the Submit came, not another part of the ring, not its header page."""
    from syshaxd.remote.transfer import TransferFailed

    async def scenario():
        async with serving(tmp_path) as node:
            front = await Front(node, front_engine).connect()
            engine, buffer = front_engine
            ring_start = node.ring_address

            def write(address: int, length: int = 4096) -> None:
                engine.write(front.hello.transfer_session, mapping_address(buffer), address, length)

            with pytest.raises(TransferFailed):
                await asyncio.to_thread(write, ring_start)  # the ring's header page
            with pytest.raises(TransferFailed):
                await asyncio.to_thread(write, ring_start + KVRing.payload_position(0))  # no room reserved there
            room = await front.reserve("in flight")
            await asyncio.to_thread(write, room.address)  # its room, while the front fills it
            with pytest.raises(TransferFailed):
                await asyncio.to_thread(write, room.address + RECORD)  # past its end
            await front.write(room)
            assert isinstance(await front.submit("in flight", room, front.mac("in flight", room)), WorkerLost)
            before = bytes(node.ring.mapping[room.address - ring_start:room.address - ring_start + 16])
            with pytest.raises(TransferFailed):
                await asyncio.to_thread(write, room.address)  # the Submit came: shut
            assert bytes(node.ring.mapping[room.address - ring_start:room.address - ring_start + 16]) == before
            aborted = await front.reserve("given up")
            await front.sealed.send(front.writer, wire.AbortKV("given up"))
            await front.sealed.send(front.writer, wire.FrontPing())
            await asyncio.sleep(0.2)
            with pytest.raises(TransferFailed):
                await asyncio.to_thread(write, aborted.address)  # aborted: shut
            front.close()

    asyncio.run(scenario())


async def _front_meets_a_node_that_says(hello: bytes) -> str:
    """What a front's handshake says of a node whose first message is `hello` (an older protocol's)."""
    async def old_node(reader, writer):
        writer.write(len(hello).to_bytes(4, "big") + hello)
        await writer.drain()
        await asyncio.sleep(0.5)
        writer.close()

    server = await asyncio.start_server(old_node, "127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
    with pytest.raises(wire.AuthFailed) as refused:
        await wire.prove_as_front(reader, writer, SECRET)
    writer.close()
    server.close()
    return str(refused.value)


def test_a_peer_of_the_old_protocol_is_told_so(tmp_path, front_engine, caplog):
    """syshax-node/1 sent a bare challenge and answered with a bare proof; since syshax-node/2 each side names what
    it speaks, so a peer of /1 is refused (and one of /2, whose requests had other fields, by name: below)."""
    async def scenario():
        async with serving(tmp_path) as node:
            # a front of syshax-node/1: reads the challenge, answers with a 64-byte proof and challenge
            reader, writer = await asyncio.open_connection("127.0.0.1", node.port)
            size = int.from_bytes(await reader.readexactly(4), "big")
            assert (await reader.readexactly(size)).startswith(wire.PROTOCOL + b" ")
            writer.write((64).to_bytes(4, "big") + os.urandom(64))
            assert await reader.read() == b""  # closed
            writer.close()
            await _still_serves(node, front_engine)
        return await _front_meets_a_node_that_says(os.urandom(32))  # a node of syshax-node/1: a bare challenge

    with caplog.at_level(logging.INFO, logger="syshaxd.remote"):
        said = asyncio.run(scenario())
    assert said == (f"the node speaks syshax-node/1, this end {wire.PROTOCOL.decode()}: run the same syshax version "
                    "on the front and its nodes")
    line = _refused_line(caplog, "refused a connection")
    assert f"the front speaks syshax-node/1, this end {wire.PROTOCOL.decode()}" in line, line


def test_a_node_of_the_previous_protocol_is_named():
    # syshax-node/2's requests carried default_max_tokens, which the daemon now decides alone: a front refuses
    # such a node by its protocol's name before any request crosses
    said = asyncio.run(_front_meets_a_node_that_says(b"syshax-node/2 " + os.urandom(32)))
    assert said == (f"the node speaks syshax-node/2, this end {wire.PROTOCOL.decode()}: run the same syshax version "
                    "on the front and its nodes")


# --- TLS ------------------------------------------------------------------------------------------------------------


def _certificates(tmp_path, name: str = "ca"):
    """A throwaway CA and, signed by it, a node's certificate (for 127.0.0.1) and a front's: PEM files (cert, key)
    each, and the CA's."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def issue(subject: str, key, issuer_name, issuer_key, ca: bool, san=None):
        builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                                                        subject)]))
                   .issuer_name(issuer_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=1))
                   .not_valid_after(now + datetime.timedelta(hours=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san is not None:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    def save(stem: str, cert, key) -> tuple[str, str]:
        cert_path, key_path = tmp_path / f"{name}-{stem}.pem", tmp_path / f"{name}-{stem}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        return str(cert_path), str(key_path)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"syshax test {name}")])
    ca = issue(f"syshax test {name}", ca_key, ca_name, ca_key, True)
    ca_path, _ = save("ca", ca, ca_key)
    node_key, front_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    node = save("node", issue("node", node_key, ca_name, ca_key, False,
                              [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), node_key)
    front = save("front", issue("front", front_key, ca_name, ca_key, False, [x509.DNSName("front")]), front_key)
    return node, front, ca_path


def test_the_channel_runs_over_tls_both_sides_checked(tmp_path, front_engine, caplog):
    """node_tls_cert / node_tls_key / node_tls_ca on both sides: the real front (RemoteNode) brings its link up over
    TLS 1.3 and a record crosses with its MAC; a front without a certificate, with one of another CA, or speaking
    plain TCP gets nowhere, and the node serves on."""
    from syshaxd.engine.kv_ledger import KVLedger
    from syshaxd.remote.front import FrontTransfer, RemoteNode
    from syshaxd.sdk.types import EngineSpec, Role

    pytest.importorskip("cryptography")
    (node_cert, node_key), (front_cert, front_key), ca = _certificates(tmp_path)
    (_, _), (stranger_cert, stranger_key), _ = _certificates(tmp_path, "other")
    node_tls = wire.tls_context(True, node_cert, node_key, ca)
    front_tls = wire.tls_context(False, front_cert, front_key, ca)

    async def scenario():
        async with serving(tmp_path, ssl=node_tls) as node:
            front = await Front(node, front_engine).connect(ssl=front_tls, server_hostname="127.0.0.1")
            assert front.writer.get_extra_info("ssl_object").version() == "TLSv1.3"
            room = await front.reserve("over tls")
            await front.write(room)
            event = await front.submit("over tls", room, front.mac("over tls", room))
            assert isinstance(event, WorkerLost) and "found no decoder" in event.why, event
            front.close()

            spec = EngineSpec(backend="llamacpp", role=Role.GENERATE, model_path="", model_name="test-model",
                              tiled_attention=True)
            remote = RemoteNode(f"127.0.0.1:{node.port}", SECRET, spec, KVLedger(None), b"\x07" * 32,
                                FrontTransfer(None), link_timeout=5.0, ssl=front_tls)
            remote.start()
            try:
                for _ in range(100):
                    if remote.link == "up":
                        break
                    await asyncio.sleep(0.05)
                assert remote.link == "up", (remote.link, remote.error)
                assert [s.front_id for s in node.sessions.values()] == [remote.front_id]
            finally:
                await remote.stop()

            refused = []
            for ssl_context in (None, wire.tls_context(False, stranger_cert, stranger_key, ca),
                                _no_certificate(ca)):
                try:  # plain TCP: the node waits for a TLS hello that never comes, and hears nothing it takes
                    await asyncio.wait_for(Front(node, front_engine).connect(
                        ssl=ssl_context, server_hostname="127.0.0.1" if ssl_context else None), 2)
                except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, wire.WireError) as exc:
                    refused.append(type(exc).__name__)
            assert len(refused) == 3, refused
            await _still_serves_over(node, front_engine, front_tls)

    with caplog.at_level(logging.INFO, logger="syshaxd.remote"):
        asyncio.run(scenario())
    assert any("over TLS" in r.getMessage() for r in caplog.records)


def test_a_front_checks_the_nodes_certificate_names_the_address_it_dials(tmp_path, front_engine):
    (node_cert, node_key), (front_cert, front_key), ca = _certificates(tmp_path)

    async def scenario():
        async with serving(tmp_path, ssl=wire.tls_context(True, node_cert, node_key, ca)) as node:
            with pytest.raises(ssl.SSLCertVerificationError, match="IP address mismatch|doesn't match"):
                await Front(node, front_engine).connect(ssl=wire.tls_context(False, front_cert, front_key, ca),
                                                        server_hostname="10.9.9.9")

    asyncio.run(scenario())


def _no_certificate(ca: str):
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cafile=ca)
    return context


async def _still_serves_over(node, front_engine, tls) -> None:
    front = await Front(node, front_engine).connect(ssl=tls, server_hostname="127.0.0.1")
    room = await front.reserve("after")
    await front.write(room)
    event = await front.submit("after", room, front.mac("after", room))
    assert isinstance(event, WorkerLost), event
    front.close()


def test_tls_needs_all_three_keys_or_none():
    from syshaxd.config import ConfigError, from_mapping

    with pytest.raises(ConfigError, match="node_tls_key, node_tls_ca: TLS on the nodes' channel needs all of"):
        from_mapping({"node_tls_cert": "/etc/syshax/node.pem"})
    assert from_mapping({}).node_tls_cert == ""


def test_a_node_whose_tls_files_are_wrong_says_which(tmp_path):
    (node_cert, node_key), (front_cert, front_key), ca = _certificates(tmp_path)
    missing = str(tmp_path / "nothing.pem")
    with pytest.raises(OSError, match=r"node_tls_cert: \S*nothing.pem does not exist"):
        wire.tls_context(True, missing, missing, missing)
    with pytest.raises(OSError, match=r"node_tls_key: \S*nothing.pem does not exist"):
        wire.tls_context(True, node_cert, missing, ca)
    with pytest.raises(OSError, match=r"node_tls_ca: \S*nothing.pem does not exist"):
        wire.tls_context(True, node_cert, node_key, missing)
    with pytest.raises(OSError, match=r"node_tls_cert \S*node.pem with node_tls_key \S*front.key: .*is the key"):
        wire.tls_context(True, node_cert, front_key, ca)  # another certificate's key
    with pytest.raises(OSError, match=r"node_tls_ca \S*node.key: "):
        wire.tls_context(True, node_cert, node_key, node_key)  # a key where the CA goes
    assert wire.tls_context(False, "", "", "") is None
    assert wire.tls_context(False, front_cert, front_key, ca) is not None
