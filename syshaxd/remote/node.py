"""A decode node: syshaxd on a CPU host that runs only decode workers and offers them to one front daemon.

    front (prefill) ── control channel (TCP, authenticated; remote/wire.py) ──> node ──> decode workers
          └────────── transfer engine (one-sided writes; remote/transfer.py) ──> node's KV ring

The node owns its ring (it is the ring's only writer, reserving room for each record the front
sends) and its ledger (engine/kv_ledger.py: a record is freed once its decoder reports on it or
dies), and supervises its workers as any daemon does (engine/supervisor.py). For each request the
front asks for room, writes the record's bytes, then sends the Submit with the record's MAC: the node
commits the record only if the MAC checks (keyed from this connection's session, over the record's
bytes, the request and the room reserved for it: a record altered, written by anyone else, or
replayed for another request or twice is refused, and so is its request), then hands it to its
least loaded ready decoder, whose import checks the checksum and the model fingerprint as on one host. Events go back
as they come; a NodeStatus every HEARTBEAT seconds tells the front the link is alive.

Several fronts at once, each on its own authenticated connection, named by the FrontHello it sends first: the
same front connecting again (it lost its link) replaces its own earlier session, whose requests are cancelled
here; another front's go on. node_front_slots caps what each front runs on the decoders at once (0: first come,
first served); a front's requests past its share wait here, in order, until one of its own ends. A front silent
for longer than node_link_timeout (it pings every HEARTBEAT) is gone: its requests are cancelled, its share freed.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import os
import time
from collections import deque

from syshaxd.engine.engine_handle import EngineUnavailable, WorkerStream
from syshaxd.engine.kv_ledger import Dropped, KVLedger, Lent, Written
from syshaxd.engine.supervisor import WorkerHandle
from syshaxd.remote import wire
from syshaxd.remote.transfer import TransferEngine, TransferUnavailable, mapping_address
from syshaxd.remote.wire import (
    AbortKV,
    DecoderState,
    FromNode,
    FrontHello,
    FrontPing,
    KVReserved,
    NodeHello,
    NodeStatus,
    ReserveKV,
    ToNode,
)
from syshaxd.engine.lifecycle import HandleState
from syshaxd.sdk.kv.ring import RECORD_HEADER, KVRing, RingError
from syshaxd.sdk.types import Cancel, Refusal, Rejected, Submit, WorkerLost

log = logging.getLogger(__name__)

HEARTBEAT = 0.5  # seconds between NodeStatus messages
ABORT_GRACE = 30.0  # seconds a gone front's reservations are kept, past any write of its still under way
HANDSHAKE_TIMEOUT = 10.0
MAX_HANDSHAKES = 8  # connections at once that have not proved the secret yet


class NodeServer:
    """The node's control endpoint and its decoders; `run()` serves until `stop` is set."""

    def __init__(self, host: str, port: int, secret: bytes, workers: list[WorkerHandle], ring: KVRing,
                 transfer: TransferEngine, ledger: KVLedger, backend: str, model_name: str,
                 fingerprint: bytes, tiled_attention: bool = True, front_slots: int = 0,
                 link_timeout: float = 3.0, ssl=None) -> None:
        self.host, self.port = host, port
        self.secret = secret
        self.workers = workers
        self.ring = ring
        self.transfer = transfer
        self.ledger = ledger
        self.backend, self.model_name, self.fingerprint = backend, model_name, fingerprint
        self.tiled_attention = tiled_attention
        self.front_slots = front_slots  # node_front_slots: each front's share of the decoders' requests; 0: no cap
        self.link_timeout = link_timeout  # a front silent this long is gone
        self.ssl = ssl  # the control channel's TLS (wire.tls_context); None: plain TCP
        self.ring_address = mapping_address(ring.mapping)
        self.sessions: dict[str, FrontSession] = {}  # front id -> its session
        self.refused = 0  # connections that failed the handshake
        self._handshakes = 0  # connections proving themselves now
        self._refusal_logged = 0.0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        if not self.transfer.windowed:  # rdma: the records' area once (the header page stays out of reach)
            start = KVRing.payload_position(0) - RECORD_HEADER
            self.transfer.register(self.ring_address + start, len(self.ring.mapping) - start)
        self._server = await asyncio.start_server(self._on_connect, self.host, self.port, ssl=self.ssl,
                                                  ssl_handshake_timeout=HANDSHAKE_TIMEOUT if self.ssl else None)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("decode node listening on %s:%d%s (transfer engine %s)", self.host, self.port,
                 " over TLS" if self.ssl else "", self.transfer.session)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for session in list(self.sessions.values()):
            session.close("the node is stopping")

    def decoder_states(self) -> tuple[DecoderState, ...]:
        return tuple(DecoderState(w.name, w.state, w.in_flight, w.spec.max_batch_size, w.spec.threads,
                                  tuple(w.info.get("cpus", ())), w.error, w.stats, str(w.info.get("attention", "")),
                                  bool(w.info.get("exact_decode", False))) for w in self.workers)

    def pick(self) -> WorkerHandle | None:
        ready = [w for w in self.workers if w.state == HandleState.READY]
        return min(ready, key=lambda w: w.in_flight) if ready else None

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        if self._handshakes >= MAX_HANDSHAKES:  # a flood of connections that prove nothing holds no more than this
            self.refused += 1
            writer.close()
            return
        self._handshakes += 1
        try:
            sealed = await asyncio.wait_for(wire.prove_as_node(reader, writer, self.secret), HANDSHAKE_TIMEOUT)
        except (wire.WireError, asyncio.IncompleteReadError, asyncio.TimeoutError, OSError) as exc:
            self.refused += 1
            now = time.monotonic()
            if now - self._refusal_logged >= 1.0:  # one line a second at most, however many knock
                self._refusal_logged = now
                log.warning("refused a connection from %s: %s (%d refused so far)", peer,
                            str(exc) or type(exc).__name__, self.refused)
            writer.close()
            return
        finally:
            self._handshakes -= 1
        session = FrontSession(self, reader, writer, f"{peer[0]}:{peer[1]}", sealed)
        try:
            await session.run()
        finally:
            if self.sessions.get(session.front_id) is session:
                del self.sessions[session.front_id]

    def register(self, session: "FrontSession") -> None:
        """A front said who it is: its earlier session, if it lost its link and came back, goes; others stay."""
        earlier = self.sessions.get(session.front_id)
        if earlier is not None:
            earlier.close(f"the same front connected again from {session.peer}")
        self.sessions[session.front_id] = session
        log.info("front %s connected from %s (%d fronts now)", session.front_id, session.peer, len(self.sessions))


