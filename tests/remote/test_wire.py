"""The decode nodes' control channel (syshaxd/remote/wire.py): what a frame may build, and the handshake."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import time

import msgspec
import pytest
from msgspec import msgpack

from syshaxd.remote import wire
from syshaxd.sdk.types import (Accepted, Cancel, Delta, EngineStats, Fallback, GenerateRequest, Handling, Imported,
                               KVHandle, Prefilled, PrefixPlan, Refusal, Rejected, SamplingParams, Submit,
                               TokenLogprob, WorkerLost)


def _global(module: str, name: str) -> bytes:
    """A protocol-4 pickle that looks up module.name and calls it with no arguments (syshax-node/1's frames were
    pickles)."""
    def text(s: str) -> bytes:
        data = s.encode()
        return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE
    return b"\x80\x04" + text(module) + text(name) + b"\x93" + b")" + b"R" + b"."  # STACK_GLOBAL, EMPTY_TUPLE, REDUCE


def _example(cls):
    """An instance of a type that crosses, every field set to something other than its default."""
    samples = {
        SamplingParams: SamplingParams(temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, seed=3, presence_penalty=0.1,
                                       frequency_penalty=0.2, repetition_penalty=1.1),
        TokenLogprob: TokenLogprob(17, -0.25, ((17, -0.25), (4, -2.5))),
        KVHandle: KVHandle(64, 1024, 7, 0xFEDCBA9876543210, 3, 2, 1.5, TokenLogprob(2, -0.5),
                           (None, TokenLogprob(9, -1.0))),
        PrefixPlan: PrefixPlan(16, 64, ((1, 0xABC), (2, 0)), ((3, 9),), (4, 0xDEF), 5, (6, 7)),
        EngineStats: EngineStats(*range(1, 6), 0.5, 12.5, *range(7, 19)),
    }
    if cls in samples:
        return samples[cls]
    request = GenerateRequest("r1", 8, _example(SamplingParams), prompt_tokens=tuple(range(2048)), stop=("\n", "##"),
                              ignore_eos=True, cache_prompt=False, logprobs=2,
                              prompt_logprobs=1, grammar='root ::= "a"', grammar_field="tools",
                              tools=({"type": "function", "function": {"name": "f", "parameters": {}}},),
                              prompt="hi", messages=({"role": "user", "content": "hi"},),
                              chat_template_kwargs={"enable_thinking": False}, max_tokens_default=True)
    handling = Handling(_example(KVHandle), Fallback.CHECKSUM, True, (5, 6), _example(PrefixPlan))
    decoder = DecoderState("decode0", "ready", 2, 8, 4, (1, 2), "none", _example(EngineStats), "tiled", True)
    return {
        GenerateRequest: lambda: request,
        Handling: lambda: handling,
        Submit: lambda: Submit(request, handling),
        Cancel: lambda: Cancel("r1"),
        Accepted: lambda: Accepted("r1", 12, 8, 4),
        Prefilled: lambda: Prefilled("r1", _example(KVHandle), Fallback.EXPORT_FAILED),
        Imported: lambda: Imported("r1", False, Fallback.STALE, 0.25, 4096),
        Rejected: lambda: Rejected("r1", Refusal.INVALID, "too long", "context_length_exceeded", "messages"),
        Delta: lambda: Delta("r1", "hi", 2, "length", "oops", (5, 6), (_example(TokenLogprob),), (None,)),
        WorkerLost: lambda: WorkerLost("r1", "died", True, "segfault", True),
        DecoderState: lambda: decoder,
        NodeHello: lambda: wire.NodeHello("10.0.0.2:7070", "llamacpp", "m", b"\x01" * 32, "10.0.0.2:1234", 1 << 40, 1 << 30,
                                  (decoder,), False),
        NodeStatus: lambda: wire.NodeStatus((decoder,), 99, 2, 3),
        FrontHello: lambda: wire.FrontHello("front:1:abc"),
        FrontPing: lambda: wire.FrontPing(),
        ReserveKV: lambda: wire.ReserveKV("r1", 1024),
        KVReserved: lambda: wire.KVReserved("r1", 64, 7, 1 << 40, "full"),
        AbortKV: lambda: wire.AbortKV("r1"),
        ToNode: lambda: wire.ToNode(Submit(request, handling), b"\x02" * 32),
        FromNode: lambda: wire.FromNode(tuple(_example(e) for e in wire.EVENTS)),
    }[cls]()


DecoderState, NodeHello, NodeStatus, FrontHello, FrontPing = (wire.DecoderState, wire.NodeHello, wire.NodeStatus,
                                                              wire.FrontHello, wire.FrontPing)
ReserveKV, KVReserved, AbortKV, ToNode, FromNode = wire.ReserveKV, wire.KVReserved, wire.AbortKV, wire.ToNode, wire.FromNode


@pytest.mark.parametrize("cls", wire.CROSSING, ids=lambda c: c.__name__)
def test_every_type_that_crosses_round_trips_whole(cls):
    """Each type, every field set: a message comes back equal, of the same types all the way down (a Fallback stays
    a Fallback); a nested type inside a message that carries it."""
    value = _example(cls)
    if cls in wire.FRONT_MESSAGES + wire.NODE_MESSAGES:
        back = wire.loads(wire.dumps(value))
    else:  # an event or a nested type: inside a message that carries it, and found again in what came back
        carrier = next(m for m in map(_example, wire.FRONT_MESSAGES + wire.NODE_MESSAGES) if _found(m, value))
        came = wire.loads(wire.dumps(carrier))
        assert came == carrier and repr(came) == repr(carrier)
        back = _found(came, value)
    assert back == value and repr(back) == repr(value) and type(back) is cls
    assert {f.name for f in dataclasses.fields(cls)} <= {k for k, v in vars(value).items() if v != _default(cls, k)}, \
        "the example leaves a field at its default"


def _found(value, want):
    """The first part of value equal to want and of its type, through dataclass fields and tuples; None if none."""
    if type(value) is type(want) and value == want:
        return value
    inner = [getattr(value, f.name) for f in dataclasses.fields(value)] if dataclasses.is_dataclass(value) else \
        list(value) if isinstance(value, (tuple, list)) else []
    return next((got for v in inner if (got := _found(v, want)) is not None), None)


def _default(cls, name):
    (f,) = [f for f in dataclasses.fields(cls) if f.name == name]
    return f.default if f.default is not dataclasses.MISSING else (
        f.default_factory() if f.default_factory is not dataclasses.MISSING else object())


def test_the_worker_protocol_crosses_whole():
    submit = Submit(GenerateRequest("r1", 8, SamplingParams(temperature=0.5, seed=3), prompt_tokens=(1, 2, 3),
                                    stop=("\n",)), Handling(kv=KVHandle(64, 1024, 7, 0xABC, 3, 2, 1.5)))
    event = Delta("r1", "hi", 1, "length", tokens=(5,))
    for message in (wire.ToNode(submit), wire.FromNode((event,)), wire.ReserveKV("r1", 1024), Cancel("r1")):
        assert wire.loads(wire.dumps(message)) == message


def test_what_is_not_a_message_of_the_channel_is_not_sent():
    with pytest.raises(wire.WireError, match="does not cross"):
        wire.dumps(Submit(GenerateRequest("r1", 8)))  # a Submit goes in a ToNode
    with pytest.raises(wire.WireError, match="not an event"):
        wire.dumps(wire.FromNode((Cancel("r1"),)))


def _to_node(**request) -> bytes:
    """A ToNode frame's body with these fields of its request changed (as a peer might send them)."""
    fields = msgspec.to_builtins(wire.ToNode(Submit(_example(GenerateRequest))))
    fields["submit"]["request"] |= request
    if "sampling" in request:
        fields["submit"]["request"]["sampling"] = msgspec.to_builtins(SamplingParams()) | request["sampling"]
    return msgpack.encode(("ToNode", fields))


