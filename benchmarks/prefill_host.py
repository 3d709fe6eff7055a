"""Issue-8 probe: host time per prefill call. A small causal call (256 tokens, H=16, d_qk 192 / d_v 128,
bf16) takes the GPU a few µs, so back-to-back calls run at the speed of the host: the figure is the host time
of one call. `mla_prefill` (the dispatching entry point), `mla_prefill_gluon` with the direct launch
(`FAST_LAUNCH`) and through Triton's own launch path, and torch SDPA, in two rounds.

    PYTHONPATH=.:benchmarks python3 benchmarks/prefill_host.py
"""
import json
import time

import torch
import torch.nn.functional as F

from specmla.ops import prefill as M
from specmla.ops.prefill import hopper as P


def host_us(fn, n=400):
    """Mean wall time of n back-to-back calls (µs), after 20 warm-up calls."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return round((time.perf_counter() - t) / n * 1e6, 1)


def main():
    S, H = 256, 16
    q = torch.randn(S, H, 192, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn(S, H, 128, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, S], dtype=torch.int32, device="cuda")
    qs, ks, vs = (t.transpose(0, 1)[None] for t in (q, k, v))
    for _ in range(2):
        row = {}
        for fast in (True, False):
            P.FAST_LAUNCH = fast
            tag = "direct" if fast else "triton_launch"
            row[f"mla_prefill_{tag}"] = host_us(lambda: M.mla_prefill(q, k, v, cu, cu, S, S, 0.072))
            row[f"gluon_{tag}"] = host_us(lambda: P.mla_prefill_gluon(q, k, v, cu, cu, S, S, 0.072))
        P.FAST_LAUNCH = True
        row["sdpa"] = host_us(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=0.072))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
