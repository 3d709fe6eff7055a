"""The tensor-parallel process group over torch.distributed (NCCL on GPUs, gloo on CPU).

Joining and leaving the group, torchrun detection, the all-reduce the sharded model layers call,
and the byte broadcast that carries rank 0's request stream to the other ranks over a CPU (gloo) group, so that it
never waits on the GPU. Imports only torch.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

_CONTROL = None  # the gloo group of the byte broadcasts (the default group itself on CPU)


def tp_group_size() -> int:
    """Ranks in the group; 1 when no group is set up."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce_(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the group in place (a no-op without a group); returns `x`."""
    if tp_group_size() > 1:
        dist.all_reduce(x)
    return x


def launched_by_torchrun() -> bool:
    """Whether torchrun started this process as one rank of several."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1


def local_rank(rank: int) -> int:
    """This process's GPU index: torchrun's LOCAL_RANK, else the global rank (one host)."""
    return int(os.environ.get("LOCAL_RANK", rank))


def init_group(rank: int, world: int, init_file: str | None, device: str) -> None:
    """Join the tensor-parallel group: env:// under torchrun (multi-node), else a shared file."""
    backend = "gloo" if device == "cpu" else "nccl"
    if device != "cpu":
        torch.cuda.set_device(local_rank(rank))
    init = "env://" if init_file is None else f"file://{init_file}"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    global _CONTROL
    _CONTROL = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD


def destroy_group() -> None:
    """Leave the group (every rank calls it once, after the last collective)."""
    global _CONTROL
    _CONTROL = None
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
