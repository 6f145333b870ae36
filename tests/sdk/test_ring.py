"""The shared-memory KV ring against real /dev/shm segments and real processes."""

import os
import random
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from syshaxd.sdk.kv.ring import (KVRing, RingError, RingFull, StaleRecord, ring_path,
                             sweep_stale)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def instance(request):
    """A segment name no other test or daemon uses; whatever is left of it is removed afterwards."""
    name = f"test{os.getpid()}-{request.node.name[:40]}"
    yield name
    ring_path(name).unlink(missing_ok=True)


def payload(seq: int, size: int) -> bytes:
    return random.Random(seq).randbytes(size)


def spawn(code: str) -> subprocess.Popen:
    """A separate Python process running code, talking back over its stdout."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)


def wait_until_zombie(pid: int) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} did not die")


def test_wraparound_over_200_handoffs_with_every_payload_verified(instance):
    rng = random.Random(7)
    with KVRing.create(instance, 32 * 1024) as ring, KVRing.attach(instance) as reader:
        outstanding = []  # (offset, seq, size)

        def consume_one():
            off, s, n = outstanding.pop(rng.randrange(len(outstanding)))  # out of order on purpose
            assert bytes(reader.read(off)) == payload(s, n)
            reader.release(off)

        for seq in range(200):
            size = rng.choice([1, 63, 64, 65, 1000, rng.randrange(1, 20_000)])
            while True:
                try:
                    res = ring.reserve(size)
                    break
                except RingFull:
                    consume_one()
            res.view[:] = payload(seq, size)
            outstanding.append((res.commit(), seq, size))
            if len(outstanding) > rng.randrange(1, 5):
                consume_one()
        for off, s, n in outstanding:
            assert bytes(reader.read(off)) == payload(s, n)
            reader.release(off)
        st = ring.stats()
        assert st.records_written == 200 and st.records_released == 200
        assert st.used_bytes == 0 and st.records_skipped == 0
        assert st.bytes_written > 5 * st.capacity  # wrapped many times
        assert reader.stats().records_read == 200


def test_out_of_order_release_is_remembered_until_the_tail_reaches_it(instance):
    with KVRing.create(instance, 8192) as ring:
        a, b, c = (ring.write(bytes([i]) * 100) for i in range(3))
        used = ring.stats().used_bytes
        ring.release(b)
        assert ring.stats().used_bytes == used  # a still holds the tail
        assert [r.state for r in ring.records()] == ["committed", "released", "committed"]
        ring.release(a)
        assert [r.offset for r in ring.records()] == [c]
        ring.release(c)
        assert ring.stats().used_bytes == 0
        with pytest.raises(RingError, match="cannot release"):
            ring.release(c)


def test_a_record_that_does_not_fit_before_the_end_wraps_to_offset_zero(instance):
    with KVRing.create(instance, 8192) as ring:
        first = ring.write(b"a" * 5000)
        ring.release(first)
        second = ring.write(b"b" * 5000)  # 5064 bytes from offset 5120 would run past 8192
        assert second == 0
        assert bytes(ring.read(second)) == b"b" * 5000


def test_reading_an_uncommitted_offset_is_refused(instance):
    with KVRing.create(instance, 8192) as ring:
        res = ring.reserve(100)
        with pytest.raises(RingError, match="state reserved"):
            ring.read(res.offset)
        with pytest.raises(RingError, match="not a record offset"):
            ring.read(3)


def test_a_full_ring_makes_the_producer_wait_then_raise_at_the_deadline(instance):
    with KVRing.create(instance, 8192) as ring:
        offsets = [ring.write(b"x" * 1900) for _ in range(4)]
        t0 = time.monotonic()
        with pytest.raises(RingFull, match="bytes in use"):
            ring.reserve(1900, timeout=0.2)
        waited = time.monotonic() - t0
        assert 0.2 <= waited < 1.0
        with pytest.raises(RingFull, match="can never fit"):
            ring.reserve(9000, timeout=5.0)  # raises at once: waiting cannot help
        assert ring.stats().used_bytes == 4 * 1984


def test_a_full_ring_succeeds_when_space_frees_before_the_deadline(instance):
    with KVRing.create(instance, 8192) as ring, KVRing.attach(instance) as consumer:
        offsets = [ring.write(b"x" * 1900) for _ in range(4)]
        releaser = threading.Timer(0.1, consumer.release, args=(offsets[0],))
        releaser.start()
        t0 = time.monotonic()
        res = ring.reserve(1900, timeout=3.0)
        waited = time.monotonic() - t0
        releaser.join()
        assert 0.09 <= waited < 2.0
        res.view[:] = b"y" * 1900
        assert bytes(consumer.read(res.commit())) == b"y" * 1900


def test_a_producer_killed_mid_write_does_not_wedge_the_ring(instance):
    capacity = 32 * 1024
    with KVRing.create(instance, capacity) as ring:
        producer = spawn(f"""
            import time
            from syshaxd.sdk.kv.ring import KVRing
            ring = KVRing.attach({instance!r})
            print(ring.write(b"before" * 100), flush=True)
            res = ring.reserve(10_000)
            res.view[:5000] = b"h" * 5000   # half written, never committed
            print(res.offset, flush=True)
            time.sleep(60)
        """)
        try:
            before = int(producer.stdout.readline())
            stalled = int(producer.stdout.readline())
            assert bytes(ring.read(before)) == b"before" * 100
            # while the producer lives its record holds the tail; another producer writes after it (a pool of
            # prefill engines shares one ring), and its records free once the stalled one is skipped
            ring.release(before)
            assert [r.state for r in ring.records()] == ["reserved"]
            beside = ring.write(b"beside")
            assert bytes(ring.read(beside)) == b"beside"
            ring.release(beside)
            assert [r.state for r in ring.records()] == ["reserved", "released"]
            with pytest.raises(RingError, match="state reserved"):
                ring.read(stalled)

            producer.send_signal(signal.SIGKILL)
            wait_until_zombie(producer.pid)  # not reaped: a zombie must count as dead too
            with KVRing.attach(instance) as consumer:
                seq = 0
                while ring.stats().bytes_written < 3 * capacity:
                    off = ring.write(payload(seq, 3000), timeout=1.0)
                    assert bytes(consumer.read(off)) == payload(seq, 3000)
                    consumer.release(off)
                    seq += 1
            st = ring.stats()
            assert st.records_skipped == 1
            assert st.used_bytes == 0
            assert st.writer_pid == os.getpid()
        finally:
            producer.kill()
            producer.wait()


def test_the_owner_can_reset_a_ring_whose_producer_died(instance):
    with KVRing.create(instance, 8192) as ring:
        producer = spawn(f"""
            import os
            from syshaxd.sdk.kv.ring import KVRing
            ring = KVRing.attach({instance!r})
            print(ring.write(b"z" * 3000), flush=True)   # committed, but never reported to anyone
            ring.reserve(3000)
            os._exit(0)
        """)
        orphan = int(producer.stdout.readline())
        producer.wait()
        assert ring.reclaim() == 0  # the committed record still holds the tail
        assert [r.state for r in ring.records()] == ["committed", "reserved"]
        ring.reset()
        st = ring.stats()
        assert (st.used_bytes, st.generation, st.records_skipped) == (0, 1, 2)
        with pytest.raises(StaleRecord):
            ring.read(orphan)
        assert bytes(ring.read(ring.write(b"after"))) == b"after"


def test_segment_is_private_and_unlink_leaves_nothing(instance):
    path = ring_path(instance)
    with KVRing.create(instance, 8192) as ring:
        assert ring.path == path == Path(f"/dev/shm/syshax-{instance}-kv")
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        with pytest.raises(FileExistsError, match="sweep_stale"):
            KVRing.create(instance, 8192)
        view = ring.read(ring.write(b"kept alive"))
    assert not path.exists()
    assert bytes(view) == b"kept alive"  # a view outlives the handle; the mapping goes with it


def test_sweep_stale_removes_a_dead_owners_segment_and_keeps_a_live_one(instance):
    prefix = f"syshax-{instance}"
    live_name, dead_name = f"{instance}-live", f"{instance}-dead"
    dead = spawn(f"""
        import os
        from syshaxd.sdk.kv.ring import KVRing
        KVRing.create({dead_name!r}, 8192)
        os.kill(os.getpid(), 9)   # like a daemon killed with -9: the segment stays behind
    """)
    dead.wait()
    try:
        assert ring_path(dead_name).exists()
        with KVRing.create(live_name, 8192) as live:
            assert sweep_stale(prefix) == [ring_path(dead_name)]
            assert not ring_path(dead_name).exists()
            assert live.path.exists()
            assert sweep_stale(prefix) == []
    finally:
        ring_path(dead_name).unlink(missing_ok=True)
        ring_path(live_name).unlink(missing_ok=True)


def test_capacity_and_instance_are_validated(instance):
    with pytest.raises(ValueError, match="capacity=1000"):
        KVRing.create(instance, 1000)
    with pytest.raises(ValueError, match="instance="):
        KVRing.create("../etc", 8192)


def test_attach_refuses_what_is_not_a_ring(instance):
    path = ring_path(instance)
    path.write_bytes(b"not a ring at all")
    with pytest.raises(RingError, match="not a syshax KV ring"):
        KVRing.attach(instance)
    with pytest.raises(FileNotFoundError):
        KVRing.attach(instance + "-missing")


def test_an_aborted_reservation_gives_its_space_back(instance):
    with KVRing.create(instance, 8192) as ring:
        res = ring.reserve(3000)
        res.abort()
        with pytest.raises(RingError, match="already"):
            res.commit()
        kept = ring.reserve(3000)
        kept.view[:] = b"k" * 3000
        offset = kept.commit()
        assert bytes(ring.read(offset, seq=kept.seq)) == b"k" * 3000
        with pytest.raises(StaleRecord, match="holds record"):
            ring.read(offset, seq=kept.seq + 1)
        ring.release(offset)
        st = ring.stats()
        assert (st.used_bytes, st.records_skipped, st.records_released) == (0, 1, 1)


def test_records_a_dead_producer_committed_but_never_handed_on_are_freed(instance):
    # The daemon's side: a KV producer commits two records, reports one (a hetero request holds it) and dies
    # before reporting the other. The ledger frees the unreported one so the ring's tail does not stick.
    from syshaxd.engine.kv_ledger import Dropped, KVLedger, Lent, Written
    from syshaxd.sdk.types import Imported, KVHandle

    with KVRing.create(instance, 64 * 1024) as ring:
        producer = spawn(f"""
            from syshaxd.sdk.kv.ring import KVRing
            ring = KVRing.attach({instance!r})
            print(ring.write(b"told" * 1000), ring.write(b"lost" * 1000), flush=True)
        """)
        told, lost = map(int, producer.stdout.readline().split())
        assert producer.wait(10) == 0
        ledger = KVLedger(ring)
        ledger.tell(Written("req-1", KVHandle(told, 4000, 0, 0, 1, 0, 0.0), producer.pid))
        assert ledger.release_orphans(producer.pid) == 1
        assert [(r.offset, r.state) for r in ring.records()] == [(told, "committed"), (lost, "released")]
        assert ledger.status().orphans_released == 1
        assert ledger.release_orphans(producer.pid + 1) == 0  # another writer's records are not touched
        ledger.tell(Lent("req-1", "decode0"))
        ledger.tell(Dropped("req-1"))  # cancelled while its decoder reads it: the space stays until it reports
        assert ring.stats().used_bytes > 0
        ledger.tell(Imported("req-1", False, reason="cancelled"))
        assert ring.stats().used_bytes == 0 and ledger.held() == 0


def test_the_ledger_frees_a_record_on_the_events_it_is_told(instance):
    # each event the ledger takes, on records in a real ring: a record goes only when nobody holds or reads it
    import asyncio

    from syshaxd.engine.kv_ledger import Dropped, KVLedger, Lent, SentAway, WentWithout, WorkerGone, Written
    from syshaxd.sdk.types import Fallback, KVHandle

    async def run(ring: KVRing) -> None:
        ledger = KVLedger(ring, orphan_grace=60)
        a, b = ring.write(b"a" * 4000), ring.write(b"b" * 4000)
        ledger.tell(Written("req-a", KVHandle(a, 4000, 0, 0, 1, 0, 0.0), os.getpid()))
        ledger.tell(Written("req-b", KVHandle(b, 4000, 0, 0, 1, 0, 0.0), os.getpid()))
        ledger.tell(Lent("req-a", "decode0"))
        ledger.tell(WorkerGone("decode0", 999_999))  # its reader died; the request still holds it
        assert ledger.held() == 2
        ledger.tell(Dropped("req-a"))
        assert ledger.held() == 1 and [r.offset for r in ring.records() if r.state == "committed"] == [b]
        ledger.tell(Lent("req-b", "node 10.0.0.2:8701"))
        ledger.tell(SentAway("req-b"))  # copied to another host: this copy goes though it was lent
        assert ledger.held() == 0 and ring.stats().used_bytes == 0
        ledger.tell(WentWithout(Fallback.PREFILL_UNAVAILABLE))
        status = ledger.status()
        assert (status.records_written, status.fallbacks) == (2, {"prefill_unavailable": 1})
        with pytest.raises(TypeError, match="not told str"):
            ledger.tell("req-a")  # type: ignore[arg-type]

    with KVRing.create(instance, 64 * 1024) as ring:
        asyncio.run(run(ring))


def test_the_ledger_is_told_through_one_door():
    # every change of a KV record follows an event given to KVLedger.tell; what else the daemon calls on a ledger
    # only asks (a prefix plan, a status): a new method that changes records would be a second door
    import re

    asks = {"tell", "plan_prefix", "prefix_from_disk", "status", "prefix_status", "held"}
    root = Path(__file__).resolve().parents[2] / "syshaxd"
    calls = {(path.name, m.group(1)) for path in root.rglob("*.py") if path.name != "kv_ledger.py"
             for m in re.finditer(r"ledger\.(\w+)\(", path.read_text())}
    assert calls and {name for _, name in calls} <= asks, sorted(c for c in calls if c[1] not in asks)


def test_two_producers_write_one_ring_at_once_and_every_record_is_whole(instance):
    """A pool of prefill engines shares the ring: two processes writing 300 records each, interleaved, read back
    byte for byte and released out of order."""
    with KVRing.create(instance, 64 * 1024) as ring:
        producers = [spawn(f"""
            from syshaxd.sdk.kv.ring import KVRing
            ring = KVRing.attach({instance!r})
            for seq in range(300):
                data = (b"%d:%d;" % ({k}, seq)) * (50 + seq % 200)
                print(ring.write(data, timeout=30.0), {k}, seq, flush=True)
        """) for k in (1, 2)]
        try:
            import queue
            import threading

            lines: queue.Queue = queue.Queue()
            for p in producers:  # each producer's reports as they come, whichever writes first
                threading.Thread(target=lambda out=p.stdout: [lines.put(x) for x in out], daemon=True).start()
            pending, got, deadline = [], 0, time.monotonic() + 120
            while got < 600:
                assert time.monotonic() < deadline, f"{got} of 600 records read"
                try:
                    line = lines.get(timeout=0.5)
                except queue.Empty:
                    # the lines come in the order the producers print them, not the ring's: a record held here may
                    # be the oldest, and the tail waits on it, so while nothing comes, every held one is released
                    for off in pending:
                        ring.release(off)
                    pending = []
                    continue
                off, k, seq = map(int, line.split())
                assert bytes(ring.read(off)) == (b"%d:%d;" % (k, seq)) * (50 + seq % 200)
                got += 1
                pending.append(off)
                if len(pending) > 3:  # released a little out of order: the second, then the first
                    ring.release(pending.pop(1))
                    ring.release(pending.pop(0))
            for off in pending:
                ring.release(off)
            assert ring.stats().records_written == 600 and ring.stats().used_bytes == 0
        finally:
            for p in producers:
                p.kill()
                p.wait()
