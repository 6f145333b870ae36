"""The daemon's end of a worker's pipe: whole messages in and out, and the event loop never blocks on it.

The event loop keeps the pipe non-blocking (uvloop sets O_NONBLOCK on any fd it watches), and a
plain ``multiprocessing.Connection`` cannot live with that: ``send`` of a message larger than the
socket buffer (a 1 MB prompt) raises BlockingIOError halfway and leaves half a message in the pipe,
and ``recv`` of a message that has only partly arrived fails the same way. Both wedge the worker.

So this end frames messages exactly as ``Connection`` does -- a 4-byte big-endian length (or -1 and
an 8-byte one), then the pickle -- which lets the worker keep its plain blocking Connection, and:

* ``send`` pickles the message first (a message that cannot be pickled fails alone, nothing is
  written), then writes what the pipe takes now and keeps the rest in its own buffer, which the
  loop flushes as the worker reads: every message goes whole, in order, or the channel is closed;
* reads collect bytes until a frame is whole, then hand the message on.

The buffer is bounded (``max_buffered``): past it a send is refused before any byte of it is
queued, so one client cannot make the daemon hold unbounded memory for a worker that reads slowly.
"""

from __future__ import annotations

import logging
import os
import pickle
import struct
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler

log = logging.getLogger(__name__)

READ_CHUNK = 1 << 20
MAX_BUFFERED = 64 << 20  # bytes queued for a worker before sends are refused


class ChannelFull(RuntimeError):
    """The worker has not read what was sent before; this message was not queued."""


class ChannelClosed(RuntimeError):
    """The pipe broke (the worker died or closed it)."""


def frame(message) -> bytes:
    """The message as Connection.send writes it: length header, then the pickle."""
    data = bytes(ForkingPickler.dumps(message))
    n = len(data)
    header = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!i", -1) + struct.pack("!Q", n)
    return header + data


class WorkerChannel:
    """One worker's pipe, driven by the event loop: `send` never blocks, `on_message` gets each whole message."""

    def __init__(self, fd: int, loop, on_message: Callable[[object], None], on_closed: Callable[[str], None],
                 max_buffered: int = MAX_BUFFERED) -> None:
        self.fd = fd
        self._loop = loop
        self._on_message = on_message
        self._on_closed = on_closed
        self.max_buffered = max_buffered
        self._out = bytearray()
        self._in = bytearray()
        self._writing = False
        self.closed = False
        self.bytes_sent = 0
        self.bytes_received = 0
        os.set_blocking(fd, False)
        loop.add_reader(fd, self._on_readable)

    # --- out ------------------------------------------------------------------------------------

    @property
    def buffered(self) -> int:
        return len(self._out)

    def send(self, message, *, bounded: bool = True) -> None:
        """Queue the whole message; raises ChannelClosed, or ChannelFull (then nothing of it was queued).

        bounded=False for the small control messages (cancel, shutdown) that must never be refused.
        """
        if self.closed:
            raise ChannelClosed("the worker's pipe is closed")
        data = frame(message)  # pickling errors surface here, before any byte is queued
        if bounded and self._out and len(self._out) + len(data) > self.max_buffered:
            raise ChannelFull(f"{len(self._out)} bytes still wait for the worker to read them")
        self._out += data
        self._flush()

    def _flush(self) -> None:
        while self._out and not self.closed:
            try:
                n = os.write(self.fd, self._out[:READ_CHUNK])
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:  # EPIPE, ECONNRESET: the worker is gone
                self._close(f"write failed: {exc}")
                return
            del self._out[:n]
            self.bytes_sent += n
        want = bool(self._out) and not self.closed
        if want and not self._writing:
            self._loop.add_writer(self.fd, self._flush)
            self._writing = True
        elif not want and self._writing:
            self._loop.remove_writer(self.fd)
            self._writing = False

    # --- in -------------------------------------------------------------------------------------

    def _on_readable(self) -> None:
        while not self.closed:
            try:
                chunk = os.read(self.fd, READ_CHUNK)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._close(f"read failed: {exc}")
                return
            if not chunk:
                self._close("the worker closed its end")
                return
            self.bytes_received += len(chunk)
            self._in += chunk
        for message in self._frames():
            self._on_message(message)

    def _frames(self):
        """Whole messages at the front of the input buffer, removed from it."""
        buf = self._in
        messages = []
        while len(buf) >= 4:
            (size,) = struct.unpack_from("!i", buf)
            start = 4
            if size == -1:
                if len(buf) < 12:
                    break
                (size,) = struct.unpack_from("!Q", buf, 4)
                start = 12
            if len(buf) < start + size:
                break
            messages.append(pickle.loads(bytes(buf[start:start + size])))
            del buf[:start + size]
        return messages

    def drain(self) -> None:
        """Read and deliver whatever the worker already sent (before its death is handled)."""
        if not self.closed:
            self._on_readable()

    # --- end ------------------------------------------------------------------------------------

    def _close(self, why: str) -> None:
        if self.closed:
            return
        self.detach()
        self._on_closed(why)

    def detach(self) -> None:
        """Stop watching the fd (the caller closes it)."""
        if self.closed:
            return
        self.closed = True
        self._loop.remove_reader(self.fd)
        if self._writing:
            self._loop.remove_writer(self.fd)
            self._writing = False
        self._out.clear()