@pytest.mark.parametrize("body, said", [
    (_global("os", "getpid"), "Expected `array`, got `object`"),  # syshax-node/1's pickles: nothing runs
    (_global("builtins", "eval"), "Expected `array`, got `object`"),
    (b"GET / HTTP/1.1\r\n", "Expected `array`, got `int`"),
    (msgpack.encode(("ReserveKV", {"request_id": "r1", "length": 1}))[:-1], "not a message: Input data was truncated"),
    (msgpack.encode(("Shutdown", {})), "Invalid value 'Shutdown'"),  # a worker command the channel does not carry
    (msgpack.encode(("ReserveKV", {"request_id": "r1", "length": "a lot"})), r"Expected `int`, got `str` - at `\$\[1\].length`"),
    (msgpack.encode(("ReserveKV", {"request_id": "r1", "length": -1})), r"Expected `int` >= 1 - at `\$\[1\].length`"),
    (msgpack.encode(("ReserveKV", {"request_id": "r1"})), "missing required field `length`"),
    (msgpack.encode(("ReserveKV", {"request_id": "r1", "length": 1, "then": "os.system"})), "unknown field `then`"),
    (msgpack.encode(("Cancel", {"request_id": "r" * 257})), "length <= 256"),
    (_to_node(prompt_tokens=[1, -1]), r"Expected `int` >= 0 - at `\$\[1\].submit.request.prompt_tokens\[1\]`"),
    (_to_node(prompt_tokens=[1, 1 << 40]), r"Expected `int` <= 2147483647 - at `\$\[1\].submit.request.prompt_tokens"),
    (_to_node(max_tokens="8"), r"Expected `int \| null`, got `str` - at `\$\[1\].submit.request.max_tokens`"),
    (_to_node(sampling={"temperature": []}), r"Expected `float`, got `array`"),
])
def test_a_frame_with_wrong_fields_is_refused_saying_what(body, said):
    with pytest.raises(wire.WireError, match=said):
        wire.loads(body)


def test_a_frame_that_asks_for_a_huge_allocation_is_refused_at_once():
    """syshax-node/1's unpickler let a 30-byte frame call bytes(2**36). Here a container says how many items it
    has, and the decoder checks that against the bytes that are left before it takes any memory."""
    pickled = pickle.dumps(bytes) [:-1]  # the old attack, for the record: a pickle is refused whatever it holds
    huge_tokens = msgpack.encode(("ToNode", {"submit": {"request": {"request_id": "r1", "prompt_tokens": []}}}))
    huge_tokens = huge_tokens.replace(b"\x90", b"\xdd\xff\xff\xff\xff\x01")  # an array of 2**32-1 tokens, 1 given
    for body in (pickled, b"\x92\xa9ReserveKV\xdf\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff\x01", huge_tokens):
        assert len(body) < 100
        started = time.perf_counter()
        with pytest.raises(wire.WireError):
            wire.loads(body)
        assert time.perf_counter() - started < 1.0  # no 64 GiB asked for: a loaded 2-core host takes ms


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
