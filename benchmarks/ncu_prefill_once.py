"""One causal prefill call for Nsight Compute: `ncu ... python3 benchmarks/ncu_prefill_once.py H S [triton|sdpa]`
(d_qk 192 / d_v 128, bf16; the default call unless "triton" asks for the Triton kernel; "sdpa" adds one torch
SDPA call after ours, with q/k/v viewed as the benchmark views them). Only the calls after the warm-up run
inside the profiler range (`ncu --profile-from-start off`)."""

import sys

import torch
import torch.nn.functional as F
from bench_prefill import causal_problem

from specmla.ops.prefill import mla_prefill_triton

H, S = int(sys.argv[1]), int(sys.argv[2])
mode = sys.argv[3] if len(sys.argv) > 3 else ""
gluon = False if mode == "triton" else None
q, k, v, cu, _, (qs, ks, vs) = causal_problem(H, S)


def calls():
    mla_prefill_triton(q, k, v, cu, cu, S, S, 0.072, gluon=gluon)
    if mode == "sdpa":
        F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=0.072)


calls()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
calls()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
