"""One decode call of a case, for Nsight Compute: `ncu ... python3 benchmarks/ncu_once.py H B T S [gluon]`."""

import sys

import torch
from bench_mla_decode import SCALE, make_problem

from specmla.ops.mla_decode_triton import mla_decode_triton

H, B, T, S = (int(x) for x in sys.argv[1:5])
gluon = len(sys.argv) > 5 and sys.argv[5] == "gluon"
caches, table, seq, qs = make_problem(H, B, T, S, 1)
for _ in range(2):
    mla_decode_triton(qs[0], caches[0], table, seq, SCALE, head_dim_v=512, gluon=gluon)
torch.cuda.synchronize()
