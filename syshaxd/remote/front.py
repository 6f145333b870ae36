"""The front's side of a decode node: the node as one more CPU decoder, beside the local ones.

A RemoteNode stands where a WorkerHandle does (engine/supervisor.py): the scheduler picks the least
loaded ready decoder, local or remote, and a journey (engine/journey.py) submits to it, reads its
events, and goes on elsewhere when it is lost. What differs is the way there:

* a request that comes with a KV record (hetero, auto's offload) first gets room in the node's
  ring (ReserveKV), then the transfer engine writes the record's payload there one-sidedly, then
  the Submit goes, naming the node's offset and the checksum the prefill reported, with the record's
  MAC (wire.record_mac: keyed from this connection, bound to the request and the node's reservation). The front's copy
  is freed once the write is over, whatever its outcome; a write that fails or times out sends the
  request without a record (the decoder recomputes the prompt, counted as transfer_failed);
* the link is alive while the node's NodeStatus arrives every half second. Silence past
  node_link_timeout, a closed connection or a bad frame drops the link: every request on the node
  gets a WorkerLost, so its journey resends or resumes it on another decoder, and the node is
  dialled again every RETRY seconds until it answers (then it takes requests again).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from syshaxd.config import split_address
from syshaxd.engine.attempts import new_attempt, request_of
from syshaxd.engine.engine_handle import EngineUnavailable, WorkerStream
from syshaxd.engine.kv_ledger import KVLedger, Quantiles, SentAway
from syshaxd.engine.lifecycle import NODE_MOVES, HandleState, Lifecycle, LifecycleState
from syshaxd.engine.status import NodeDecoderStatus, RemoteNodeStatus, WorkerStatus
from syshaxd.remote import wire
from syshaxd.remote.transfer import (
    TransferEngine,
    TransferFailed,
    TransferUnavailable,
    mapping_address,
)
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
from syshaxd.sdk.kv.ring import RECORD_HEADER, KVRing
from syshaxd.sdk.types import (
    Cancel,
    Delta,
    EngineSpec,
    EngineStats,
    Fallback,
    GenerateRequest,
    Handling,
    Imported,
    Prefilled,
    Rejected,
    Submit,
    WorkerLost,
)

log = logging.getLogger(__name__)

RETRY = 1.0  # seconds between attempts to reach a node that is down
PING = 0.5  # seconds between the front's pings (the node's NodeStatus comes as often)
TRANSFER_TIMEOUT = 10.0  # seconds one record's write may take before its decoder recomputes instead
TRANSFER_THREADS = 4  # writes in flight at once, over all nodes


class FrontTransfer:
    """The front's transfer engine, started at the first node's connection (on the address that reaches it),
    with the front's KV ring registered as the source of every write."""

    def __init__(self, ring: KVRing | None, protocol: str = "tcp", device: str = "") -> None:
        self.ring = ring
        self.protocol, self.device = protocol, device
        self.engine: TransferEngine | None = None
        self.base = mapping_address(ring.mapping) if ring is not None else 0
        # writes wait here, not in the loop's default executor: a node that black-holes them must not starve the
        # threads that tokenize every request
        self.executor = ThreadPoolExecutor(max_workers=TRANSFER_THREADS, thread_name_prefix="kv-transfer")

    def ensure(self, local_host: str) -> TransferEngine | None:
        """The engine, started on local_host the first time; None without a ring (cpu mode: no record travels)."""
        ring = self.ring
        if self.engine is None and ring is not None:
            engine = TransferEngine(local_host, self.protocol, self.device)
            # tcp: nothing (a write's source needs no registration, so no peer of the engine's port reaches the
            # ring); rdma: the records' area, whose header page stays out of reach (remote/transfer.py)
            if not engine.windowed:
                start = ring.payload_position(0) - RECORD_HEADER
                engine.register(self.base + start, len(ring.mapping) - start)
            self.engine = engine
        return self.engine

    def payload_address(self, offset: int) -> int:
        return self.base + KVRing.payload_position(offset)

    def record_mac(self, key: bytes, request_id: str, offset: int, length: int, node_offset: int, seq: int) -> bytes:
        """The MAC (wire.record_mac) of the record of `length` bytes at `offset` in the front's ring, as it is to be
        for request_id at the node's reservation (node_offset, seq)."""
        assert self.ring is not None  # a record to sign lies in the front's ring
        start = KVRing.payload_position(offset)
        with memoryview(self.ring.mapping) as whole, whole[start:start + length] as payload:
            return wire.record_mac(key, request_id, node_offset, seq, payload)


