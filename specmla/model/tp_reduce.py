"""The sum over the tensor-parallel ranks that ends each sharded layer (o_proj, the dense MLP, the MoE).

Messages that fit the one-shot capacity (every decode step's) go through `ops.all_reduce.one_shot_all_reduce`
over the group's symmetric buffers, where `specmla.distributed` mapped them (GPUs of one host); the others, and
groups without those buffers, through torch.distributed (NCCL, gloo). Every rank takes the same branch for a
given tensor: the choice depends on its size and dtype only, and the buffers exist on every rank or on none.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from specmla import distributed
from specmla.ops.all_reduce import PeerBuffers, one_shot_all_reduce


def _peer_buffers() -> PeerBuffers | None:
    """This rank's view of the group's symmetric buffers (made once per group: epochs start at zero)."""
    raw = distributed.symmetric_buffers()
    if raw is None:
        return None
    views = distributed.symmetric_views()
    if "one_shot" not in views:
        views["one_shot"] = PeerBuffers.split(dist.get_rank(), raw)
    return views["one_shot"]


def tp_all_reduce_(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tensor-parallel group in place (a no-op without one); returns `x`."""
    if distributed.tp_group_size() == 1:
        return x
    bufs = _peer_buffers()
    if bufs is not None and x.is_cuda and x.is_contiguous() and x.numel() <= bufs.capacity(x.dtype):
        return one_shot_all_reduce(x, bufs)
    return distributed.all_reduce_(x)
