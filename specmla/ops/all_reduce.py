"""One-shot all-reduce over buffers every rank of one host can write (Triton kernel + torch reference).

A decode step's all-reduces move a few KB each (B tokens × hidden), so their cost is latency, and a general
collective (NCCL's ring) spends several round trips on it. Here each rank's program `p` (a BLOCK-element chunk):

1. reads its chunk of x and stores it straight into every peer's buffer, in the region of (this call's parity,
   this rank, p) (a write over NVLink, no copy into a staging buffer first);
2. after a CTA barrier, publishes the call's epoch in each peer's flag [rank, p] (release, system scope);
3. waits until every peer's epoch in its own flags [peer, p] reaches this call's (acquire, system scope);
4. sums the ranks' chunks in rank order (fp32) and writes the sum over x.

The epoch is a per-program counter that every rank advances identically (every rank makes the same calls in
the same order, in eager code and in CUDA-graph replays alike), so flags never need resetting. Two slots
suffice: a peer can only reach call e + 2, which writes slot e % 2 again, after this rank published epoch
e + 1, i.e. after this rank's call e finished reading. Each (slot, rank, program) owns the same bytes whatever
the call's dtype (BLOCK · 4 bytes), so that argument holds per program across calls of any dtypes and sizes.
Summing in rank order gives every rank the same bits, which tensor parallelism needs: each rank samples from its
own copy of the logits.

`PeerBuffers` holds one rank's view of the buffers (on GPUs, `specmla.distributed` maps one allocation of
`symmetric_bytes(world)` per rank in torch's symmetric memory and `PeerBuffers.split` cuts it into flags and
data). Both implementations take the same arguments and follow the same protocol, so a rank running one can
pair with a rank running the other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK = 4096  # elements per program
MAX_PROGRAMS = 64  # programs of one call at most: all of them fit on the GPU at once, so none waits on a
# peer program that cannot be scheduled
MAX_WORLD = 8


@dataclass
class PeerBuffers:
    """One rank's view of the one-shot all-reduce buffers.

    data[r]: rank r's data buffer as mapped in this process, raw bytes: [2 slots, world, MAX_PROGRAMS] regions
    of BLOCK · 4 bytes, each holding one program's chunk in the call's dtype; flags[r]: rank r's epochs
    [world, MAX_PROGRAMS] int64 (entry [s, p]: the last epoch rank s published for program p); counters: this
    rank's own epochs [MAX_PROGRAMS] int64, local."""

    rank: int
    data: list[torch.Tensor]
    flags: list[torch.Tensor]
    counters: torch.Tensor

    @classmethod
    def split(cls, rank: int, raw: list[torch.Tensor]) -> "PeerBuffers":
        """The view over rank r's raw byte buffer raw[r] (as mapped in this process, `symmetric_bytes(world)`
        long, its flag bytes zero): flags first, then data; this rank's counters start at zero."""
        world, nflag = len(raw), len(raw) * MAX_PROGRAMS * 8
        if any(b.dtype != torch.uint8 or b.numel() < symmetric_bytes(world) for b in raw):
            raise ValueError(f"each rank's buffer must hold {symmetric_bytes(world)} bytes (uint8)")
        return cls(rank, [b[nflag: nflag + _data_bytes(world)] for b in raw],
                   [b[:nflag].view(torch.int64).view(world, MAX_PROGRAMS) for b in raw],
                   torch.zeros(MAX_PROGRAMS, dtype=torch.int64, device=raw[rank].device))

    @property
    def world(self) -> int:
        return len(self.data)

    def capacity(self, dtype: torch.dtype) -> int:
        """Elements of `dtype` one call can reduce (0 for dtypes wider than 4 bytes)."""
        return BLOCK * MAX_PROGRAMS if torch.empty((), dtype=dtype).element_size() <= 4 else 0

    def check(self, x: torch.Tensor) -> None:
        if not 1 <= self.world <= MAX_WORLD:
            raise ValueError(f"one-shot all-reduce supports 1..{MAX_WORLD} ranks, not {self.world}")
        if any(d.numel() < _data_bytes(self.world) for d in self.data):
            raise ValueError(f"each rank's data buffer must hold {_data_bytes(self.world)} bytes")
        if not x.is_contiguous():
            raise ValueError("one-shot all-reduce needs a contiguous tensor")
        if x.numel() > self.capacity(x.dtype):
            raise ValueError(f"{x.numel()} elements exceed the one-shot all-reduce capacity "
                             f"({self.capacity(x.dtype)} of {x.dtype})")


def _data_bytes(world: int) -> int:
    return 2 * world * MAX_PROGRAMS * BLOCK * 4


def symmetric_bytes(world: int) -> int:
    """Bytes of one rank's buffer: the flags, then the data regions."""
    return world * MAX_PROGRAMS * 8 + _data_bytes(world)


def _region_elems(dtype: torch.dtype) -> int:
    return BLOCK * 4 // torch.empty((), dtype=dtype).element_size()


def _regions(buf: torch.Tensor, dtype: torch.dtype, world: int) -> torch.Tensor:
    """A data buffer as [slot, rank, program, region elements] of dtype."""
    return buf[: _data_bytes(world)].view(dtype).view(2, world, MAX_PROGRAMS, _region_elems(dtype))


