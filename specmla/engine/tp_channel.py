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
    needs stores to become visible in program order, as on x86-64 (`available()`). A message longer than
    `capacity` goes in parts (more = 1 on all but the last). Before writing part n + 1, rank 0 waits until every
    reader's ack equals n: a reader acks once it has copied a part out, so a slot is never overwritten under a
    reader. A waiting rank polls with sched_yield for SPIN_S, then sleeps in growing steps up to 1 ms (an idle
    server does not hold a core per rank; the first message after idle waits up to 1 ms). `alive()`, when given,
    is asked while rank 0 waits for acks: False (a reader died) raises instead of waiting forever."""

    HEADER_WORDS = 3
    SPIN_S = 5e-3  # rank 0's host work between two steps fits in it: a worker sees the next step at once

    @staticmethod
    def available() -> bool:
        """x86-64 only: its stores become visible to other cores in program order (TSO), which the protocol needs
        without explicit fences (plain Python has none)."""
        return platform.machine().lower() in ("x86_64", "amd64")

    def __init__(self, path: str, fd: int, readers: int, rank: int, capacity: int, create: bool, alive=None):
        if not 0 <= rank <= readers or (rank == 0) != create:
            raise ValueError(f"ShmChannel: rank {rank} of {readers} readers (rank 0 creates, 1..readers attach)")
        self.path, self.readers, self.rank, self._alive = path, readers, rank, alive
        self._payload = 8 * (self.HEADER_WORDS + readers)
        try:
            if create:  # the blocks now, not at the first write (a full /dev/shm would then be a SIGBUS)
                os.posix_fallocate(fd, 0, self._payload + capacity)
            size = os.fstat(fd).st_size  # a reader takes the writer's capacity from the file
            self.capacity = size - self._payload
            self._mem = mmap.mmap(fd, size)
        except BaseException:
            if create:
                self.unlink()
            raise
        finally:
            os.close(fd)
        self._seq = 0  # the last sequence number this rank wrote or read

    @classmethod
    def create(cls, readers: int, capacity: int = 1 << 22, alive=None) -> "ShmChannel":
        """Rank 0's end, in a new file under /dev/shm (the temp dir where there is none); OSError when it cannot
        be made (the caller then uses the gloo channel)."""
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="specmla-tp-", dir=folder)  # created exclusively, mode 0600
        return cls(path, fd, readers, 0, capacity, create=True, alive=alive)

    @classmethod
    def attach(cls, path: str, readers: int, rank: int) -> "ShmChannel":
        """A reader's end (rank 1..readers) of rank 0's channel (its capacity is the file's)."""
        return cls(path, os.open(path, os.O_RDWR), readers, rank, 0, create=False)

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

    def _wait(self, ready, check_alive: bool = False) -> None:
        start, pause = time.perf_counter(), 0.0
        while not ready():
            if time.perf_counter() - start < self.SPIN_S:
                os.sched_yield()  # returns at once on an idle core; lets the other ranks run on a busy one
                continue
            if check_alive and self._alive is not None and not self._alive():
                raise RuntimeError("a tensor-parallel rank exited without reading rank 0's message")
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
            self._wait(lambda: all(self._word(self.HEADER_WORDS + r) == seq for r in range(self.readers)),
                       check_alive=True)
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
