"""Zeroed int32 scratch that a kernel leaves at zero when it ends (arrival and tile counters, per-expert counts).

Eager launches get one buffer per (purpose, device, stream), so launches that may overlap on other streams
each have their own. Launches captured into CUDA graphs share one buffer per (purpose, device), which is
allocated, with the eager one, the first time the purpose is asked for outside a capture: a buffer allocated
during a capture would come from the graph's memory pool, where other graphs of the same pool keep their
intermediates, and they would overwrite it. Graphs that use a purpose must therefore run it once eagerly
before the capture (as warm-ups do), and must not replay concurrently on different streams.
"""

from __future__ import annotations

import torch

_BUFFERS: dict = {}
_RETIRED: list = []  # graph buffers replaced by larger ones: graphs captured before may still use them
_GRAPHS = "graphs"  # the stream slot of the key for launches under capture
# the current stream's handle, read without building a torch Stream (slow host work on every call)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or \
    (lambda index: torch.cuda.current_stream(index).cuda_stream)


def zeroed_scratch(purpose: str, size: int, device: torch.device) -> torch.Tensor:
    """An int32 buffer of at least `size` words, zero whenever no kernel using it is running."""
    device = torch.device(device)
    if device.type != "cuda":
        key = (purpose, device.type, device.index, None)
        buf = _BUFFERS.get(key)
        if buf is None or buf.numel() < size:
            buf = _BUFFERS[key] = torch.zeros(size, dtype=torch.int32, device=device)
        return buf
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.is_current_stream_capturing():
        buf = _BUFFERS.get((purpose, "cuda", index, _GRAPHS))
        if buf is None or buf.numel() < size:
            raise RuntimeError(
                f"scratch {purpose!r} ({size} words) first asked for inside a CUDA graph capture: run the captured "
                "work once before capturing it (its buffer must not come from the graph's memory pool)")
        return buf
    key = (purpose, "cuda", index, _raw_stream(index))
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < size:
        buf = _BUFFERS[key] = torch.zeros(size, dtype=torch.int32, device=device)
        graphs = (purpose, "cuda", index, _GRAPHS)
        if graphs not in _BUFFERS or _BUFFERS[graphs].numel() < size:
            if graphs in _BUFFERS:
                _RETIRED.append(_BUFFERS[graphs])
            _BUFFERS[graphs] = torch.zeros(size, dtype=torch.int32, device=device)
    return buf

