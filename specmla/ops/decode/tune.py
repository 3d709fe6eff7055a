"""The decode routes measured on the GPU it runs on: for each (format, S, H) and a grid of (B, T) points, every
kernel that takes the call is timed with its own plan, and the fastest is the route's kernel at that point
(`specmla tune`, `benchmarks/bench_mla_decode.py --routes`). `dispatch.select_kernel` then takes, for a call, the
kernel of the nearest measured point (log B + log T).

A kernel's time: a CUDA graph of ≥ 16 back-to-back calls (as a decode step's graph runs them) over caches rotated
so that their total passes 4× L2, one replay divided per call, median of the replays.
"""

from __future__ import annotations

import statistics
import time

import torch

from specmla.ops.decode import dispatch
from specmla.ops.kv_cache import row_spec, write_kv_cache

ROUTE_CANDIDATES = {  # the kernels timed per format (each where it takes the call)
    "bf16": ("bf16", "bf16_seesaw", "triton"), "fp16": ("bf16", "bf16_seesaw", "triton"),
    "fp8": ("fp8", "fp8_folded", "dequant_seesaw", "triton"),
    "fp8_ds_mla": ("fp8", "fp8_folded", "dequant", "dequant_seesaw", "triton"),
    "tbq4": ("tbq4", "fp8_folded", "dequant", "dequant_seesaw", "triton"),
}
GRID_B = (1, 4, 16, 64, 128)
GRID_T = (2048, 8192, 32768, 131072)  # 128k: long contexts at small B, where the folded kernels win
PAGE = 64
SCALE = 0.1352
MAX_CACHE_BYTES = 8 << 30  # a grid point whose cache copies would pass this is left out


def row_bytes(kv: str) -> int:
    """Bytes of one cached token: 1152 (bf16), 608 (fp8), 656 (fp8_ds_mla), 400 (tbq4)."""
    width, dtype = row_spec(kv, 512, 64, torch.bfloat16)
    return width * dtype.itemsize


def make_cache(kv: str, latent: torch.Tensor) -> torch.Tensor:
    """bf16 latents [num_pages, PAGE, 576] → the cache in format kv (the latents themselves for bf16)."""
    if kv == "bf16":
        return latent
    n = latent.shape[0] * latent.shape[1]
    flat = latent.view(n, 576)
    cache = torch.empty(*latent.shape[:2], row_bytes(kv), dtype=torch.uint8, device=latent.device)
    write_kv_cache(cache, flat[:, :512], flat[:, 512:], torch.arange(n, device=latent.device), kv)
    return cache


def make_problem(H, B, T, S, copies, kv="bf16", device="cuda", lens=None):
    """`copies` caches of B requests × T tokens (random latents, pages shuffled), their queries [B, S, H, 576];
    `lens` (B lengths of at most T) makes the requests that long instead (the pages of T tokens stay allocated)."""
    pages_per = T // PAGE
    num_pages = B * pages_per
    caches = [make_cache(kv, torch.randn(num_pages, PAGE, 576, device=device, dtype=torch.bfloat16))
              for _ in range(copies)]
    table = torch.randperm(num_pages, device=device, dtype=torch.int32).view(B, pages_per)
    if lens is not None and (len(lens) != B or not all(S <= n <= T for n in lens)):
        raise ValueError(f"lens: want {B} lengths from S = {S} to T = {T}, got {lens}")
    seq = (torch.tensor(lens, dtype=torch.int32, device=device) if lens is not None
           else torch.full((B,), T, dtype=torch.int32, device=device))
    qs = [torch.randn(B, S, H, 576, device=device, dtype=torch.bfloat16) for _ in range(copies)]
    return caches, table, seq, qs


