"""The decode nodes' control channel (syshaxd/remote/wire.py): what a frame may build, and the handshake."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from syshaxd.remote import wire
from syshaxd.sdk.types import Delta, GenerateRequest, Handling, KVHandle, SamplingParams, Submit


def _global(module: str, name: str) -> bytes:
    """A protocol-4 pickle that looks up module.name and calls it with no arguments."""
    def text(s: str) -> bytes:
        data = s.encode()
        return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE
    return b"\x80\x04" + text(module) + text(name) + b"\x93" + b")" + b"R" + b"."  # STACK_GLOBAL, EMPTY_TUPLE, REDUCE


def test_the_worker_protocol_crosses_whole():
    submit = Submit(GenerateRequest("r1", 8, SamplingParams(temperature=0.5, seed=3), prompt_tokens=(1, 2, 3),
                                    stop=("\n",)), Handling(kv=KVHandle(64, 1024, 7, 0xABC, 3, 2, 1.5)))
    event = Delta("r1", "hi", 1, "length", tokens=(5,))
    for message in (wire.ToNode(submit), wire.FromNode((event,)), wire.ReserveKV("r1", 1024)):
        assert wire.loads(wire.dumps(message)) == message


@pytest.mark.parametrize("module, name", [
    ("os", "getpid"),  # a module the channel does not carry
    ("syshaxd.remote.wire", "os.getpid"),  # a dotted name reaching through the module's own imports
    ("syshaxd.sdk.types", "dataclasses.field"),
    ("syshaxd.remote.wire", "read_secret"),  # a function of an allowed module, not a message type
    ("syshaxd.sdk.types", "RingFull"),  # a class it imports from elsewhere
    ("builtins", "eval"),
])
def test_a_frame_that_names_anything_else_is_refused(module, name):
    with pytest.raises(wire.WireError, match="does not carry"):
        wire.loads(_global(module, name))


def test_a_frame_that_is_not_a_pickle_is_refused():
    with pytest.raises(wire.WireError, match="not a message"):
        wire.loads(b"GET / HTTP/1.1\r\n")
    assert pickle.loads(_global("os", "getpid")) > 0  # the crafted frame does run where nothing checks it


def test_the_handshake_needs_the_same_secret_on_both_sides():
    async def pair(node_secret: bytes, front_secret: bytes) -> tuple:
        results = {}

        async def on_connect(reader, writer):
            try:
                await wire.prove_as_node(reader, writer, node_secret)
                results["node"] = "ok"
            except wire.AuthFailed as exc:
                results["node"] = str(exc)
            writer.close()

        server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            await wire.prove_as_front(reader, writer, front_secret)
            results["front"] = "ok"
        except wire.AuthFailed as exc:
            results["front"] = str(exc)
        writer.close()
        await asyncio.sleep(0.05)
        server.close()
        return results["front"], results["node"]

    secret = b"0123456789abcdef0123"
    assert asyncio.run(pair(secret, secret)) == ("ok", "ok")
    front, node = asyncio.run(pair(secret, b"another secret, 20 b"))
    assert node == "the front's proof does not match this node's secret"
    assert front == "the node closed the connection: it refused this front's secret"


def test_frames_are_sealed_to_their_connection_direction_and_order():
    """Past the handshake every frame carries a tag keyed from the secret and both challenges: one who relays the
    two proofs between a front and a node can neither add, alter, replay nor reflect a frame."""
    key = b"k" * 32
    front = wire.Session(key, b"front>node", b"node>front")
    node = wire.Session(key, b"node>front", b"front>node")

    def read(session, data: bytes):
        async def go():
            reader = asyncio.StreamReader()
            reader.feed_data(data)
            reader.feed_eof()
            return await session.read(reader)
        return asyncio.run(go())

    first, second = front.frame(wire.ReserveKV("a", 1)), front.frame(wire.ReserveKV("b", 2))
    assert read(node, first) == wire.ReserveKV("a", 1)
    with pytest.raises(wire.WireError, match="failed its check"):
        read(node, first)  # replayed: the node expects the second frame now
    altered = bytearray(second)
    altered[10] ^= 1
    with pytest.raises(wire.WireError, match="failed its check"):
        read(node, bytes(altered))
    assert read(node, second) == wire.ReserveKV("b", 2)
    with pytest.raises(wire.WireError, match="failed its check"):
        read(wire.Session(key, b"front>node", b"node>front"), first)  # reflected back at the front
    forged = wire.Session(b"x" * 32, b"front>node", b"node>front").frame(wire.ReserveKV("c", 3))
    with pytest.raises(wire.WireError, match="failed its check"):
        read(wire.Session(key, b"node>front", b"front>node"), forged)  # sealed without the key
