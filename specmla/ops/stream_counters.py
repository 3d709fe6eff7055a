"""Zeroed int32 words for kernels that coordinate their programs through atomics (the prefill's tile
queue, the decode's in-launch combine), one set per (device, stream, purpose).

Each kernel leaves its words at zero when it ends, so the next launch, or a CUDA-graph replay, finds
them ready; launches that may overlap (other streams) each get their own. A set is allocated once and
kept for the process's life: a captured graph holds its address.
"""

from __future__ import annotations

import torch

_WORDS: dict = {}  # (device index, stream, purpose) → int32 tensor
# the current stream's handle without building a torch Stream (about 15 µs of host time per call otherwise)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or \
    (lambda index: torch.cuda.current_stream(index).cuda_stream)


def key(device: torch.device, purpose: str) -> tuple:
    return device.index, _raw_stream(device.index) if device.type == "cuda" else 0, purpose


def zeroed_words(device: torch.device, purpose: str, n: int) -> torch.Tensor:
    """n int32 words for `purpose` on the current stream of `device` (the same tensor on every call)."""
    k = key(device, purpose)
    words = _WORDS.get(k)
    if words is None:
        words = _WORDS[k] = torch.zeros(n, dtype=torch.int32, device=device)
    elif words.numel() < n:
        raise ValueError(f"{purpose!r} asked for {n} counter words; this stream's set has {words.numel()}")
    return words