def copies_for(kv: str, B: int, T: int, l2_bytes: int) -> int:
    """Cache copies to rotate so that their total passes 4× L2 (at most 8)."""
    return max(1, min(8, -(-4 * l2_bytes // (B * T * row_bytes(kv)))))


def time_fn(fn, copies: int, iters: int = 30, warmup: int = 5, graph: bool = False) -> float:
    """Median seconds per fn(i) call over rotating inputs.

    graph=True: `calls` invocations (cycling over the copies) are captured in ONE CUDA graph and a
    replay is timed and divided by `calls` — the GPU time per call as it runs inside a decode-step
    graph. (Timing a single small kernel's replay would measure the host's graph-launch latency.)"""
    for i in range(warmup):
        fn(i % copies)
    torch.cuda.synchronize()
    calls = 1
    run = fn
    if graph:
        calls = max(copies, 16)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(calls):
                fn(i % copies)
        run = lambda i: g.replay()  # noqa: E731
        run(0)
        torch.cuda.synchronize()
        iters = max(5, iters // 3)
    times = []
    for i in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        run(i % copies)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3 / calls)
    return statistics.median(times)


def kernel_times(kv: str, H: int, B: int, T: int, S: int, device: torch.device) -> dict[str, float]:
    """Seconds per call of every ROUTE_CANDIDATES kernel that takes this call, each with its own plan."""
    from specmla.ops.decode import kernel_module, mla_decode, route

    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    copies = copies_for(kv, B, T, l2)
    caches, table, seq, qs = make_problem(H, B, T, S, copies, kv, device)
    out = torch.empty(B, S, H, 512, dtype=torch.bfloat16, device=device)
    times = {}
    for name in ROUTE_CANDIDATES[kv]:
        opts = kernel_module(name).Options()
        try:
            route(qs[0], caches[0], table, kv_format=kv, head_dim_v=512, opts=opts)
        except ValueError:  # this kernel does not take the call
            continue
        times[name] = time_fn(lambda i: mla_decode(qs[i], caches[i], table, seq, SCALE, out=out, head_dim_v=512,
                                                   kv_format=kv, opts=opts), copies, graph=True)
    return times


def grid(kv: str, B_values=GRID_B, T_values=GRID_T, l2_bytes: int = 50 << 20) -> list[tuple[int, int]]:
    """The (B, T) points measured for a format: the grid, without points whose rotated caches pass
    MAX_CACHE_BYTES."""
    return [(B, T) for B in B_values for T in T_values
            if B * T * row_bytes(kv) * copies_for(kv, B, T, l2_bytes) <= MAX_CACHE_BYTES]


def tune_routes(H: int, formats: list[str], query_tokens: list[int], device: torch.device, budget_s: float,
                measure=None, on_point=None, points=None) -> dict:
    """The "decode_routes" table of these heads, formats and query tokens: {"routes": {"fmt,S,H": [[B, T,
    fastest kernel], ...]}, "us": the evidence}. `measure(kv, H, B, T, S)` gives {kernel: seconds} (default:
    `kernel_times` on `device`); `points(kv)` the (B, T) grid (default `grid`). Past `budget_s` the remaining
    points are left to the rules (the table says how many)."""
    device = torch.device(device)
    measure = measure or (lambda kv, H, B, T, S: kernel_times(kv, H, B, T, S, device))
    if points is None:
        l2 = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 50 << 20
        points = lambda kv: grid(kv, l2_bytes=l2)  # noqa: E731
    end = time.monotonic() + budget_s
    routes, evidence, skipped = {}, {}, 0
    for kv in formats:
        if kv not in ROUTE_CANDIDATES:
            raise ValueError(f"no decode kernels to time for cache format {kv!r} ({', '.join(ROUTE_CANDIDATES)})")
        for S in query_tokens:
            key = dispatch.route_key(kv, S, H)
            for B, T in points(kv):
                if time.monotonic() > end:
                    skipped += 1
                    continue
                times = measure(kv, H, B, T, S)
                if times:
                    routes.setdefault(key, []).append([B, T, min(times, key=times.get)])
                    evidence.setdefault(key, []).append([B, T, {k: round(t * 1e6, 2) for k, t in times.items()}])
                if on_point is not None:
                    on_point()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return {"routes": routes, "us": evidence, "points_left_to_rules": skipped}
