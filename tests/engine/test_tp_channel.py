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
    procs = [ctx.Process(target=_reader, args=(ch.path, readers, r, q)) for r in range(1, readers + 1)]
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
