"""The tensor-parallel process group over torch.distributed (NCCL on GPUs, gloo on CPU).

Joining and leaving the group, torchrun detection, the all-reduce the sharded model layers call,
the byte broadcast that carries rank 0's request stream to the other ranks over a CPU (gloo) group, so that it
never waits on the GPU, and buffers every GPU of one host can write (torch's symmetric memory), which the
layers' one-shot all-reduce uses. Imports only torch.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

_CONTROL = None  # the gloo group of the byte broadcasts (the default group itself on CPU)
_SYMMETRIC: list = []  # this rank's symmetric allocation and its handle, kept alive until the group goes
_PEERS: list[torch.Tensor] | None = None  # every rank's symmetric buffer as mapped in this process
_PEER_VIEWS: dict = {}  # what the buffers' users derive from them (views), dropped with the group


def tp_group_size() -> int:
    """Ranks in the group; 1 when no group is set up."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce_(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the group in place with torch.distributed (a no-op without a group); returns `x`."""
    if tp_group_size() > 1:
        dist.all_reduce(x)
    return x


def symmetric_buffers() -> list[torch.Tensor] | None:
    """Rank r's symmetric byte buffer at index r, as mapped in this process (zeroed when the group was set up);
    None where the group has none (CPU, several hosts, no peer access, or none asked for)."""
    return _PEERS


def symmetric_views() -> dict:
    """A dict for the symmetric buffers' users to keep what they derive from them; emptied when the group goes."""
    return _PEER_VIEWS


def _group_min(value: int) -> int:
    """The smallest of every rank's `value` (a collective call)."""
    t = torch.tensor([value], dtype=torch.int64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _map_symmetric(rank: int, world: int, nbytes: int) -> list[torch.Tensor] | None:
    """Allocate nbytes of torch's symmetric memory on this GPU, zeroed, and map every rank's (a collective call).
    Every rank gets them, or none does: the ranks agree after the allocation, before the collective mapping."""
    buf = peers = None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        name = dist.group.WORLD.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # required by older torch, a no-op in newer
            symm_mem.enable_symm_mem_for_group(name)
        buf = symm_mem.empty(nbytes, dtype=torch.uint8, device="cuda")
        buf.zero_()
    except Exception as e:  # no symmetric memory here, an older torch: the layers use NCCL for every all-reduce
        log.warning("no symmetric memory on rank %d (%s: %s): all-reduces go through NCCL", rank, type(e).__name__, e)
        buf = None
    if not _group_min(buf is not None):  # every rank allocated
        return None
    try:
        handle = symm_mem.rendezvous(buf, name)
        peers = [handle.get_buffer(r, (nbytes,), torch.uint8) for r in range(world)]
    except Exception as e:  # no peer access between these GPUs
        log.warning("symmetric memory not mapped on rank %d (%s: %s): all-reduces go through NCCL", rank,
                    type(e).__name__, e)
        peers = None
    if not _group_min(peers is not None):  # every rank mapped its peers
        return None
    torch.cuda.synchronize()
    dist.barrier()  # every rank's buffer is zeroed before any rank writes into another's
    _SYMMETRIC.extend([buf, handle])
    return peers


def launched_by_torchrun() -> bool:
    """Whether torchrun started this process as one rank of several."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1


def local_rank(rank: int) -> int:
    """This process's GPU index: torchrun's LOCAL_RANK, else the global rank (one host)."""
    return int(os.environ.get("LOCAL_RANK", rank))


def init_group(rank: int, world: int, init_file: str | None, device: str, symmetric_bytes: int = 0) -> None:
    """Join the tensor-parallel group: env:// under torchrun (multi-node), else a shared file. symmetric_bytes > 0:
    also map that many bytes of symmetric memory per rank, where the group's GPUs are all on this host."""
    backend = "gloo" if device == "cpu" else "nccl"
    if device != "cpu":
        torch.cuda.set_device(local_rank(rank))
    init = "env://" if init_file is None else f"file://{init_file}"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    global _CONTROL, _PEERS
    _CONTROL = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    one_host = init_file is not None or int(os.environ.get("LOCAL_WORLD_SIZE", 0)) == world
    if backend == "nccl" and one_host:  # the ranks agree on the size (0 where one rank asks for none)
        size = _group_min(symmetric_bytes)
        if size > 0:
            _PEERS = _map_symmetric(rank, world, size)


def destroy_group() -> None:
    """Leave the group (every rank calls it once, after the last collective)."""
    global _CONTROL, _PEERS
    _CONTROL = _PEERS = None
    _PEER_VIEWS.clear()
    if _SYMMETRIC:
        torch.cuda.synchronize()
        dist.barrier()  # no rank still writes into another's buffer
        _SYMMETRIC.clear()
    dist.destroy_process_group()


def broadcast_bytes(data: bytes | None = None, src: int = 0, *, stop: bool = False) -> bytes | None:
    """Rank `src` sends `data` to every rank over the CPU group: an int64 length (-1 for `stop`), then the bytes
    when there are any. Every rank returns the bytes (b"" for none), or None for a stop."""
    header = torch.tensor([-1 if stop else len(data or b"")], dtype=torch.int64)
    dist.broadcast(header, src=src, group=_CONTROL)
    n = int(header[0])
    if n < 0:
        return None
    if n == 0:
        return b""
    payload = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if dist.get_rank() == src
               else torch.empty(n, dtype=torch.uint8))
    dist.broadcast(payload, src=src, group=_CONTROL)
    return payload.numpy().tobytes()