class NodeRefused(Exception):
    """The node answered but cannot serve this front (another model or backend)."""


class RemoteNode:
    """A decode node, to the scheduler one more CPU decoder (with the slots of all the node's decoders)."""

    remote = True  # not a process of this host: the daemon's start-up and watchdog do not wait for it
    state = LifecycleState()  # changed only along NODE_MOVES (engine/lifecycle.py)

    def __init__(self, address: str, secret: bytes, spec: EngineSpec, ledger: KVLedger, fingerprint: bytes,
                 transfer: FrontTransfer, link_timeout: float = 3.0, retry: float = RETRY,
                 transfer_timeout: float = TRANSFER_TIMEOUT, front_id: str = "", ssl=None) -> None:
        self.address = address
        self.host, self.port = split_address(address, "remote_nodes")
        self.name = f"node {address}"
        self.spec = spec
        self.secret = secret
        self.ssl = ssl  # the control channel's TLS (wire.tls_context); None: plain TCP
        # who this front is to the node, the same over reconnections (a node serves several fronts at once)
        self.front_id = front_id or default_front_id()
        self.fronts = 0  # fronts the node serves now, as it last said
        self.ledger = ledger
        self.fingerprint = fingerprint
        self.transfer = transfer
        self.link_timeout, self.retry, self.transfer_timeout = link_timeout, retry, transfer_timeout
        self.lifecycle = Lifecycle(self.name, NODE_MOVES)
        self.link = "connecting"
        self.error = ""
        self.since = time.time()
        self.info: dict = {}
        self.stats = EngineStats()
        self.restarts = 0
        self.last_heartbeat = 0.0
        self.streams: dict[str, WorkerStream] = {}  # by attempt id (engine/attempts.py): what the node runs for us
        self.ready = asyncio.Event()
        self.decoders: tuple[DecoderState, ...] = ()
        self.transfers = self.transfer_failures = self.bytes_moved = self.links_lost = 0
        self._times: deque = deque(maxlen=1000)
        self._hello: NodeHello | None = None
        self._engine: TransferEngine | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._sealed: wire.Session | None = None  # the connection's framing, once it proved the secret
        self._pending: dict[str, asyncio.Future] = {}  # by attempt id: the room asked for in the node's ring
        self._tasks: set[asyncio.Task] = set()
        self._task: asyncio.Task | None = None
        self._stopping = False

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._stopping = False
        self.state = HandleState.CONNECTING
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
        self._down("was stopped", stopping=True)
        for task in list(self._tasks):
            task.cancel()
        self.transfer.executor.shutdown(wait=False, cancel_futures=True)
        self.state, self.link = HandleState.STOPPED, "stopped"

    @property
    def pid(self) -> int | None:
        return None

    async def _run(self) -> None:
        failing = ""  # the reason the last attempts failed, logged once per streak
        while not self._stopping:
            writer = None
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(
                    self.host, self.port, ssl=self.ssl, server_hostname=self.host if self.ssl else None),
                    self.link_timeout)
                sealed = await asyncio.wait_for(wire.prove_as_front(reader, writer, self.secret), self.link_timeout)
                hello = await asyncio.wait_for(sealed.read(reader), self.link_timeout)
                self._check(hello)
                self._engine = self.transfer.ensure(writer.get_extra_info("sockname")[0])
                writer.write(sealed.frame(FrontHello(self.front_id)))
                self._up(hello, writer, sealed)
                failing = ""
                pinging = asyncio.get_running_loop().create_task(self._ping(writer, sealed))
                try:
                    while True:
                        self._handle(await asyncio.wait_for(sealed.read(reader), self.link_timeout))
                finally:
                    pinging.cancel()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                why = _words(exc, self.link_timeout)
                if self.link == "up":
                    self._down(f"became unreachable ({why})")
                elif why != failing:
                    refused = isinstance(exc, (wire.AuthFailed, NodeRefused, TransferUnavailable))
                    self._set_link("refused" if refused else "down", why)
                    log.error("%s: cannot use it: %s; trying again every %gs", self.name, why, self.retry)
                failing = why
            finally:
                if writer is not None:
                    writer.close()
                self._writer = None
            await asyncio.sleep(self.retry)

    async def _ping(self, writer: asyncio.StreamWriter, sealed: wire.Session) -> None:
        """A FrontPing every PING seconds: the node drops a front it has not heard from in its link timeout."""
        while True:
            await asyncio.sleep(PING)
            if self._writer is writer:
                writer.write(sealed.frame(FrontPing()))

    def _check(self, hello) -> None:
        if not isinstance(hello, NodeHello):
            raise wire.WireError(f"the node's first message is a {type(hello).__name__}, not its hello")
        if hello.fingerprint != self.fingerprint:
            raise NodeRefused(f"it serves another model ({hello.model_name}); a front and its nodes must serve the "
                              "same GGUF")
        if hello.backend != self.spec.backend:
            raise NodeRefused(f"its decoders run backend {hello.backend!r}, this front's cpu_engine is "
                              f"{self.spec.backend!r}")
        if hello.tiled_attention != self.spec.tiled_attention:
            raise NodeRefused(f"its config has tiled_attention = {str(hello.tiled_attention).lower()} and this front's "
                              f"{str(self.spec.tiled_attention).lower()}: its decoders would give other tokens than "
                              "this host's; set the same on both")

    def _set_link(self, link: str, error: str = "") -> None:
        if link != self.link:
            self.since = time.time()
        self.link, self.error = link, error
        if link != "up":
            self.state = (HandleState.UNREACHABLE if link == "down" else HandleState.FAILED if link == "refused"
                          else self.state)
            self.ready.clear()

    def _up(self, hello: NodeHello, writer, sealed: wire.Session) -> None:
        self._hello, self._writer, self._sealed = hello, writer, sealed
        if self.links_lost:
            self.restarts += 1  # taken back after its link was lost (not a first connection after start-up tries)
        self._set_link("up")
        self._status(NodeStatus(hello.decoders))
        log.info("%s: up, %d decoders (%s), transfer engine %s", self.name, len(hello.decoders),
                 ", ".join(f"{d.name} {d.state}" for d in hello.decoders), hello.transfer_session)

    def _down(self, why: str, stopping: bool = False) -> None:
        """The link is gone: every request on the node goes on elsewhere (its journey decides)."""
        was_up = self.link == "up"
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if not stopping:
            self._set_link("down", why)
        if was_up and not stopping:
            self.links_lost += 1
            log.error("%s: %s; its %d requests go on elsewhere; dialling it every %gs", self.name, why,
                      len(self.streams), self.retry)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ConnectionError(f"the node {why}"))
        self._pending.clear()
        lost, self.streams = list(self.streams.values()), {}
        for stream in lost:
            stream.queue.put_nowait(WorkerLost(stream.request_id, f"on {self.name} {why}", stopping=stopping))

    # --- what the node sends -----------------------------------------------------------------

    def _handle(self, message) -> None:
        if isinstance(message, FromNode):
            for event in message.events:
                self._event(event)
        elif isinstance(message, NodeStatus):
            self._status(message)
        elif isinstance(message, KVReserved):
            future = self._pending.pop(message.request_id, None)
            if future is not None and not future.done():
                future.set_result(message)
            elif not message.error:
                self._send(AbortKV(message.request_id))  # it was given up on here meanwhile
        else:
            raise wire.WireError(f"a {type(message).__name__} is not a node's message")

    def _status(self, message: NodeStatus) -> None:
        self.last_heartbeat = time.monotonic()
        self.decoders = message.decoders
        ready = [d for d in message.decoders if d.state == "ready"]
        slots = sum(d.max_batch_size for d in ready) or sum(d.max_batch_size for d in message.decoders)
        if message.front_slots:  # this front's share of the node (node_front_slots)
            slots = min(slots, message.front_slots) if slots else message.front_slots
        self.fronts = message.fronts
        if slots and slots != self.spec.max_batch_size:
            self.spec = replace(self.spec, max_batch_size=slots)
        self.stats = _summed([d.stats for d in ready])
        self.info = {"cpus": sorted({c for d in message.decoders for c in d.cpus}), "node": self.address,
                     "attention": ",".join(sorted({d.attention for d in ready if d.attention})),
                     "exact_decode": bool(ready) and all(d.exact_decode for d in ready)}
        if ready:
            self.state = HandleState.READY
            self.ready.set()
        else:
            failed = message.decoders and all(d.state == "failed" for d in message.decoders)
            # failed: nothing will come back there by itself
            self.state = HandleState.FAILED if failed else HandleState.LOADING
            self.error = "every decoder of the node failed: " + "; ".join(
                f"{d.name}: {d.error}" for d in message.decoders) if failed else ""
            self.ready.clear()

    def _event(self, event) -> None:
        attempt = event.request_id
        stream = self.streams.get(attempt)
        # the request's own id from here on, as the ledger and the journey know it
        event = replace(event, request_id=stream.request_id if stream is not None else request_of(attempt))
        if isinstance(event, Imported):
            self.ledger.tell(event)  # counts it; the front's copy was freed when the write ended
        if stream is None:
            return  # an attempt given up on here (cancelled, or its link lost): what it still sends is dropped
        if isinstance(event, (Rejected, Prefilled, WorkerLost)) or (isinstance(event, Delta) and event.finish_reason):
            del self.streams[attempt]
        if isinstance(event, WorkerLost):
            event = replace(event, why=f"on {self.name} {event.why}")
        stream.queue.put_nowait(event)

    # --- requests ----------------------------------------------------------------------------

    def _send(self, message) -> None:
        if self._writer is not None and self._sealed is not None:
            self._writer.write(self._sealed.frame(message))

    def submit(self, request: GenerateRequest, handling: Handling = Handling()) -> WorkerStream:
        if self.state != HandleState.READY or self._writer is None:
            raise EngineUnavailable(f"{self.name} is {self.state}" + (f" ({self.error})" if self.error else ""))
        attempt = new_attempt(request.request_id)  # what the node knows this submission by
        stream = WorkerStream(request.request_id, self, attempt)
        self.streams[attempt] = stream
        request = replace(request, request_id=attempt)
        if handling.kv is None:
            self._send(ToNode(Submit(request, handling)))
        else:
            task = asyncio.get_running_loop().create_task(self._hand_on(request, handling, stream))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return stream

    async def _hand_on(self, request: GenerateRequest, handling: Handling, stream: WorkerStream) -> None:
        """Write the request's record into the node's ring, then send it; without the record when that fails.
        Every way out sends the Submit (the request goes on there) or ends the stream (it goes on elsewhere).
        request carries the attempt's id, which the node knows."""
        rid, kv = request.request_id, handling.kv
        assert kv is not None  # submit sends a request without a record at once
        how = Handling(kv_missing=Fallback.TRANSFER_FAILED)
        mac = b""
        reserved: KVReserved | None = None
        write = None
        started = time.monotonic()
        try:
            future = asyncio.get_running_loop().create_future()
            self._pending[rid] = future
            self._send(ReserveKV(rid, kv.length))
            room: KVReserved = await asyncio.wait_for(future, self.link_timeout)
            reserved = room
            if room.error:
                raise TransferFailed(f"the node's ring has no room: {room.error}")
            engine, hello, sealed = self._engine, self._hello, self._sealed
            if engine is None or hello is None or sealed is None:
                raise TransferFailed("the link went down")
            loop = asyncio.get_running_loop()
            write = loop.run_in_executor(
                self.transfer.executor, engine.write, hello.transfer_session,
                self.transfer.payload_address(kv.offset), room.address, kv.length)
            # the record's MAC, beside the write (both only read the front's copy): keyed for this connection, and
            # for this request on this reservation, which the node checks before a decoder may read the record
            signing = loop.run_in_executor(self.transfer.executor, self.transfer.record_mac, sealed.record_key,
                                           rid, kv.offset, kv.length, room.offset, room.seq)
            await asyncio.wait_for(asyncio.shield(write), self.transfer_timeout)
            mac = await signing
            how = replace(handling, kv=replace(kv, offset=room.offset, seq=room.seq))
            self._times.append(time.monotonic() - started)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 -- whatever failed, the request goes on without its record
            self.transfer_failures += 1
            log.warning("%s: the KV record of %s did not reach the node (%s); its decoder recomputes the prompt",
                        self.name, rid, _words(exc, self.transfer_timeout))
        finally:
            self._pending.pop(rid, None)
            self._after_write(stream, write, reserved, sent=how.kv is not None)
        if self.streams.get(rid) is not stream:  # cancelled meanwhile, or the link went down
            return
        if how.kv is not None:
            self.transfers += 1
            self.bytes_moved += kv.length
        try:
            self._send(ToNode(Submit(request, how), mac if how.kv is not None else b""))
        except Exception as exc:  # noqa: BLE001 -- cannot be framed: go on elsewhere rather than wait forever
            self.streams.pop(rid, None)
            stream.queue.put_nowait(WorkerLost(stream.request_id, f"could not be sent to {self.name} ({exc})"))

    def _after_write(self, stream: WorkerStream, write, reserved: KVReserved | None, sent: bool) -> None:
        """Once nothing writes any more (a timed-out write may still be under way in its thread): free the front's
        copy, and give the node's room back unless the Submit that commits it goes (or went) out."""
        def done(_=None) -> None:
            self.ledger.tell(SentAway(stream.request_id))
            if reserved is not None and not reserved.error and not (sent and self.streams.get(stream.attempt)
                                                                    is stream):
                self._send(AbortKV(stream.attempt))
        if write is not None and not write.done():
            write.add_done_callback(done)
        else:
            done()

    def cancel(self, attempt: str) -> None:
        """Cancel an attempt (WorkerStream.cancel): what the node still sends of it is dropped on arrival."""
        if self.streams.pop(attempt, None) is not None:
            self._send(Cancel(attempt))

    @property
    def in_flight(self) -> int:
        return len(self.streams)

    @property
    def generating(self) -> int:
        return len(self.streams)

    def status(self) -> WorkerStatus:
        return WorkerStatus(name=self.name, backend=self.spec.backend, role=str(self.spec.role), pool=self.spec.pool,
                            state=self.state, pid=None, error=self.error, restarts=self.restarts, hangs=0,
                            in_flight=self.in_flight, cpus=list(self.info.get("cpus", [])),
                            threads=sum(d.threads for d in self.decoders), stats=self.stats)

    def set_log_level(self, level: str) -> None:
        pass  # the node's own config sets its workers' log level

    def link_status(self) -> RemoteNodeStatus:
        decoders = [NodeDecoderStatus(d.name, d.state, d.in_flight, d.max_batch_size, d.threads, list(d.cpus), d.error)
                    for d in self.decoders]
        return RemoteNodeStatus(self.address, self.link, self.error, self.since, decoders, self.in_flight,
                                self.transfers, self.transfer_failures, self.bytes_moved, Quantiles.of(self._times),
                                self.links_lost, self.fronts, self.spec.max_batch_size)


def default_front_id() -> str:
    """This front daemon's name to its nodes: its host and process, and a nonce (a restarted front is a new one)."""
    import socket
    import uuid

    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _summed(stats: list[EngineStats]) -> EngineStats:
    if not stats:
        return EngineStats()
    total = {}
    for name in EngineStats.__dataclass_fields__:
        values = [getattr(s, name) for s in stats]
        total[name] = max(values) if name in ("n_ctx", "kv_usage") else sum(values)
    return EngineStats(**total)


def _words(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return f"no answer within {timeout:g}s"
    if isinstance(exc, asyncio.IncompleteReadError):
        return "the connection closed"
    return str(exc) or type(exc).__name__
