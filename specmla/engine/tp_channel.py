"""Channels that carry rank 0's request stream to the other tensor-parallel ranks, one message per engine step.

- `ShmChannel` (ranks on one host, the spawned workers): a shared-memory mailbox. Rank 0 copies the message in and
  publishes it by bumping a sequence number; each worker polls that number, copies the message out and acks it. A
  send costs a memcpy and a few stores, where a gloo broadcast over loopback TCP costs a round trip (about 0.1 ms on
  2 ranks, more on 4) at the start of every step.
- `GlooChannel` (any hosts, torchrun): `distributed.broadcast_bytes` over the gloo group.

Both: `send(data)` on rank 0 (b"" for a step with nothing new), `send(None)` to stop; `recv()` on the others returns
the bytes, or None for the stop.
"""

from __future__ import annotations

import mmap
import os
import platform
import struct
import tempfile
import time

from specmla.distributed import broadcast_bytes

_I64 = struct.Struct("<q")
_STOP = -1


class GlooChannel:
    """The request stream over the gloo group: works across hosts."""

    def send(self, data: bytes | None) -> None:
        broadcast_bytes(data, stop=data is None)

    def recv(self) -> bytes | None:
        return broadcast_bytes()

    def close(self) -> None:
        pass


class ShmChannel:
    """One writer (rank 0), `readers` readers, over a file mapped in shared memory.

    Layout (little-endian int64 words, then bytes): [seq][length][more][ack_1 .. ack_readers][payload: capacity].
    Rank 0 writes the payload, the length and the more-flag, then seq + 1 last; readers look at seq first. That
    needs stores to become visible in program order, as on x86-64 (`available()`). A message longer than `capacity` goes in parts (more = 1 on all but
    the last). Before writing part n + 1, rank 0 waits until every reader's ack equals n: a reader acks once it has
    copied a part out, so a slot is never overwritten under a reader. A waiting rank polls with sched_yield for about
    a thousand polls, then sleeps in growing steps up to 1 ms (an idle server does not hold a core per rank)."""

    HEADER_WORDS = 3

    @staticmethod
    def available() -> bool:
        """x86-64 only: its stores become visible to other cores in program order (TSO), which the protocol needs
        without explicit fences (plain Python has none)."""
        return platform.machine().lower() in ("x86_64", "amd64")

    def __init__(self, path: str, readers: int, rank: int, capacity: int, create: bool):
        self.path, self.readers, self.rank = path, readers, rank
        self._payload = 8 * (self.HEADER_WORDS + readers)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, self._payload + capacity)
            size = os.fstat(fd).st_size  # a reader takes the writer's capacity from the file
            self.capacity = size - self._payload
            self._mem = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._seq = 0  # the last sequence number this rank wrote or read

    @classmethod
    def create(cls, readers: int, capacity: int = 1 << 22) -> "ShmChannel":
        """Rank 0's end, in a new file under /dev/shm (the temp dir where there is none)."""
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="specmla-tp-", dir=folder)
        os.close(fd)
        os.unlink(path)  # re-created exclusively below
        return cls(path, readers, 0, capacity, create=True)

    @classmethod
    def attach(cls, path: str, readers: int, rank: int) -> "ShmChannel":
        """A reader's end (rank ≥ 1) of rank 0's channel (its capacity is the file's)."""
        return cls(path, readers, rank, 0, create=False)

    def unlink(self) -> None:
        """Remove the file once every reader has attached (the mappings stay); nothing is left behind on a crash."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _word(self, i: int) -> int:
        return _I64.unpack_from(self._mem, 8 * i)[0]

    def _set(self, i: int, v: int) -> None:
        _I64.pack_into(self._mem, 8 * i, v)

    def _wait(self, ready) -> None:
        polls, pause = 0, 0.0
        while not ready():
            polls += 1
            if polls <= 1000:
                os.sched_yield()  # returns at once on an idle core; lets the other ranks run on a busy one
            else:
                pause = min(1e-3, max(2e-5, pause * 2))
                time.sleep(pause)

    def send(self, data: bytes | None) -> None:
        """Publish one message (None: stop); returns once it is written, without waiting for the readers."""
        view = memoryview(b"" if data is None else data)
        first = True
        while first or len(view):
            first = False
            part, view = view[: self.capacity], view[self.capacity :]
            seq = self._seq
            self._wait(lambda: all(self._word(self.HEADER_WORDS + r) == seq for r in range(self.readers)))
            self._mem[self._payload : self._payload + len(part)] = part
            self._set(1, _STOP if data is None else len(part))
            self._set(2, 1 if len(view) else 0)
            self._set(0, seq + 1)
            self._seq = seq + 1

    def recv(self) -> bytes | None:
        """The next message (b"" for an empty one), or None for a stop."""
        parts = []
        while True:
            want = self._seq + 1
            self._wait(lambda: self._word(0) >= want)
            n, more = self._word(1), self._word(2)
            chunk = b"" if n <= 0 else bytes(self._mem[self._payload : self._payload + n])
            self._seq = want
            self._set(self.HEADER_WORDS + self.rank - 1, want)  # ack: the slot may be reused
            if n == _STOP:
                return None
            parts.append(chunk)
            if not more:
                return b"".join(parts)

    def close(self) -> None:
        self._mem.close()
