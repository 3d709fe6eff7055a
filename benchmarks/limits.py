"""Device ceilings measured in the same run as a benchmark: copy bandwidth (GB/s) and bf16 GEMM rate (TFLOP/s).

The benchmarks import these and report every figure against them; run alone, it prints both for this device.
"""

from __future__ import annotations

import argparse
import statistics

import torch


def _median_seconds(fn, runs: int, warmup: int = 2) -> float:
    """Median CUDA-event time of fn() over `runs` calls, the first `warmup` of them discarded."""
    times = []
    for _ in range(runs):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return statistics.median(times[warmup:])


def copy_bandwidth(device="cuda", nbytes: int = 2 << 30, reps: int = 12) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written (median of reps)."""
    if torch.device(device).type != "cuda":
        return float("nan")
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    t = _median_seconds(lambda: b.copy_(a), reps)
    return 2 * nbytes / t


def gemm_rate(device="cuda", n: int = 8192, reps: int = 10) -> float:
    """bf16 n×n×n matmul rate in FLOP/s (median of reps): the compute ceiling. Taken in the same run because clocks
    differ between machines and with heat: a compute-bound kernel's figure means little without it."""
    if torch.device(device).type != "cuda":
        return float("nan")
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    t = _median_seconds(lambda: a @ b, reps + 2)
    return 2 * n**3 / t


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    print(f"copy {copy_bandwidth() / 1e9:.0f} GB/s (read + write), bf16 GEMM 8192^3 {gemm_rate() / 1e12:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
