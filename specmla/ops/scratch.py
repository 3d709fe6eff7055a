"""Zeroed int32 scratch that a kernel leaves at zero when it ends (arrival and tile counters, per-expert counts).

One buffer per (purpose, device, stream): launches that may overlap (other streams) each get their own. A
buffer first asked for while a CUDA graph is being captured is zeroed by a memset inside the graph, so it is
only valid once that graph has replayed; callers warm up before capturing, as the engine does.
"""

from __future__ import annotations

import torch

_BUFFERS: dict = {}
# the current stream's handle, read without building a torch Stream (slow host work on every call)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or \
    (lambda index: torch.cuda.current_stream(index).cuda_stream)


def zeroed_scratch(purpose: str, size: int, device: torch.device) -> torch.Tensor:
    """An int32 buffer of `size` words, zero whenever no kernel using it is running."""
    device = torch.device(device)
    key = (purpose, device.type, device.index, _raw_stream(device.index) if device.type == "cuda" else 0)
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < size:
        buf = _BUFFERS[key] = torch.zeros(size, dtype=torch.int32, device=device)
    return buf