def one_shot_all_reduce_torch(x: torch.Tensor, bufs: PeerBuffers, timeout_s: float = 60.0) -> torch.Tensor:
    """The protocol in torch ops (host-driven: it synchronises the device and polls the flags from the host);
    sums x over the ranks in place and returns x."""
    bufs.check(x)
    W, rank = bufs.world, bufs.rank
    flat = x.view(-1)
    n = flat.numel()
    programs = triton.cdiv(n, BLOCK)
    if programs == 0:
        return x
    epochs = bufs.counters[:programs] + 1
    for p in range(programs):
        e, lo, hi = int(epochs[p]), p * BLOCK, min(n, (p + 1) * BLOCK)
        for r in range(W):
            if r != rank:
                _regions(bufs.data[r], x.dtype, W)[e % 2, rank, p, : hi - lo] = flat[lo:hi]
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    for p in range(programs):
        for r in range(W):
            if r != rank:
                bufs.flags[r][rank, p] = epochs[p]
    mine = _regions(bufs.data[rank], x.dtype, W)
    deadline = time.monotonic() + timeout_s
    for p in range(programs):
        e, lo, hi = int(epochs[p]), p * BLOCK, min(n, (p + 1) * BLOCK)
        for r in range(W):
            while r != rank and int(bufs.flags[rank][r, p]) < e:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {r} did not publish epoch {e} of program {p}")
                time.sleep(1e-5)
        acc = torch.zeros(hi - lo, dtype=torch.float32, device=x.device)
        for r in range(W):
            acc += (flat[lo:hi] if r == rank else mine[e % 2, r, p, : hi - lo]).float()
        flat[lo:hi] = acc.to(x.dtype)
    bufs.counters[:programs] = epochs
    return x


@triton.jit
def _peer(P0, P1, P2, P3, P4, P5, P6, P7, r: tl.constexpr):
    if r == 0:
        return P0
    elif r == 1:
        return P1
    elif r == 2:
        return P2
    elif r == 3:
        return P3
    elif r == 4:
        return P4
    elif r == 5:
        return P5
    elif r == 6:
        return P6
    else:
        return P7


@triton.jit
def _one_shot_all_reduce_kernel(X, n, COUNTERS,
                                D0, D1, D2, D3, D4, D5, D6, D7, F0, F1, F2, F3, F4, F5, F6, F7,
                                RANK: tl.constexpr, WORLD: tl.constexpr, MAXP: tl.constexpr, BLOCK: tl.constexpr,
                                REGION: tl.constexpr):
    p = tl.program_id(0)
    e = tl.load(COUNTERS + p) + 1
    slot = e % 2
    local = tl.arange(0, BLOCK)
    offs = p * BLOCK + local
    ok = offs < n
    x = tl.load(X + offs, mask=ok)
    for r in tl.static_range(WORLD):  # 1. this rank's chunk into every peer's buffer
        if r != RANK:
            region = ((slot * WORLD + RANK) * MAXP + p) * REGION
            tl.store(_peer(D0, D1, D2, D3, D4, D5, D6, D7, r) + region + local, x, mask=ok)
    tl.debug_barrier()  # every thread's stores precede the flag writes below
    for r in tl.static_range(WORLD):  # 2. publish the epoch
        if r != RANK:
            tl.atomic_xchg(_peer(F0, F1, F2, F3, F4, F5, F6, F7, r) + RANK * MAXP + p, e, sem="release", scope="sys")
    mine = _peer(D0, D1, D2, D3, D4, D5, D6, D7, RANK)
    my_flags = _peer(F0, F1, F2, F3, F4, F5, F6, F7, RANK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(WORLD):  # 3. + 4. wait for each peer's chunk, sum in rank order
        if r == RANK:
            acc += x.to(tl.float32)
        else:
            # compare-and-swap of e with e reads the flag and never changes it (no lost update of a peer's write)
            seen = tl.atomic_cas(my_flags + r * MAXP + p, e, e, sem="acquire", scope="sys")
            while seen < e:
                seen = tl.atomic_cas(my_flags + r * MAXP + p, e, e, sem="acquire", scope="sys")
            tl.debug_barrier()
            region = ((slot * WORLD + r) * MAXP + p) * REGION
            y = tl.load(mine + region + local, mask=ok, other=0.0, volatile=True)
            acc += y.to(tl.float32)
    tl.store(X + offs, acc.to(X.dtype.element_ty), mask=ok)
    tl.store(COUNTERS + p, e)


def one_shot_all_reduce(x: torch.Tensor, bufs: PeerBuffers) -> torch.Tensor:
    """Sum x over the ranks in place (one kernel, capturable in a CUDA graph); returns x."""
    bufs.check(x)
    W = bufs.world
    n = x.numel()
    programs = triton.cdiv(n, BLOCK)
    if programs == 0:
        return x
    data = [_regions(d, x.dtype, W) for d in bufs.data]
    data += [data[0]] * (MAX_WORLD - W)
    flags = list(bufs.flags) + [bufs.flags[0]] * (MAX_WORLD - W)
    _one_shot_all_reduce_kernel[(programs,)](x, n, bufs.counters, *data, *flags, RANK=bufs.rank, WORLD=W,
                                             MAXP=MAX_PROGRAMS, BLOCK=BLOCK, REGION=_region_elems(x.dtype),
                                             num_warps=8)
    return x
