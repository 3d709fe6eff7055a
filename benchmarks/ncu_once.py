"""One decode call of a case, for Nsight Compute: `ncu ... python3 benchmarks/ncu_once.py H B T S [gluon] [kv]`
(kv: bf16, fp8 or tbq4; FP8_PROBE=N sets `ops.mla_decode_gluon_quant.PROBE`; FP8MMA=1 sends fp8 calls to
`ops.mla_decode_gluon_fp8mma`, FP8REG=1 to `ops.mla_decode_gluon_fp8reg`, TBQ4REG=1 tbq4 calls to
`ops.mla_decode_gluon_tbq4reg`; SET="mla_decode_gluon_fp8reg.PROBE=6 ..." sets module values as
`decode_call_profile.py --set` does)."""

import os

import sys

import torch
from bench_mla_decode import SCALE, make_problem
from decode_call_profile import apply

from specmla.ops.decode.hopper import fp8mma as mla_decode_gluon_fp8mma
from specmla.ops.decode.hopper import fp8 as mla_decode_gluon_fp8reg
from specmla.ops.decode.hopper import dequant as mla_decode_gluon_quant
from specmla.ops.decode.hopper import tbq4 as mla_decode_gluon_tbq4reg
from specmla.ops.decode.triton import mla_decode_triton

H, B, T, S = (int(x) for x in sys.argv[1:5])
gluon = len(sys.argv) > 5 and sys.argv[5] == "gluon"
kv = sys.argv[6] if len(sys.argv) > 6 else "bf16"
mla_decode_gluon_quant.PROBE = int(os.environ.get("FP8_PROBE", "0"))
mla_decode_gluon_fp8mma.USE = os.environ.get("FP8MMA") == "1"
mla_decode_gluon_fp8reg.USE = os.environ.get("FP8REG") == "1"
mla_decode_gluon_tbq4reg.USE = os.environ.get("TBQ4REG") == "1"
apply(os.environ.get("SET", "").split())
caches, table, seq, qs = make_problem(H, B, T, S, 1, kv)
for _ in range(2):
    mla_decode_triton(qs[0], caches[0], table, seq, SCALE, head_dim_v=512, gluon=gluon, kv_format=kv)
torch.cuda.synchronize()
