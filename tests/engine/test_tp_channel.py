"""The shared-memory channel of the request stream: one writer, several readers in other processes; every reader
gets every message in order, large ones in parts, until the stop; the writer never overwrites an unread part."""

import hashlib
import random

import pytest
import torch.multiprocessing as mp

from specmla.engine.tp_channel import ShmChannel

pytestmark = pytest.mark.skipif(not ShmChannel.available(), reason="the shared-memory channel is x86-64 only")


def messages(n=60, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        size = rng.choice([0, 0, 1, 17, 100, 255, 256, 257, 1000, 5000])  # around the 256-byte capacity below
        out.append(bytes(rng.randrange(256) for _ in range(size)))
    return out


def _reader(path, readers, rank, q):
    ch = ShmChannel.attach(path, readers, rank)
    digests = []
    while (msg := ch.recv()) is not None:
        digests.append(hashlib.sha256(msg).hexdigest())
    ch.close()
    q.put((rank, digests))


def test_every_reader_gets_every_message_in_order_then_the_stop():
    readers = 3
    ch = ShmChannel.create(readers, capacity=256)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_reader, args=(ch.path, readers, r, q), daemon=True) for r in range(1, readers + 1)]
    for p in procs:
        p.start()
    msgs = messages()
    try:
        for m in msgs:  # far more bytes than the slot: the writer must wait for the readers' acks
            ch.send(m)
        ch.send(None)
        got = dict(q.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        ch.unlink()
        ch.close()
    want = [hashlib.sha256(m).hexdigest() for m in msgs]
    assert got == {r: want for r in range(1, readers + 1)}
    assert all(p.exitcode == 0 for p in procs)


def test_unlink_after_attach_keeps_the_mapping():
    ch = ShmChannel.create(1, capacity=64)
    other = ShmChannel.attach(ch.path, 1, 1)
    assert other.capacity == 64
    ch.unlink()
    ch.send(b"still here")
    assert other.recv() == b"still here"
    ch.unlink()  # a second unlink is harmless
    ch.close()
    other.close()


def test_the_writer_waits_for_every_reader_before_reusing_the_slot():
    """Message 2 is not published (seq stays 1, the slot keeps message 1) until the slower of two readers has
    copied message 1 out; then both readers get message 2."""
    import threading

    ch = ShmChannel.create(2, capacity=64)
    r1, r2 = ShmChannel.attach(ch.path, 2, 1), ShmChannel.attach(ch.path, 2, 2)
    ch.unlink()
    ch.send(b"first")
    assert r1.recv() == b"first"
    t = threading.Thread(target=ch.send, args=(b"second",))
    t.start()
    t.join(timeout=0.2)
    assert t.is_alive() and ch._word(0) == 1  # waiting for reader 2's ack
    assert r2.recv() == b"first"  # the slot still holds message 1
    t.join(timeout=10)
    assert not t.is_alive()
    assert r1.recv() == b"second" and r2.recv() == b"second"
    for c in (ch, r1, r2):
        c.close()


def test_a_dead_reader_makes_the_writer_raise_instead_of_waiting_forever():
    alive = [True]
    ch = ShmChannel.create(1, capacity=64, alive=lambda: alive[0])
    ch.unlink()
    ch.send(b"one")  # never read
    alive[0] = False
    with pytest.raises(RuntimeError, match="exited without reading"):
        ch.send(b"two")
    ch.close()


def test_attach_checks_the_rank():
    ch = ShmChannel.create(2, capacity=64)
    try:
        with pytest.raises(ValueError, match="rank 3 of 2 readers"):
            ShmChannel.attach(ch.path, 2, 3)
    finally:
        ch.unlink()
        ch.close()