class Room:
    """Room reserved in the node's ring for one record, and (tcp) the transfer engine's window onto it: the only
    part of this process a peer of the transfer engine's port can write, from the ReserveKV to the Submit that says
    the record is written (or to its abort). The room's one owner: whoever holds it shuts, commits or aborts it."""

    def __init__(self, node: "NodeServer", reservation) -> None:
        self.reservation = reservation
        self.offset, self.seq, self.length = reservation.offset, reservation.seq, reservation.length
        self.address = node.ring_address + KVRing.payload_position(reservation.offset)
        self._transfer = node.transfer if node.transfer.windowed else None
        if self._transfer is not None:
            self._transfer.register(self.address, self.length)

    def shut(self) -> None:
        """Take the window from the transfer engine: nothing written from here on lands (idempotent)."""
        if self._transfer is not None:
            transfer, self._transfer = self._transfer, None
            transfer.unregister(self.address)

    def commit(self) -> None:
        self.shut()
        self.reservation.commit()

    def abort(self) -> None:
        self.shut()
        try:
            self.reservation.abort()
        except RingError:
            pass  # the ring was reset meanwhile, or the room already ended


def _abort_all(rooms: list[Room]) -> None:
    for room in rooms:
        room.abort()


class FrontSession:
    """One connected front: its requests on this node's decoders, its reservations in the ring."""

    def __init__(self, node: NodeServer, reader, writer, peer: str, sealed: wire.Session) -> None:
        self.node = node
        self.sealed = sealed
        self.reader, self.writer = reader, writer
        self.peer = peer
        self.front_id = ""  # what the front calls itself (FrontHello)
        self.streams: dict[str, WorkerStream] = {}
        self.waiting: deque[Submit] = deque()  # past the front's share (node_front_slots): run as its own end
        self.reservations: dict[str, Room] = {}  # request id -> the room the front is filling
        self._tasks: set[asyncio.Task] = set()
        self._relays: dict[str, asyncio.Task] = {}  # request id -> the task relaying its events
        self._checking: dict[str, asyncio.Task] = {}  # request id -> the task checking its record's MAC
        self._closed = False
        self._outbox: list = []  # decoder events of this loop turn: one frame for a whole engine step

    async def run(self) -> None:
        node = self.node
        hello = NodeHello(f"{node.host}:{node.port}", node.backend, node.model_name, node.fingerprint,
                          node.transfer.session, node.ring_address, node.ring.capacity, node.decoder_states(),
                          node.tiled_attention)
        heartbeat = None
        try:
            self._send(hello)
            first = await asyncio.wait_for(self.sealed.read(self.reader), HANDSHAKE_TIMEOUT)
            if not isinstance(first, FrontHello) or not first.front_id:
                raise wire.WireError(f"its first message is a {type(first).__name__}, not its hello")
            self.front_id = first.front_id
            node.register(self)
            heartbeat = asyncio.ensure_future(self._heartbeat())
            while not self._closed:
                self._handle(await asyncio.wait_for(self.sealed.read(self.reader), node.link_timeout))
        except asyncio.TimeoutError:
            self.close(f"the front said nothing for {node.link_timeout:g}s (node_link_timeout)")
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            self.close("the front closed the connection")
        except wire.WireError as exc:
            log.error("front %s sent what this node does not accept (%s); closing its connection", self.peer, exc)
            self.close(str(exc))
        finally:
            if heartbeat is not None:
                heartbeat.cancel()
            self.close("the connection ended")

    def close(self, why: str) -> None:
        if self._closed:
            return
        self._closed = True
        log.info("front %s (%s) gone (%s): cancelling its %d requests here", self.front_id or "?", self.peer, why,
                 len(self.streams) + len(self.waiting))
        for request_id, stream in list(self.streams.items()):
            stream.cancel()
            self.node.ledger.tell(Dropped(request_id))
        self.streams.clear()
        for submit in self.waiting:
            self.node.ledger.tell(Dropped(submit.request.request_id))
        self.waiting.clear()
        # a write the front started may still land: the room goes back once it cannot any more
        reservations, self.reservations = list(self.reservations.values()), {}
        for room in reservations:
            room.shut()  # no new write lands; one under way may still, so the room itself waits
        if reservations:
            asyncio.get_running_loop().call_later(ABORT_GRACE, _abort_all, reservations)
        for task in self._tasks:
            task.cancel()
        self.writer.close()

    def _send(self, message) -> None:
        if not self._closed:
            self.writer.write(self.sealed.frame(message))

    def _relay_event(self, event) -> None:
        """Queue a decoder's event for the front. A worker's step reaches its streams in one loop turn, and all
        of it goes in one frame, sent after that turn: not one frame (and one write) per sequence."""
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append(event)

    def _flush(self) -> None:
        events, self._outbox = tuple(self._outbox), []
        if events:
            self._send(FromNode(events))

    async def _heartbeat(self) -> None:
        while not self._closed:
            self._send(NodeStatus(self.node.decoder_states(), self.node.ring.stats().used_bytes,
                                  self.node.front_slots, len(self.node.sessions)))
            try:
                await asyncio.wait_for(self.writer.drain(), HEARTBEAT * 4)
            except (asyncio.TimeoutError, ConnectionError, OSError):
                pass  # the front stops hearing us: its link timeout ends the session from its side
            await asyncio.sleep(HEARTBEAT)

    # --- what the front asks -------------------------------------------------------------------------

    def _handle(self, message) -> None:
        if isinstance(message, ReserveKV):
            self._reserve(message)
        elif isinstance(message, AbortKV):
            reservation = self.reservations.pop(message.request_id, None)
            if reservation is not None:
                reservation.abort()
        elif isinstance(message, FrontPing):
            pass  # it lives: the read's timeout starts again
        elif isinstance(message, ToNode):
            self._submit(message.submit, message.record_mac)
        elif isinstance(message, Cancel):
            request_id = message.request_id
            checking = self._checking.pop(request_id, None)
            if checking is not None:
                checking.cancel()  # its record's room goes back
            stream = self.streams.pop(request_id, None)
            if stream is not None:
                stream.cancel()
            relay = self._relays.pop(request_id, None)
            if relay is not None:
                relay.cancel()  # its stream gets no more events: the worker forgot the request
            for submit in [s for s in self.waiting if s.request.request_id == request_id]:
                self.waiting.remove(submit)
            self.node.ledger.tell(Dropped(request_id))
            self._start_waiting()
        else:
            raise wire.WireError(f"a {type(message).__name__} is not a front's message")

    def _reserve(self, message: ReserveKV) -> None:
        earlier = self.reservations.pop(message.request_id, None)
        if earlier is not None:
            earlier.abort()  # asked again for the same request: the room it had would never be committed
        try:
            reservation = self.node.ring.reserve(message.length, timeout=0.0)
        except RingError as exc:
            self._send(KVReserved(message.request_id, error=str(exc)))
            return
        try:
            room = Room(self.node, reservation)
        except TransferUnavailable as exc:
            reservation.abort()
            self._send(KVReserved(message.request_id, error=str(exc)))
            return
        self.reservations[message.request_id] = room
        self._send(KVReserved(message.request_id, room.offset, room.seq, room.address))

    def _submit(self, submit: Submit, record_mac: bytes) -> None:
        """Run a request; one that comes with a record once the record checks (its MAC, in a thread)."""
        request, kv = submit.request, submit.handling.kv
        if kv is None:
            self._queue(submit)
            return
        reservation = self.reservations.pop(request.request_id, None)
        if reservation is None or (reservation.offset, reservation.seq) != (kv.offset, kv.seq) \
                or kv.length > reservation.length:
            if reservation is not None:
                reservation.abort()
            self._refuse_record(request.request_id, "names room in this node's ring that was not reserved for it, or "
                                                    "that a record took already (a replay)")
            return
        reservation.shut()  # written, says the front: from here on the bytes are the node's alone, then checked
        task = asyncio.ensure_future(self._check_record(submit, reservation, record_mac))
        self._checking[request.request_id] = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _check_record(self, submit: Submit, reservation, mac: bytes) -> None:
        """Commit the record for the decoders if its MAC is the one this front made for this request and this
        reservation, else refuse the request; a Cancel meanwhile gives the room back."""
        rid, kv = submit.request.request_id, submit.handling.kv
        assert kv is not None  # only a Submit with a record is checked
        try:
            good = await asyncio.get_running_loop().run_in_executor(None, self._record_is, reservation, kv.length,
                                                                    rid, mac)
        except BaseException:
            reservation.abort()
            raise
        finally:
            self._checking.pop(rid, None)
        if self._closed:
            reservation.abort()
            return
        if not good:
            reservation.abort()
            self._refuse_record(rid, "failed its check (its MAC is not the one this front made for this request "
                                     "and this room: altered or written by someone else on the way, or replayed)")
            return
        reservation.commit()  # the front wrote the payload: publish it to the decoders
        self.node.ledger.tell(Written(rid, kv, os.getpid()))
        self._queue(submit)

    def _record_is(self, reservation, length: int, request_id: str, mac: bytes) -> bool:
        start = KVRing.payload_position(reservation.offset)
        with memoryview(self.node.ring.mapping) as whole, whole[start:start + length] as payload:
            expected = wire.record_mac(self.sealed.record_key, request_id, reservation.offset, reservation.seq, payload)
        return hmac.compare_digest(expected, mac)

    def _refuse_record(self, request_id: str, why: str) -> None:
        log.warning("front %s (%s): the KV record of request %s %s; refused the request", self.front_id, self.peer,
                    request_id, why)
        self._send(FromNode((Rejected(request_id, Refusal.FAILED, f"its KV record on node {self.node.host}:"
                                                                  f"{self.node.port} {why}"),)))

    def _queue(self, submit: Submit) -> None:
        share = self.node.front_slots
        if share and len(self.streams) >= share:  # its share is taken: it waits for one of its own to end
            self.waiting.append(submit)
            return
        self._start(submit)

    def _start(self, submit: Submit) -> None:
        """Run the request on the node's least loaded ready decoder, relaying its events to the front."""
        request, handling = submit.request, submit.handling
        ledger = self.node.ledger
        worker = self.node.pick()
        try:
            if worker is None:
                raise EngineUnavailable("no decoder of this node is ready")
            stream = worker.submit(request, handling)
        except EngineUnavailable as exc:
            ledger.tell(Dropped(request.request_id))
            # the front's journey goes on elsewhere, as after a worker's death before its first token
            self._send(FromNode((WorkerLost(request.request_id, f"found no decoder on node {self.node.host}:"
                                                                f"{self.node.port} ({exc})"),)))
            return
        if handling.kv is not None:
            ledger.tell(Lent(request.request_id, worker.name))
        self.streams[request.request_id] = stream
        task = asyncio.ensure_future(self._relay(stream))
        self._tasks.add(task)
        self._relays[request.request_id] = task
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(functools.partial(self._relay_done, request.request_id))

    def _relay_done(self, rid: str, task: asyncio.Future) -> None:
        if self._relays.get(rid) is task:
            self._relays.pop(rid, None)

    async def _relay(self, stream: WorkerStream) -> None:
        """The decoder's events, to the front as they come, until the last."""
        request_id = stream.request_id
        while True:
            event = await stream.next_event()
            if self.streams.get(request_id) is not stream:
                return  # cancelled, or the session closed
            self._relay_event(event)
            if stream.finished:
                break
        del self.streams[request_id]
        self.node.ledger.tell(Dropped(request_id))
        self._start_waiting()

    def _start_waiting(self) -> None:
        """The front's requests that waited for its share, while there is room in it."""
        while self.waiting and not self._closed and (not self.node.front_slots
                                                     or len(self.streams) < self.node.front_slots):
            self._start(self.waiting.popleft())


__all__ = ["FrontSession", "NodeServer"]
