"""The device's measured ceilings, shared by the benchmarks (METHOD.md: measure them in the same run)."""

from __future__ import annotations

import statistics

import torch


def copy_bandwidth(device="cuda", nbytes: int = 2 << 30, reps: int = 12) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written (median of reps)."""
    if torch.device(device).type != "cuda":
        return float("nan")
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * nbytes / statistics.median(times[2:])
